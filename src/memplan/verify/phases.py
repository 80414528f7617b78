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


class Recorder:
    """The list of phases with their peaks, plus the timeline of labelled memory_allocated readings."""

    def __init__(self, meter: Meter):
        self.meter = meter
        self.phases: list[dict[str, Any]] = []
        self.timeline: list[dict[str, Any]] = []
        self.current: str | None = None
        self._t0 = 0.0

    def begin(self, name: str) -> None:
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
        })
        self.current = None

    def mark(self, label: str) -> None:
        self.timeline.append({"phase": self.current, "label": label, "allocated_bytes": self.meter.allocated()})

    def last_label(self) -> str | None:
        """The last timeline label recorded in the current phase (for "OOM in backward, layer 3")."""
        if self.timeline and self.timeline[-1]["phase"] == self.current:
            return self.timeline[-1]["label"]
        return None

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


class TimelineHooks:
    """Forward (and, where safe, backward) hooks on every decoder layer and the final norm / lm_head."""

    def __init__(self, recorder: Recorder, layers: list, finals: list, backward: bool):
        self.recorder = recorder
        self.handles: list = []
        for i, layer in enumerate(layers):
            self._forward(layer, f"layer {i}")
            if backward:
                self._backward(layer, f"layer {i}")
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

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
