"""Queries over a job's ledger: peak allocated, the breakdown at the peak, the phases, and — replayed through the
caching-allocator simulator (memplan.allocator) — peak reserved.

Peaks are read the way memplan.verify measures them: per phase, with the peak counters reset at each phase
start, over the training phases (init excluded); the most loaded phase sets the figure.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ledger import Ledger, block_bytes
from ..result import Part, Phase
from ..specs import Job

INIT = "init"
#: the breakdown's part for the bytes of unsplit large-pool blocks beyond their requests (see _counted)
UNSPLIT_PART = "allocator_unsplit_blocks"


@dataclass(frozen=True, slots=True)
class LedgerSummary:
    """The headline numbers of one replayed ledger."""

    peak_allocated_bytes: int
    peak_phase: str
    peak_event: int
    peak_reserved_bytes: int
    components: tuple[Part, ...]  # live at the peak, by component
    timeline: tuple[Phase, ...]  # each phase's live set at its own peak
    num_alloc_retries: int
    oom_event: int | None
    #: peak reserved with the GPU a whole phase behind the CPU (estimator.gpu_behind): None where no tensor is
    #: freed with record_stream, so peak_reserved_bytes is the bound too
    peak_reserved_behind_bytes: int | None = None


def allocator_config(job: Job, card_bytes: int | None = None):
    """The simulator's settings for the job's PYTORCH_CUDA_ALLOC_CONF."""
    from ..allocator import AllocatorConfig
    from ..units import MiB

    a = job.training.allocator
    return AllocatorConfig(
        expandable_segments=a.expandable_segments,
        max_split_size_bytes=None if a.max_split_size_mb is None else a.max_split_size_mb * MiB,
        roundup_power2_divisions=a.roundup_power2_divisions, card_bytes=card_bytes)


def _parts(L: Ledger, live: list[int]) -> tuple[Part, ...]:
    by: dict[str, int] = {}
    names: dict[str, str] = {}
    for t in live:
        c = L.components[t]
        by[c] = by.get(c, 0) + block_bytes(L.sizes[t])
        names.setdefault(c, L.names[t])
    return tuple(Part(name=c, bytes=n, detail=f"e.g. {names[c]}") for c, n in by.items() if n)


def _counted(L: Ledger, live: list[int], counted_bytes: int) -> tuple[Part, ...]:
    """The live set's parts plus what torch's allocated counter adds on top of their 512-rounded sizes: a
    large-pool block handed out unsplit (should_split: remainder at most kSmallSize) counts whole in
    max_memory_allocated, so the breakdown sums to the peak the estimate reports."""
    parts = _parts(L, live)
    extra = counted_bytes - sum(p.bytes for p in parts)
    if extra > 0:
        parts += (Part(name=UNSPLIT_PART, bytes=extra, detail="cached blocks handed out whole (should_split)"),)
    return parts


def summarize(job: Job, L: Ledger, card_bytes: int | None = None, timeline: bool = True,
              sim=None, gpu=None, emulated: bool = False) -> LedgerSummary:
    """Replay ``L`` and read its peaks (see the module docstring). Peak allocated is the simulator's
    torch.cuda.max_memory_allocated (a large-pool block left unsplit counts whole, as in torch's counter); the
    breakdown is the live set where the ledger's own count peaks in that phase. Peak reserved is the replay of
    the ledger as the GPU's progress completes its deferred frees (estimator.gpu_time, on ``gpu``, a
    memplan.gpus.GpuSpec: the reference GPU when None; ``emulated``: rank 0 over torch's fake process group, whose
    copies cost the host). ``sim``: ``L`` already replayed (with the same settings)."""
    from ..allocator import simulate

    config = allocator_config(job, card_bytes)
    sim = sim or simulate(L, config)
    train = [p for p in sim.phases if p.label != INIT] or list(sim.phases)
    at_of = {label: at for label, _a, _z, _peak, at in L.phase_peaks()}
    best = max(train, key=lambda p: p.peak_allocated_bytes)
    live = L.live_sets([at_of[p.label] for p in train] if timeline else [at_of[best.label]])
    phases = tuple(Phase(name=p.label, parts=_counted(L, live[at_of[p.label]], p.peak_allocated_bytes))
                   for p in train) if timeline else ()
    keep_up = max(p.peak_reserved_bytes for p in train)
    reserved, after = keep_up, sim
    late = timed_replay(L, config, gpu, emulated)
    if late is not None:
        reserved = max(keep_up, _training_reserved(late))
        after = late
    return LedgerSummary(best.peak_allocated_bytes, best.label, at_of[best.label], reserved,
                         _counted(L, live[at_of[best.label]], best.peak_allocated_bytes), phases,
                         after.num_alloc_retries, None if after.oom is None else after.oom.event,
                         behind_reserved(job, L, reserved))


def _training_reserved(sim) -> int:
    train = [p for p in sim.phases if p.label != INIT] or list(sim.phases)
    return max(p.peak_reserved_bytes for p in train)


def timed_replay(L: Ledger, config, gpu=None, emulated: bool = False):
    """The replay of ``L`` with its deferred frees where ``gpu``'s progress completes them (estimator.gpu_time);
    None where nothing is freed with record_stream."""
    from ..allocator import simulate
    from ..gpus import reference_gpu
    from .gpu_time import GpuRates, timed

    late = timed(L, GpuRates.of(gpu or reference_gpu()), emulated)
    return None if late is None else simulate(late, config)


def behind_reserved(job: Job, L: Ledger, reserved: int) -> int | None:
    """Peak reserved of the training phases with the GPU a whole phase behind (estimator.gpu_behind), never below
    ``reserved`` (the plain replay's); None where the ledger frees nothing with record_stream."""
    from ..allocator import simulate
    from .gpu_behind import gpu_behind

    late = gpu_behind(L)
    if late is None:
        return None
    return max(reserved, _training_reserved(simulate(late, allocator_config(job))))
