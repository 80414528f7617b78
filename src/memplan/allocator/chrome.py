"""A ledger (and its replay) as Chrome trace-event JSON, which Perfetto (ui.perfetto.dev) and chrome://tracing open.

Time is the event index, written as microseconds. Process 0 holds the counters ("allocated": the live tensors'
512-rounded bytes, from the ledger; "reserved": from a SimResult's reserved_timeline when one is given) and the
marks (phase starts and empty_cache calls, as global instant events). Each component is a process of its own;
each of its tensors is one complete ("X") slice from its allocation to its free (or the ledger's end), with name,
component, bytes and stream in ``args``. Slices of a component are spread over lanes (its threads) so that no
two overlap on one lane, which the format needs (slices on a thread must nest).
"""

from __future__ import annotations

import heapq

from memplan.ledger import EMPTY_CACHE, block_bytes


def _lifetimes(ledger) -> list[tuple[int, int, int]]:
    """(tensor, alloc index, free index or len(events)) in allocation order."""
    born: dict[int, int] = {}
    out: list[tuple[int, int, int]] = []
    for i, ev in enumerate(ledger.events):
        if ev >= 0:
            born[ev] = i
        else:
            t = ~ev
            out.append((t, born.pop(t), i))
    end = len(ledger.events)
    out += [(t, a, end) for t, a in born.items()]
    out.sort(key=lambda x: x[1])
    return out


def chrome_trace(ledger, sim=None) -> dict:
    """The trace-event dict (``json.dump`` it to a .json file); ``sim`` is a SimResult of the same ledger, or None."""
    events: list[dict] = []
    cur = 0
    for i, d in enumerate(ledger.deltas()):
        if d:
            cur += d
            events.append({"name": "allocated", "ph": "C", "ts": i, "pid": 0, "args": {"bytes": cur}})
    if sim is not None:
        events.append({"name": "reserved", "ph": "C", "ts": 0, "pid": 0, "args": {"bytes": 0}})
        events += [{"name": "reserved", "ph": "C", "ts": i, "pid": 0, "args": {"bytes": r}}
                   for i, r in sim.reserved_timeline]
    for m in ledger.marks:
        name = "empty_cache" if m.kind == EMPTY_CACHE else m.label
        events.append({"name": name, "ph": "i", "s": "g", "ts": m.at, "pid": 0, "tid": 0, "args": {"kind": m.kind}})
    pids: dict[str, int] = {}
    lanes: dict[str, list[tuple[int, int]]] = {}  # component -> heap of (free index, lane)
    n_lanes: dict[str, int] = {}
    for t, a, f in _lifetimes(ledger):
        comp = ledger.components[t]
        pid = pids.setdefault(comp, len(pids) + 1)
        heap = lanes.setdefault(comp, [])
        if heap and heap[0][0] <= a:
            _, lane = heapq.heappop(heap)
        else:
            lane = n_lanes[comp] = n_lanes.get(comp, 0) + 1
        heapq.heappush(heap, (f, lane))
        events.append({"name": ledger.names[t], "cat": comp, "ph": "X", "ts": a, "dur": max(f - a, 1), "pid": pid,
                       "tid": lane, "args": {"component": comp, "bytes": block_bytes(ledger.sizes[t]),
                                             "requested_bytes": ledger.sizes[t], "stream": ledger.streams[t]}})
    events.sort(key=lambda e: e["ts"])
    meta = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "memory"}}]
    meta += [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": comp}} for comp, pid in pids.items()]
    return {"traceEvents": meta + events, "displayTimeUnit": "ms",
            "otherData": {"time_axis": "ledger event index (1 event = 1 us)", "tensors": len(ledger.sizes)}}
