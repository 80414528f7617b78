"""Development aid: how much of a GPU trace's peak reserved the caching allocator's deferred frees make.

A block used on a second stream (``record_stream``: ZeRO-3's gathered parameters, made on the all-gather stream
and used on the compute stream; gradients handed to the reduction stream) is freed in two events:
``free_requested`` when its last reference dies, ``free_completed`` once the CUDA events recorded then have
completed (CUDACachingAllocator process_events, at a later malloc). Until then the block cannot be reused.
memplan's ledger frees every tensor at once, which is the ``request`` column: the trace replayed with each
completion moved to its request. ``next-phase`` moves it to the harness's next synchronisation (an upper bound).

Usage: python tools/trace_deferred_frees.py TRACE.json.gz [...]
"""
from __future__ import annotations

import sys

from memplan.allocator import simulate
from memplan.allocator.replay import ledger_from_trace, measured_reserved, settings_config
from memplan.allocator.trace import ALLOC, FREE_COMPLETED, FREE_REQUESTED, MARKER_FUNCTION, read_trace

GIB = 2**30


def moved(trace: dict, mode: str) -> dict:
    """The trace with each free_completed moved to its free_requested (``request``) or to just before the next
    phase marker (``next-phase``)."""
    act, frames = trace["action"], trace["frames"]
    marks = [i for i, (a, f) in enumerate(zip(act, trace["frame"]))
             if a == ALLOC and f >= 0 and frames[f].endswith(":" + MARKER_FUNCTION)]
    n, pending, at = len(act), {}, {}
    for i, (a, ad) in enumerate(zip(act, trace["addr"])):
        if a == FREE_REQUESTED:
            pending[ad] = i
        elif a == FREE_COMPLETED and ad in pending:
            j = pending.pop(ad)
            later = [m for m in marks if m > j]
            at[i] = j if mode == "request" else (later[0] - 0.5 if later else n)
    order = [k[2] for k in sorted((at.get(i, i), int(i in at), i) for i in range(n))]
    out = dict(trace)
    for key in ("action", "addr", "size", "stream", "frame"):
        out[key] = [trace[key][i] for i in order]
    pos = {old: new for new, old in enumerate(order)}
    out["empty_cache_at"] = sorted(pos[i] for i in trace["empty_cache_at"])
    return out


def main() -> None:
    for path in sys.argv[1:]:
        trace = read_trace(path)
        cfg = settings_config(trace["allocator_settings"])
        row = [path.rsplit("/", 1)[-1], f"measured {measured_reserved(trace)['peak_reserved_bytes'] / GIB:.2f}"]
        for mode in ("request", "next-phase"):
            sim = simulate(ledger_from_trace(moved(trace, mode), allow_incomplete=True), cfg)
            row.append(f"{mode} {sim.peak_reserved_bytes / GIB:.2f}")
        print("  ".join(row), "GiB")


if __name__ == "__main__":
    main()
