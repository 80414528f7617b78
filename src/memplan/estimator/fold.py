"""Gradient accumulation folded: a job of many micro-steps replayed through a few, exactly.

The ledger's cost grows with layers × micro-steps; `plan` meets jobs of 64–512 micro-steps per optimizer step.
Between two optimizer steps every micro-step but the last (the boundary: reduction and step) runs the same
code, so it issues the same allocations; once one of them leaves the caching allocator in the state it found
(or, where the loop keeps the previous output alive across the next forward, the state of two micro-steps
before: period 2), every further one does the same and reads the same peaks. So the job is built with K
micro-steps (K of ga's parity, from FOLD_START) and kept when, in every optimizer step,
- the events of micro-steps K−3 and K−2 are the same (sizes, streams, and which tensor each free releases: one
  made in the span, by its place, or one live before it, by its rank among the live ones), and
- the allocator's state at the start of the boundary micro-step K−1 equals its state at the start of K−2
  (period 1) or K−3 (period 2, ga − K even) — memplan.allocator's ``signatures``.
Then the ga − K micro-steps left out would repeat a fixed point: the peaks are those of the full job. The
boundary micro-step's phases are renamed micro{ga−1}, as verify names them. If no K < ga qualifies, the job
is built whole. tests/test_ledger_fold.py checks folded against whole ledgers.
"""

from __future__ import annotations

from dataclasses import replace

from ..ledger import Ledger, Mark
from ..specs import Job

#: the fewest micro-steps tried (micro-steps 1 and 2 are the first two that follow one like themselves)
FOLD_START = 4
#: fold only above this many micro-steps (below, the whole job is as cheap)
FOLD_ABOVE = 6


def _span(L: Ledger, label: str) -> tuple[int, int]:
    spans = [(a, z) for lab, a, z in L.phase_spans() if lab.startswith(label)]
    return spans[0][0], spans[-1][1]


def _roles(L: Ledger, start: int, stop: int) -> list[tuple]:
    """The span's events with tensor ids replaced by roles (see the module docstring)."""
    alive: dict[int, None] = {}
    for ev in L.events[:start]:
        if ev >= 0:
            alive[ev] = None
        else:
            del alive[~ev]
    rank = {t: i for i, t in enumerate(alive)}
    made: dict[int, int] = {}
    out = []
    for ev in L.events[start:stop]:
        if ev >= 0:
            made[ev] = len(made)
            out.append((1, L.sizes[ev], L.streams[ev]))
        else:
            t = ~ev
            out.append((0, made[t]) if t in made else (-1, rank[t]))
    return out


def _periodic(L: Ledger, sim, steps: int, K: int, ga: int) -> bool:
    sigs = dict(sim.signatures)
    for s in range(steps):
        names = [f"step{s}.micro{m}.forward" for m in (K - 3, K - 2, K - 1)]
        if any(n not in sigs for n in names) or sigs[names[2]][0] is None:
            return False
        if _roles(L, *_span(L, f"step{s}.micro{K - 3}.")) != _roles(L, *_span(L, f"step{s}.micro{K - 2}.")):
            return False
        if not (sigs[names[2]] == sigs[names[1]] or ((ga - K) % 2 == 0 and sigs[names[2]] == sigs[names[0]])):
            return False
    return True


def _relabel(L: Ledger, sim, K: int, ga: int):
    """The boundary micro-step's phases named as in the whole job (micro{K-1} → micro{ga-1})."""
    old, new = f".micro{K - 1}.", f".micro{ga - 1}."
    L.marks[:] = [Mark(m.at, m.label.replace(old, new), m.kind) for m in L.marks]
    return replace(sim, phases=tuple(replace(p, label=p.label.replace(old, new)) for p in sim.phases))


def folded(job: Job, build, steps: int, skipped, config):
    """(ledger, its replay) of ``job`` built with fewer micro-steps when that is exact (module docstring), or
    None: build it whole. ``build(job, steps, skipped)`` is program.build_ledger."""
    from ..allocator import simulate

    ga = job.training.grad_accum
    if ga <= FOLD_ABOVE or config.expandable_segments or config.garbage_collection_threshold:
        return None
    K = FOLD_START + (ga - FOLD_START) % 2
    while K < ga:
        short = job.model_copy(update={"training": job.training.model_copy(update={"grad_accum": K})})
        L = build(short, steps, skipped)
        labels = [f"step{s}.micro{m}.forward" for s in range(steps) for m in (K - 3, K - 2, K - 1)]
        sim = simulate(L, config, signatures=labels)
        if sim.oom is None and _periodic(L, sim, steps, K, ga):
            return L, _relabel(L, sim, K, ga)
        K += 2
    return None
