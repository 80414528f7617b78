"""The ledger as the caching allocator sees it while the GPU runs behind the host: when each deferred free lands.

A tensor another stream used (``Tensor.record_stream``; the ledger's ``stream_used``) is not reusable when Python
frees it: CUDACachingAllocator::free records an event on each stream that used the block (insert_events) and hands
the block back to the free lists only once those events have completed, which it checks at the start of every
later malloc (process_events) and at empty_cache (synchronize_and_free_events). Under ZeRO-3 DeepSpeed frees two
kinds of tensor that way: every gathered parameter (partition_parameters.py free_param,
``param.data.record_stream(current_stream())``: the buffer was gathered on the all-gather stream) and every
gradient handed to the reduce stream (stage3.py __add_grad_to_ipg_bucket and partition_grads,
``param.grad.record_stream`` of the reduce stream, which waits for the compute stream first); with overlap_comm off
both streams are the default one and nothing is deferred. ZeRO-1/2 with overlap_comm frees the tensor each reduction
read the same way: the IPG buffer, or an extra-large parameter's grad (estimator.zero12, _on_reduction_stream). So a free completes at the first malloc the host makes
after the GPU has run every kernel queued before the free.

``timed(L, rates)`` replays the host and the GPU over the ledger's work records (estimator/timing.py): the host's
clock advances by each record's seconds and waits where the record says (an event's synchronize, a
``torch.cuda.synchronize``), and at every phase mark and empty_cache (memplan.verify brackets each phase with
``torch.cuda.synchronize()``; empty_cache synchronizes); each record's kernels start when the GPU is free and the
host has launched them, and run for max(operations / rate, bytes / bandwidth) plus a launch's minimum. CUDA's
launch queue holds 1021 kernels (benchmarks/allocator/gpu/launch_queue.json): the host blocks at the next launch
until the oldest has run. A deferred free completes at the compute stream's time when it was made; the returned
ledger moves it to just before the first allocation the host makes at or after that time. Allocations keep their
order; only peak reserved is read from it (allocated bytes drop at the free's request, where the plain ledger has
it). The reduce stream is the compute stream's queue here (it waits for it before each grad it takes), except
for offloaded grads' host-link copies, queued on it behind the reduction; the all-gather stream is a second queue
whose kernels (copies out of the flat buffer) start once the compute kernel running at their launch ends, and the
compute stream waits for it after each fetch. A host-link copy on a side stream runs on a copy engine: it waits for
its own stream's queue and the host's launch, not for a compute kernel (benchmarks/timing/h2d-copy-h100.jsonl).

``GpuRates`` turns operations and bytes into seconds for one GPU (memplan.gpus presets): the datasheet's rates
times the shares training kernels reach, measured on an H100 (benchmarks/timing/README.md).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..ledger import EMPTY_CACHE, NO_WAIT, STREAM_WAIT, SYNC, Ledger, Mark
from .timing import ATTENTION_CUDNN, ATTENTION_EFFICIENT, ATTENTION_FLASH, FAKE_COLLECTIVE, GEMM, GEMM_FP32, HOST_LINK

#: CUDA's launch queue: the 1022nd launch behind a busy kernel blocks (benchmarks/allocator/gpu/launch_queue.json)
LAUNCH_QUEUE = 1021
#: a kernel on a side stream (the all-gather stream's copies) starts after every compute kernel queued before its
#: launch (True), or once the one running at its launch ends (False: benchmarks/timing/kernels-h100.json
#: "side_stream", a copy launched behind twelve queued matrix products completes during the first or second)
SIDE_AFTER_QUEUE = False

# Shares of the datasheet rates (memplan.gpus) training kernels reach, and their fixed costs, measured on an H100
# (benchmarks/timing/kernels-h100.json; benchmarks/timing/README.md gives the fits):
#: cuBLAS matrix products in bf16 / fp16 at 25 transformer shapes (forward, grad of the input, grad of the weight):
#: time = operations / (share × dense tensor rate) + fixed, median error 7.6 %
GEMM_EFFICIENCY, GEMM_FIXED_S = 0.727, 20e-6
#: the same in fp32 on the CUDA cores (allow_tf32 off), median error 2.7 %
GEMM_FP32_EFFICIENCY, GEMM_FP32_FIXED_S = 0.766, 83e-6
#: sdpa's fused kernels, causal forward at 9 shapes (the median share)
ATTENTION_EFFICIENCY = {ATTENTION_CUDNN: 0.579, ATTENTION_FLASH: 0.296, ATTENTION_EFFICIENT: 0.168}
#: a device-to-device copy or an elementwise add of 256 MiB to 1 GiB against the HBM datasheet rate
MEMORY_EFFICIENCY = 0.89
#: the shortest a kernel takes, back to back (2000 one-element adds)
KERNEL_FLOOR_S = 6.8e-6
#: the share of the host link's rate a copy from pinned host memory reaches (not measured here: plan.perf's
#: PerfAssumptions.pcie_efficiency, nvbandwidth's host-to-device figure on PCIe 5 is about 80 % of 64 GB/s)
HOST_LINK_EFFICIENCY = 0.8


@dataclass(frozen=True, slots=True)
class GpuRates:
    """Operations per second of matrix products (16-bit, fp32) and of the fused attention kernels (by kind), and
    bytes per second of memory-bound kernels."""

    gemm: float
    gemm_fp32: float
    attention: tuple[float, float, float]  # ATTENTION_CUDNN, ATTENTION_FLASH, ATTENTION_EFFICIENT
    memory: float
    host_link: float = 25e9  # bytes per second of a copy from pinned host memory

    @classmethod
    def of(cls, gpu) -> GpuRates:
        """The rates of a memplan.gpus.GpuSpec (the reference H200's where the spec lacks one)."""
        from ..gpus import reference_gpu

        ref = reference_gpu()
        bf16 = (gpu.bf16_tflops or ref.bf16_tflops) * 1e12
        fp32 = (gpu.fp32_tflops or ref.fp32_tflops) * 1e12
        hbm = float(gpu.hbm_bytes_per_s or ref.hbm_bytes_per_s)
        link = float(gpu.pcie_bytes_per_s or ref.pcie_bytes_per_s)
        return cls(bf16 * GEMM_EFFICIENCY, fp32 * GEMM_FP32_EFFICIENCY,
                   tuple(bf16 * ATTENTION_EFFICIENCY[k] for k in (ATTENTION_CUDNN, ATTENTION_FLASH,
                                                                  ATTENTION_EFFICIENT)), hbm * MEMORY_EFFICIENCY,
                   link * HOST_LINK_EFFICIENCY)

    def seconds(self, kernel: int, flops: float, nbytes: int) -> float:
        """How long one record's kernels run."""
        if not flops and not nbytes:
            return 0.0
        if kernel == HOST_LINK:
            return nbytes / self.host_link + KERNEL_FLOOR_S
        moving = nbytes / self.memory
        if kernel == FAKE_COLLECTIVE:  # device-to-device copies
            return max(moving, KERNEL_FLOOR_S)
        if kernel == GEMM:
            return max(flops / self.gemm + GEMM_FIXED_S, moving)
        if kernel == GEMM_FP32:
            return max(flops / self.gemm_fp32 + GEMM_FP32_FIXED_S, moving)
        if kernel >= ATTENTION_CUDNN:
            return max(flops / self.attention[kernel - ATTENTION_CUDNN], moving) + KERNEL_FLOOR_S
        return max(moving, KERNEL_FLOOR_S)


def timed(L: Ledger, rates: GpuRates, emulated: bool = False) -> Ledger | None:
    """``L`` with each deferred free moved to where the caching allocator completes it (the module docstring);
    None when ``L`` frees nothing with record_stream (the plain ledger is then the allocator's view).
    ``emulated``: the run is rank 0 of N emulated on one GPU over torch's fake process group (memplan.verify's
    default), whose collectives' copies (timing.FAKE_COLLECTIVE records) cost the host and the GPU; a real job's
    replay leaves them out."""
    if not L.stream_used:
        return None
    out, marks, _ = _walk(L, rates, emulated=emulated)
    return L.reordered(out, marks)


def phase_seconds(L: Ledger, rates: GpuRates, emulated: bool = False) -> list[tuple[str, float]]:
    """(label, seconds) of each phase mark's span as the replay times it: from the mark's synchronization to the
    next one's (what memplan.verify's phases measure as wall_s)."""
    _, marks, at = _walk(L, rates, emulated=emulated)
    phases = [(m.label, t) for m, t in zip(marks, at) if m.kind != EMPTY_CACHE]
    return [(label, t1 - t0) for (label, t0), (_, t1) in zip(phases, phases[1:] + [("end", at[-1])])]


def launch_lags(L: Ledger, rates: GpuRates, emulated: bool = False) -> list[tuple[str, float]]:
    """(phase label, seconds) for every compute-stream kernel the replay launches: how long it waits on the GPU
    after the host queues it, the quantity tools/kernel_timeline.py measures as ``launch_delay_ms``."""
    lags: list[tuple[int, float]] = []
    _, marks, _ = _walk(L, rates, lags, emulated)
    return [(marks[i - 1].label if i else "", lag) for i, lag in lags]


def event_clocks(L: Ledger, rates: GpuRates, emulated: bool = False) -> list[tuple[float, float]]:
    """(host clock, compute-stream clock) in seconds at each of ``L.events`` as the replay reaches it: when the
    host makes that allocation or free, and when the GPU will have run every compute kernel queued by then."""
    clocks: list[tuple[float, float]] = []
    _walk(L, rates, emulated=emulated, clocks=clocks)
    return clocks


def _walk(L: Ledger, rates: GpuRates, lags: list | None = None, emulated: bool = False,
          clocks: list | None = None) -> tuple[list[int], list[Mark], list[float]]:
    """(events with each deferred free moved, the marks at their new places, the time each mark and the end are
    reached). Each stream is a clock: the compute stream (0) runs its kernels in order; a kernel on another stream
    (the reduce stream 1, the all-gather stream 2) starts once that stream is free, the host has launched it and the
    compute kernel running at its launch has ended (SIDE_AFTER_QUEUE). A host-link copy there starts once its stream
    is free and the host has launched it: a copy engine's, which waits for no compute kernel
    (benchmarks/timing/h2d-copy-h100.jsonl: 8 MiB to 256 MiB pinned copies on a side stream all ran during the
    product running at their launch). lone2-s4-037's blocking partition copies, complete up to 10 ms after their
    request with the running gemm, are queued behind the previous gather's kernels on the all-gather stream; the
    stream's clock keeps that wait (session 17 timed every host-link copy as waiting for nothing, its stream's queue
    included, and 7 of 8 lone offloaded ZeRO-3 rows moved further off). A STREAM_WAIT record holds its stream to
    another record's end; a deferred free completes at the clock of the stream that used the tensor."""
    used = L.stream_used
    events, wat, wcpu, wflops, wbytes = L.events, L.work_at, L.work_cpu_s, L.work_flops, L.work_bytes
    wkernel, wstream, wwait = L.work_kernel, L.work_stream, L.work_wait
    marks = L.marks
    mark_work = L.mark_work if len(L.mark_work) == len(marks) else [0] * len(marks)
    seconds = rates.seconds
    finish = [0.0] * len(wat)  # GPU time each record's kernels end
    queue: deque[tuple[float, float]] = deque()  # (start, end) of launched compute kernels, oldest first
    cpu = 0.0  # the host's clock
    clock = {0: 0.0}  # per stream: when its last queued kernel ends
    out: list[int] = []
    pending: dict[int, deque[tuple[float, int]]] = {}  # per using stream: (its clock at the free, the free)
    new_marks: list[Mark] = []
    reached: list[float] = []
    k = m = 0
    n_work, n_marks = len(wat), len(marks)

    def release(upto: float | None) -> None:
        """process_events: the pending frees whose events have completed by ``upto`` (all when None); each
        stream's complete in the order they were made."""
        for q in pending.values():
            while q and (upto is None or q[0][0] <= upto):
                out.append(q.popleft()[1])

    for i in range(len(events) + 1):
        while (here := k < n_work and wat[k] == i) or m < n_marks and marks[m].at == i:
            if m < n_marks and marks[m].at == i and (mark_work[m] <= k or not here):  # a phase (verify syncs) or
                cpu = max(cpu, *clock.values())  # empty_cache: all that is queued completes
                release(None)
                queue.clear()
                new_marks.append(Mark(len(out), marks[m].label, marks[m].kind))
                reached.append(cpu)
                m += 1
                continue
            w, st = wwait[k], wstream[k]
            if wkernel[k] == FAKE_COLLECTIVE and not emulated:  # a real job makes no such copies
                finish[k] = clock.get(st, 0.0)
                k += 1
                continue
            cpu += wcpu[k]
            if w == NO_WAIT:
                dur = seconds(wkernel[k], wflops[k], wbytes[k])
                while queue and queue[0][1] <= cpu:
                    queue.popleft()
                if st == 0:
                    if dur:
                        if len(queue) >= LAUNCH_QUEUE:
                            cpu = queue.popleft()[1]
                        start = max(clock[0], cpu)
                        if lags is not None:
                            lags.append((len(new_marks), start - cpu))
                        clock[0] = start + dur
                        queue.append((start, clock[0]))
                    finish[k] = clock[0]
                else:
                    if dur:
                        running = (cpu if wkernel[k] == HOST_LINK else clock[0] if SIDE_AFTER_QUEUE
                                   else queue[0][1] if queue and queue[0][0] <= cpu else cpu)
                        clock[st] = max(clock.get(st, 0.0), cpu, running) + dur
                    finish[k] = clock.get(st, 0.0)
            elif wkernel[k] == STREAM_WAIT:
                clock[st] = max(clock.get(st, 0.0), finish[w])
                finish[k] = clock[st]
            else:
                cpu = max(cpu, max(clock.values()) if w == SYNC else finish[w])
                finish[k] = clock[0]
            k += 1
        if i == len(events):
            break
        ev = events[i]
        if clocks is not None:
            clocks.append((cpu, clock[0]))
        if ev >= 0:
            release(cpu)  # process_events at the malloc
            out.append(ev)
        elif ~ev in used:
            by = used[~ev]  # the reduce stream waits for the compute stream before each grad it takes
            pending.setdefault(by, deque()).append((max(clock.get(by, 0.0), clock[0]), ev))
        else:
            out.append(ev)
    release(None)
    reached.append(max(cpu, *clock.values()))
    return out, new_marks, reached


__all__ = ["GpuRates", "LAUNCH_QUEUE", "event_clocks", "launch_lags", "phase_seconds", "timed"]
