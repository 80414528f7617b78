"""A Ledger from plain event tuples, for tests and tools that replay recorded allocations
(memplan.allocator.simulate_events)."""

from __future__ import annotations


def ledger_from_events(events) -> object:
    """A Ledger from ``(kind, key, nbytes, stream)`` tuples: kind "alloc" (key names the tensor), "free" (by key),
    "phase" (key is the label) or "empty_cache"; nbytes and stream are read for "alloc" only."""
    from memplan.ledger import EMPTY_CACHE, Ledger

    led = Ledger()
    ids: dict = {}
    for kind, key, nbytes, stream in events:
        if kind == "alloc":
            if key in ids:
                raise ValueError(f"alloc of {key!r}, which is live already")
            ids[key] = led.alloc(str(key), nbytes, "other", stream)
        elif kind == "free":
            if key not in ids:
                raise ValueError(f"free of {key!r}, which is not live")
            led.free(ids.pop(key))
        elif kind == "phase":
            led.mark(str(key))
        elif kind == "empty_cache":
            led.mark("empty_cache", EMPTY_CACHE)
        else:
            raise ValueError(f"event kind {kind!r}: use alloc, free, phase or empty_cache")
    return led
