"""memplan.allocator.chrome: Chrome trace-event JSON for Perfetto / chrome://tracing."""

from __future__ import annotations

import json

from memplan.allocator import simulate
from memplan.allocator.chrome import chrome_trace
from memplan.ledger import EMPTY_CACHE, Ledger

MiB = 2**20


def toy() -> Ledger:
    led = Ledger()
    led.mark("forward")
    a = led.alloc("act.0", 5 * MiB, "activations")
    b = led.alloc("act.1", 5 * MiB, "activations")
    g = led.alloc("bucket", 3 * MiB, "grad_bucket", stream=1)
    led.free(a)
    led.mark("backward")
    c = led.alloc("act.2", 5 * MiB, "activations")  # reuses act.0's lane: act.0 was freed before
    led.free(b)
    led.free(g)
    led.mark("empty_cache", EMPTY_CACHE)
    assert c >= 0
    return led


def test_chrome_trace_structure():
    led = toy()
    t = chrome_trace(led, simulate(led))
    json.dumps(t)
    evs = t["traceEvents"]
    assert {e["ph"] for e in evs} == {"M", "C", "X", "i"}
    timed = [e["ts"] for e in evs if e["ph"] != "M"]
    assert timed == sorted(timed)  # monotone time axis: the ledger event index
    slices = [e for e in evs if e["ph"] == "X"]
    assert [(e["name"], e["ts"], e["dur"], e["tid"]) for e in slices] == [
        ("act.0", 0, 3, 1), ("act.1", 1, 4, 2), ("bucket", 2, 4, 1), ("act.2", 4, 3, 1)]
    # act.2 is still live at the end: its slice runs to len(events) = 7
    assert slices[0]["args"] == {"component": "activations", "bytes": 5 * MiB, "requested_bytes": 5 * MiB, "stream": 0}
    names = {e["pid"]: e["args"]["name"] for e in evs if e["ph"] == "M"}
    assert names == {0: "memory", 1: "activations", 2: "grad_bucket"}
    alloc = [(e["ts"], e["args"]["bytes"] // MiB) for e in evs if e["ph"] == "C" and e["name"] == "allocated"]
    assert alloc == [(0, 5), (1, 10), (2, 13), (3, 8), (4, 13), (5, 8), (6, 5)]
    reserved = [(e["ts"], e["args"]["bytes"] // MiB) for e in evs if e["ph"] == "C" and e["name"] == "reserved"]
    # 20 MiB segment (two 5 MiB), a 20 MiB segment on stream 1, then the empty_cache at 7 frees stream 1's
    assert reserved == [(0, 0), (0, 20), (2, 40), (7, 20)]
    assert [(e["name"], e["ts"]) for e in evs if e["ph"] == "i"] == [("forward", 0), ("backward", 4), ("empty_cache", 7)]


def test_chrome_trace_without_a_replay_has_no_reserved_track():
    t = chrome_trace(toy())
    assert not [e for e in t["traceEvents"] if e.get("name") == "reserved"]
