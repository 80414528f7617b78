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


def summarize(job: Job, L: Ledger, card_bytes: int | None = None, timeline: bool = True) -> LedgerSummary:
    """Replay ``L`` and read its peaks (see the module docstring)."""
    from ..allocator import simulate

    sim = simulate(L, allocator_config(job, card_bytes))
    train = [p for p in sim.phases if p.label != INIT] or list(sim.phases)
    spans = {label: (a, z) for label, a, z in L.phase_spans()}
    best_label, best, best_at = None, -1, -1
    phases = []
    for p in train:
        a, z = spans[p.label]
        peak, at = L.peak(a, z)
        if at < 0:
            at = a - 1
        if peak > best:
            best_label, best, best_at = p.label, peak, at
        if timeline:
            phases.append(Phase(name=p.label, parts=_parts(L, L.live_at(at)) if at >= 0 else ()))
    reserved = max(p.peak_reserved_bytes for p in train)
    components = _parts(L, L.live_at(best_at)) if best_at >= 0 else ()
    return LedgerSummary(best, best_label or INIT, best_at, reserved, components, tuple(phases),
                         sim.num_alloc_retries, None if sim.oom is None else sim.oom.event)
