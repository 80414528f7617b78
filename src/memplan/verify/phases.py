"""Per-phase peak counters and the layer-boundary timeline (worker side; imports torch lazily).

A phase is bracketed by `begin(name)` — synchronize, reset the peak counters — and `end()` — synchronize,
read max_memory_allocated, max_memory_reserved and memory_allocated. Nothing else in the hot path syncs.
On a CPU device (tests) every counter reads 0: the flow is exercised, the numbers are not.
"""

from __future__ import annotations

import time
from typing import Any


class Meter:
    """torch.cuda's memory counters, or zeros on the CPU."""

    def __init__(self, device: str):
        import torch

        self.cuda = device.startswith("cuda")
        self._torch = torch

    def sync_reset(self) -> None:
        if self.cuda:
            self._torch.cuda.synchronize()
            self._torch.cuda.reset_peak_memory_stats()

    def stats(self) -> dict[str, int]:
        """The caching allocator's counters of the phase that just ended (torch.cuda.memory_stats)."""
        if not self.cuda:
            return {}
        raw = self._torch.cuda.memory_stats()
        return {key: int(raw.get(name, 0)) for key, name in STATS_KEYS}

    def read(self) -> tuple[int, int, int]:
        """(max allocated, max reserved, allocated now), after a synchronize."""
        if not self.cuda:
            return 0, 0, 0
        c = self._torch.cuda
        c.synchronize()
        return c.max_memory_allocated(), c.max_memory_reserved(), c.memory_allocated()

    def allocated(self) -> int:
        """memory_allocated without a synchronize (the allocator's count is host-side)."""
        return self._torch.cuda.memory_allocated() if self.cuda else 0


#: memory_stats() keys kept per phase (c10/cuda/CUDACachingAllocator.cpp DeviceStats; peaks since the phase's reset)
STATS_KEYS = (
    ("reserved_small_pool_peak_bytes", "reserved_bytes.small_pool.peak"),
    ("reserved_large_pool_peak_bytes", "reserved_bytes.large_pool.peak"),
    ("requested_peak_bytes", "requested_bytes.all.peak"),
    ("inactive_split_peak_bytes", "inactive_split_bytes.all.peak"),
    ("segments_current", "segment.all.current"),
    ("num_alloc_retries", "num_alloc_retries"),
    ("num_ooms", "num_ooms"),
    ("num_device_alloc", "num_device_alloc"),
    ("num_device_free", "num_device_free"),
)

#: entries the allocation trace keeps (torch.cuda.memory._record_memory_history max_entries): a 1B-parameter
#: job's three steps make a few hundred thousand
TRACE_MAX_ENTRIES = 3_000_000


#: environment variable: "0" records the allocation trace without stacks (``context=None``): no frame names,
#: but it runs under ZeRO-3, whose autograd functions fail ("returned NULL") while Python stacks are recorded
TRACE_STACKS_ENV = "MEMPLAN_TRACE_STACKS"


def memplan_phase_marker(torch, device: str) -> None:
    """One small allocation and free (MARKER_BYTES, one 512-byte block) that marks a phase start in a recorded
    allocation trace (the trace converter, memplan.allocator.trace, finds it by this function's name, or by its
    size in a trace without stacks). Small pool: it touches no block the job's large tensors use."""
    from ..allocator.trace import MARKER_BYTES

    marker = torch.empty(MARKER_BYTES, dtype=torch.uint8, device=device)
    del marker


def start_allocation_trace(torch) -> None:
    """Record the caching allocator's history: with Python stacks (the trace converter names frames by them)
    unless TRACE_STACKS_ENV is "0"."""
    import os

    if os.environ.get(TRACE_STACKS_ENV, "1") == "0":
        torch.cuda.memory._record_memory_history(max_entries=TRACE_MAX_ENTRIES, context=None)
    else:
        torch.cuda.memory._record_memory_history(max_entries=TRACE_MAX_ENTRIES, stacks="python")


def write_allocation_trace(torch, path: str, labels: list[str]) -> dict[str, Any]:
    """Stop recording and write what was recorded to ``path`` as a compact trace (memplan.allocator.trace) with
    the phase labels; the row's field for it: ``trace_file``, or ``trace_error`` (a trace is a side product)."""
    import os

    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    try:
        from ..allocator.trace import compact_trace, write_trace

        write_trace(path, compact_trace(snapshot, max_entries=TRACE_MAX_ENTRIES), {
            "phases": labels, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")})
        return {"trace_file": path}
    except Exception as exc:  # noqa: BLE001 - a trace is a side product; the row says why it is missing
        return {"trace_error": f"{type(exc).__name__}: {str(exc)[:200]}"}


class Recorder:
    """The list of phases with their peaks, plus the timeline of labelled memory_allocated readings.

    ``trace``: record the allocator's event history from ``start_trace`` on (CUDA only) and write it with
    ``finish`` as a compact JSON trace (memplan.allocator.trace), phase starts marked."""

    def __init__(self, meter: Meter, trace: bool = False):
        self.meter = meter
        self.trace = trace and meter.cuda
        self.labels: list[str] = []
        self.skipped: list[int] = []  # optimizer steps the fp16 loss scaler skipped
        self.phases: list[dict[str, Any]] = []
        self.timeline: list[dict[str, Any]] = []
        self.current: str | None = None
        self._t0 = 0.0

    def start_trace(self) -> None:
        if self.trace:
            start_allocation_trace(self.meter._torch)

    def begin(self, name: str) -> None:
        if self.trace:
            self.labels.append(name)
            memplan_phase_marker(self.meter._torch, "cuda")
        self.meter.sync_reset()
        self.current = name
        self._t0 = time.perf_counter()

    def end(self) -> None:
        peak, reserved, now = self.meter.read()
        self.phases.append({
            "name": self.current,
            "peak_allocated_bytes": peak,
            "peak_reserved_bytes": reserved,
            "allocated_end_bytes": now,
            "wall_s": round(time.perf_counter() - self._t0, 4),
            "stats": self.meter.stats(),
        })
        self.current = None

    def mark(self, label: str) -> None:
        self.timeline.append({"phase": self.current, "label": label, "allocated_bytes": self.meter.allocated()})

    def last_label(self) -> str | None:
        """The last timeline label recorded in the current phase (for "OOM in backward, layer 3")."""
        if self.timeline and self.timeline[-1]["phase"] == self.current:
            return self.timeline[-1]["label"]
        return None

    def finish(self, out_dir: str, rank: int) -> dict[str, Any]:
        """After training (or its failure): write the allocation trace when recording, and read what this
        process holds on the GPU outside torch's allocator. Returns the row's fields for both."""
        out: dict[str, Any] = {}
        if self.meter.cuda:
            out.update(process_gpu_bytes(self.meter._torch))
        if self.trace:
            import os

            out.update(write_allocation_trace(self.meter._torch, os.path.join(out_dir, f"trace-rank{rank}.json.gz"),
                                              self.labels))
        return out

    def summary(self) -> dict[str, Any]:
        """Peaks over the training phases (init excluded) and the init phase's own peak."""
        train = [p for p in self.phases if p["name"] != "init"]
        init = [p for p in self.phases if p["name"] == "init"]
        return {
            "peak_allocated_bytes": max((p["peak_allocated_bytes"] for p in train), default=None),
            "peak_reserved_bytes": max((p["peak_reserved_bytes"] for p in train), default=None),
            "peak_phase": max(train, key=lambda p: p["peak_allocated_bytes"])["name"] if train else None,
            "init_peak_allocated_bytes": init[0]["peak_allocated_bytes"] if init else None,
            "init_peak_reserved_bytes": init[0]["peak_reserved_bytes"] if init else None,
        }


def backward_marks(t) -> bool:
    """Whether verify marks the decoder layers' backward in a job of TrainingSpec ``t``: not where ZeRO-3's or
    checkpointing's autograd functions wrap the layers, nor with adapters or frozen groups."""
    return t.checkpointing == "none" and t.zero.stage < 3 and t.lora is None and not t.freeze


class TimelineHooks:
    """Forward hooks on every decoder layer and the final norm / lm_head, and backward marks on the layers.

    ``backward``: "none"; "tensor" — hooks on each layer's hidden-state output and argument tensors
    (Tensor.register_hook: called with the gradient once it is complete, keeping no reference to it, so the job's
    memory is what it would be without them); "module" — register_full_backward_pre_hook / _hook, as the job asks
    (TrainingSpec.layer_backward_hooks): torch's BackwardHook keeps each layer's output gradient until the layer's
    input gradient is done (estimator/layer_hooks.py), which changes how gradients accumulate."""

    def __init__(self, recorder: Recorder, layers: list, finals: list, backward: str):
        self.recorder = recorder
        self.handles: list = []
        for i, layer in enumerate(layers):
            self._forward(layer, f"layer {i}")
            if backward == "module":
                self._backward(layer, f"layer {i}")
            elif backward == "tensor":
                self._tensor_backward(layer, f"layer {i}")
        for label, module in finals:
            self._forward(module, label)

    def _forward(self, module, what: str) -> None:
        rec = self.recorder
        self.handles.append(module.register_forward_pre_hook(lambda *_: rec.mark(f"forward, {what}, before")))
        self.handles.append(module.register_forward_hook(lambda *_: rec.mark(f"forward, {what}, after")))

    def _backward(self, module, what: str) -> None:
        rec = self.recorder
        self.handles.append(module.register_full_backward_pre_hook(lambda *_: rec.mark(f"backward, {what}, before")))
        self.handles.append(module.register_full_backward_hook(lambda *_: rec.mark(f"backward, {what}, after")))

    def _tensor_backward(self, module, what: str) -> None:
        """Marks from hooks on the layer's hidden states (the first positional argument, else ``hidden_states``,
        and the output's first tensor): a tensor hook returning None changes nothing and holds nothing."""
        rec = self.recorder

        def mark_on(t, label: str) -> None:
            if getattr(t, "requires_grad", False) and hasattr(t, "register_hook"):
                t.register_hook(lambda _grad: rec.mark(label))

        def before_forward(_module, args, kwargs):
            mark_on(args[0] if args else kwargs.get("hidden_states"), f"backward, {what}, after")

        def after_forward(_module, _args, out):
            mark_on(out[0] if isinstance(out, (tuple, list)) and out else out, f"backward, {what}, before")

        self.handles.append(module.register_forward_pre_hook(before_forward, with_kwargs=True))
        self.handles.append(module.register_forward_hook(after_forward))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def process_gpu_bytes(torch) -> dict[str, Any]:
    """GPU memory this process holds as the driver counts it (NVML's per-process usedGpuMemory: CUDA context,
    torch's reserved segments, library workspaces outside torch), beside torch's own reserved bytes now."""
    import os

    out: dict[str, Any] = {"torch_reserved_end_bytes": int(torch.cuda.memory_reserved())}
    try:
        import pynvml

        pynvml.nvmlInit()
        index = torch.cuda.current_device()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                out["process_gpu_bytes"] = int(proc.usedGpuMemory)
        pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001 - not every driver/container reports per-process memory
        out["process_gpu_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
    return out
