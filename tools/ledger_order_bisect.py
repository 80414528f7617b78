"""Development aid: which phase's event order makes a row's ledger reserve differently from its GPU trace.

The trace's own events (memplan.allocator.replay.ledger_from_trace) are renamed into the ledger's tensors: each
phase's allocations and frees are aligned with the ledger's (difflib over (action, bytes)), allocations the other
side lacks are dropped from both, and the rest are replayed through the caching-allocator simulator with the
ledger's order in every phase but one, which takes the trace's order (then the trace's order for every phase up
to one; empty_cache marks are not replayed). A phase whose trace order alone moves the peak is where to look;
``--show PHASE`` prints that phase's differences in the ledger's names.

Usage: python tools/ledger_order_bisect.py ROW_NAME TRACE.json.gz [--show PHASE]
"""
from __future__ import annotations

import difflib
import sys
from pathlib import Path

from memplan.accuracy import iter_rows, job_of_row, skipped_steps
from memplan.allocator.replay import ledger_from_trace, settings_config
from memplan.allocator.sim import simulate
from memplan.allocator.trace import read_trace
from memplan.estimator import LEDGER_STEPS
from memplan.estimator.program import build_ledger
from memplan.estimator.summary import allocator_config
from memplan.ledger import Ledger

GIB = 2**30


def phases(L: Ledger) -> dict[str, tuple[int, int]]:
    return {label: (start, stop) for label, start, stop in L.phase_spans()}


def key(L: Ledger, e: int) -> tuple[str, int]:
    return ("A" if e >= 0 else "F", L.sizes[e if e >= 0 else ~e])


def matched_allocs(L: Ledger, T: Ledger) -> dict[int, int]:
    """Trace tensor → ledger tensor, for allocations aligned phase by phase."""
    pl, pt = phases(L), phases(T)
    out: dict[int, int] = {}
    for label, (a, b) in pt.items():
        if label not in pl:
            continue
        la, lb = pl[label]
        le, te = L.events[la:lb], T.events[a:b]
        sm = difflib.SequenceMatcher(a=[key(L, e) for e in le], b=[key(T, e) for e in te], autojunk=False)
        for op, i1, i2, j1, _ in sm.get_opcodes():
            if op == "equal":
                out.update((te[j1 + k], le[i1 + k]) for k in range(i2 - i1) if le[i1 + k] >= 0)
    return out


def hybrid(L: Ledger, T: Ledger, to_ledger: dict[int, int], trace_order: set[str]) -> Ledger:
    """The ledger's matched tensors, each phase in the ledger's order or (``trace_order``) the trace's."""
    kept = set(to_ledger.values())
    pl, pt = phases(L), phases(T)
    out, ids, live = Ledger(), {}, set()
    for label, (a, b) in pl.items():
        out.mark(label)
        if label in trace_order and label in pt:
            seq = [to_ledger[e] if e >= 0 else ~to_ledger[~e] for e in T.events[slice(*pt[label])]
                   if (e if e >= 0 else ~e) in to_ledger]
        else:
            seq = [e for e in L.events[a:b] if (e if e >= 0 else ~e) in kept]
        for e in seq:
            t = e if e >= 0 else ~e
            if e >= 0 and t not in ids:
                ids[t] = out.alloc(L.names[t], L.sizes[t], L.components[t], L.streams[t])
                live.add(t)
            elif e < 0 and t in live:  # a tensor the other order freed already, or never allocated here
                out.free(ids[t])
                live.discard(t)
    return out


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    name, trace_path = argv[0], argv[1]
    show = argv[argv.index("--show") + 1] if "--show" in argv else None
    row = next((r for r in iter_rows(Path("benchmarks/accuracy")) if r["name"] == name), None)
    if row is None:
        print(f"ledger_order_bisect: no row named {name}", file=sys.stderr)
        return 2
    job = job_of_row(row)
    L = build_ledger(job, steps=max(LEDGER_STEPS, row.get("steps", 3)), skipped=skipped_steps(row))
    trace = read_trace(trace_path)
    T = ledger_from_trace(trace, phases=[p["name"] for p in row["phases"]])
    config = allocator_config(job)
    to_ledger = matched_allocs(L, T)
    labels = list(phases(L))
    print(f"ledger {simulate(L, config).peak_reserved_bytes / GIB:.3f} GiB, trace "
          f"{simulate(T, settings_config(trace.get('allocator_settings') or {})).peak_reserved_bytes / GIB:.3f} GiB;"
          f" matched tensors only: ledger order {simulate(hybrid(L, T, to_ledger, set()), config).peak_reserved_bytes / GIB:.3f},"
          f" trace order {simulate(hybrid(L, T, to_ledger, set(labels)), config).peak_reserved_bytes / GIB:.3f}")
    for i, label in enumerate(labels):
        only = simulate(hybrid(L, T, to_ledger, {label}), config).peak_reserved_bytes / GIB
        upto = simulate(hybrid(L, T, to_ledger, set(labels[:i + 1])), config).peak_reserved_bytes / GIB
        print(f"  {label:28} trace order here only {only:8.3f}   up to here {upto:8.3f}")
    if show in phases(L):
        back = {v: k for k, v in to_ledger.items()}
        mine = [e for e in L.events[slice(*phases(L)[show])] if (e if e >= 0 else ~e) in back]
        theirs = [to_ledger[e] if e >= 0 else ~to_ledger[~e] for e in T.events[slice(*phases(T)[show])]
                  if (e if e >= 0 else ~e) in to_ledger]
        def text(e: int) -> str:
            return f"{'A' if e >= 0 else 'F'} {L.names[e if e >= 0 else ~e]} ({L.sizes[e if e >= 0 else ~e]})"
        for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=mine, b=theirs, autojunk=False).get_opcodes():
            if op != "equal":
                print(f"{op:8} ledger {[text(e) for e in mine[i1:i2]]}\n         trace  {[text(e) for e in theirs[j1:j2]]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
