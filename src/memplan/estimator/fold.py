"""Gradient accumulation folded: a job of many micro-steps replayed through a few, exactly.

The ledger's cost grows with layers × micro-steps; `plan` meets jobs of 64–512 micro-steps per optimizer step.
Between two optimizer steps every micro-step but the last (the boundary: reduction and step) runs the same
code, so it issues the same allocations. The caching allocator is deterministic: once the state at the start of
micro-step m2 equals the state at the start of an earlier m1 (memplan.allocator's ``signatures``), the states
cycle with period p = m2 − m1 from there on (p = 1 for most jobs, 2 where the loop keeps the previous output
alive across the next forward, longer where blocks drift through the free lists). So the job is built with K
micro-steps, K − 1 ≥ m2 (a whole cycle is built) and K − 1 ≡ ga − 1 (mod p) (the boundary starts from the state
the whole job's boundary starts from), and kept when, in every optimizer step,
- a cycle (m1 ≥ 1, m2) is found among the built non-boundary micro-steps with that congruence, and
- the events of micro-steps m1 and m1 + 1 are the same (sizes, streams, and which tensor each free releases:
  one made in the span, by its place, or one live before it, by its rank among the live ones).
Then the micro-steps left out repeat states already built: the peaks are those of the full job. The boundary
micro-step's phases are renamed micro{ga−1}, as verify names them. Probes double K (FOLD_START, 2·FOLD_START,
…) so that a job whose cycle is long costs at most about twice the build that finds it; if none below ga
qualifies, the job is built whole. tests/test_ledger_fold.py checks folded against whole ledgers.
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


def _cycle(sigs: dict, s: int, built: int) -> tuple[int, int] | None:
    """(m1, p): the first repeat of step ``s``'s allocator state among the starts of micro-steps 1..built−1."""
    seen: dict = {}
    for m in range(1, built):
        sig = sigs.get(f"step{s}.micro{m}.forward")
        if sig is None or sig[0] is None:
            return None
        if sig in seen:
            return seen[sig], m - seen[sig]
        seen[sig] = m
    return None


def _fold_size(cycles: list[tuple[int, int]], ga: int) -> int | None:
    """The fewest micro-steps K < ga with K − 1 past every cycle's first repeat and congruent to ga − 1."""
    for K in range(_least(cycles), ga):
        if _fits(cycles, K, ga):
            return K
    return None


def _least(cycles: list[tuple[int, int]]) -> int:
    """Micro-steps a build needs to show its cycles: through m1 + p, and m1 + 1 before the boundary."""
    return max(max(m1 + p, m1 + 2) for m1, p in cycles) + 1


def _fits(cycles: list[tuple[int, int]] | None, K: int, ga: int) -> bool:
    """Whether a build of K micro-steps with these cycles reads the whole job's peaks (module docstring)."""
    return (cycles is not None and K >= _least(cycles)
            and all((K - 1 - m1) % p == (ga - 1 - m1) % p for m1, p in cycles))


def _cycles(L: Ledger, sim, steps: int, built: int) -> list[tuple[int, int]] | None:
    sigs = dict(sim.signatures)
    out = []
    for s in range(steps):
        c = _cycle(sigs, s, built)
        if c is None:
            return None
        m1 = c[0]
        if _roles(L, *_span(L, f"step{s}.micro{m1}.")) != _roles(L, *_span(L, f"step{s}.micro{m1 + 1}.")):
            return None
        out.append(c)
    return out


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

    def run(K: int):
        short = job.model_copy(update={"training": job.training.model_copy(update={"grad_accum": K})})
        L = build(short, steps, skipped)
        labels = [f"step{s}.micro{m}.forward" for s in range(steps) for m in range(K)]
        return L, simulate(L, config, signatures=labels)

    probe = FOLD_START
    while probe < ga:
        L, sim = run(probe)
        if sim.oom is not None:
            return None
        cycles = _cycles(L, sim, steps, probe)
        K = None if cycles is None else _fold_size(cycles, ga)
        if K is not None:
            if K != probe:
                L, sim = run(K)
            if sim.oom is None and _fits(_cycles(L, sim, steps, K), K, ga):
                return L, _relabel(L, sim, K, ga)
        probe *= 2
    return None
