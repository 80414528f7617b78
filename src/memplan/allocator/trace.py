"""Real allocator traces: torch memory snapshots made small, stored as gzip'd JSON, turned into Ledgers.

Input is the dict ``torch.cuda.memory._snapshot()`` returns after
``torch.cuda.memory._record_memory_history(max_entries=N, stacks="python")``. What torch 2.11 puts in it
(DeviceCachingAllocator::record_trace and its callers in c10/cuda/CUDACachingAllocator.cpp; the dict is built by
torch/csrc/cuda/memory_snapshot.cpp; the fields are documented in torch.cuda.memory._snapshot):

- ``device_traces[d]``: the device's TraceEntry ring buffer, oldest first (RingBuffer::getEntries). Each event
  has ``action``, ``addr`` (``device_free`` instead for "oom"), ``size``, ``stream`` (the cudaStream_t as an
  integer, 0 for the default stream), ``time_us`` and, when stacks were recorded, ``frames`` (innermost first).
- ``alloc``: ``size`` is the request before rounding (alloc_found_block records ``orig_size``); ``addr`` is the
  block's start. ``free_requested`` (DeviceCachingAllocator::free) and ``free_completed`` (free_block) carry the
  same requested size. free_completed follows free_requested at once unless the block was used on another
  stream (``Tensor.record_stream``); then it comes when those streams' events complete, at a later malloc
  (process_events) or at empty_cache / the OOM path (synchronize_and_free_events). Only free_completed makes the
  block reusable; allocated bytes drop at free_requested.
- ``segment_alloc`` / ``segment_free``: a cudaMalloc'd segment and its cudaFree (``size`` = segment bytes), from
  alloc_block and release_block; ``segment_map`` / ``segment_unmap``: pages of an expandable segment (map_block,
  unmap_block). segment_free and segment_unmap come from release_cached_blocks (torch.cuda.empty_cache, or the
  OOM path), release_available_cached_blocks (OOM path) and the garbage collector.
- ``segments``: the allocator's state when the snapshot was taken (DeviceCachingAllocator::snapshot);
  ``allocator_settings``: the configuration (NativeCachingAllocator::snapshot's config_metadata).

The ring buffer keeps the newest ``max_entries`` events: a trace that lost its oldest ones, or that started after
memory was already reserved, shows frees and allocations in segments it never saw, and a final state that the
events do not reproduce. ``compact_trace`` checks for both and records what it found under ``integrity``;
``ledger_from_trace`` refuses such a trace unless told otherwise.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import tempfile
from bisect import bisect_right, insort

FORMAT = "memplan.allocator.trace"
VERSION = 1

#: action codes of compact traces; FREE is a free_requested immediately followed by its free_completed
ALLOC, FREE_REQUESTED, FREE_COMPLETED, FREE, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP, OOM, SNAPSHOT = (
    range(10))
ACTIONS = {"alloc": ALLOC, "free_requested": FREE_REQUESTED, "free_completed": FREE_COMPLETED,
           "segment_alloc": SEGMENT_ALLOC, "segment_free": SEGMENT_FREE, "segment_map": SEGMENT_MAP,
           "segment_unmap": SEGMENT_UNMAP, "oom": OOM, "snapshot": SNAPSHOT}

#: the measuring harness's phase marker: one allocation and free from a function of this name, of this many
#: bytes (rounded to one 512-byte small-pool block like any request under 512). A trace recorded without stacks
#: (``_record_memory_history(context=None)``, which ZeRO-3 needs: Python stacks break its autograd functions)
#: has no frames, and there the marker is the allocation of exactly MARKER_BYTES: no tensor of the jobs has
#: 511 bytes (a prime: a 511-element uint8 or bool tensor only)
MARKER_FUNCTION = "memplan_phase_marker"
MARKER_BYTES = 511


def marker_test(trace: dict):
    """A predicate (frame index, requested bytes) -> whether that allocation is a phase marker: by its frame when
    the trace recorded stacks, by its size (MARKER_BYTES) when it recorded none."""
    frames = trace["frames"]
    ids = {i for i, f in enumerate(frames) if f.endswith(":" + MARKER_FUNCTION)}
    if frames:
        return lambda fr, size: fr in ids
    return lambda fr, size: size == MARKER_BYTES


# -- frames ------------------------------------------------------------------------------------------------------
def _package_path(filename: str) -> str | None:
    """The path below site-packages/dist-packages, or None for a file outside them."""
    f = filename.replace("\\", "/")
    for root in ("site-packages/", "dist-packages/"):
        k = f.rfind(root)
        if k >= 0:
            return f[k + len(root):]
    return None


def _is_torch(filename: str) -> bool:
    """A frame of torch's own package: torch/... below site-packages, or a torch/ folder of a source checkout."""
    rel = _package_path(filename)
    if rel is not None:
        return rel.startswith("torch/")
    f = filename.replace("\\", "/")
    return "/torch/" in f or f.startswith("torch/")


_STDLIB = re.compile(r"/lib/python3\.\d+/[^/]+\.py$")


def _skipped(filename: str) -> bool:
    """Frames no allocation is attributed to: torch's, the standard library's (contextlib's decorator wrapper),
    and C++ frames (``stacks="all"``)."""
    return not filename.endswith(".py") or _is_torch(filename) or bool(_STDLIB.search(filename.replace("\\", "/")))


def short_frame(frame: dict) -> str:
    """``package/path/file.py:function``: the path from the site-packages root (or the last three parts)."""
    f = str(frame.get("filename", "?")).replace("\\", "/")
    rel = _package_path(f)
    if rel is None:
        k = f.rfind("/memplan/")
        rel = f[k + 1:] if k >= 0 else "/".join(f.split("/")[-3:])
    return f"{rel}:{frame.get('name', '?')}"


def frame_label(frames: list[dict] | None, keep_frames: int = 1) -> str:
    """The innermost ``keep_frames`` Python frames outside torch's own package, innermost first, joined by " < ".

    C++ frames (``stacks="all"``), frames inside torch and the standard library's are skipped; a phase marker's frame wins, so
    ledger_from_trace can find it. "" when no frame qualifies (the C++ autograd engine's thread has no Python
    stack: most backward-pass allocations)."""
    for fr in frames or ():
        if fr.get("name") == MARKER_FUNCTION:
            return short_frame(fr)  # kept whatever keep_frames says: the phase marks depend on it
    if not frames or keep_frames <= 0:
        return ""
    picked = [short_frame(fr) for fr in frames if not _skipped(str(fr.get("filename", "")))]
    label = " < ".join(picked[:keep_frames])
    if any("torch/optim/" in str(fr.get("filename", "")).replace("\\", "/") for fr in frames):
        label += " [torch.optim]"  # a torch optimizer's step: its states are allocated under the caller's frame
    return label


def _from_empty_cache(frames: list[dict] | None) -> bool:
    """A segment release whose stack runs through torch.cuda.empty_cache (DeviceCachingAllocator::emptyCache)."""
    return any(fr.get("name") == "empty_cache" and _is_torch(str(fr.get("filename", ""))) for fr in frames or ())


# -- compacting --------------------------------------------------------------------------------------------------
def compact_trace(snapshot: dict, *, device: int = 0, keep_frames: int = 1, max_entries: int | None = None) -> dict:
    """A small JSON-ready dict of one device's trace: columnar action/addr/size/stream/frame lists, an interned
    frame table, the snapshot's allocator settings and final segments, and an ``integrity`` verdict.

    ``max_entries``: what ``_record_memory_history`` was given; a trace that long is reported as possibly
    truncated (its oldest events overwritten)."""
    traces = snapshot.get("device_traces") or []
    raw = traces[device] if device < len(traces) else []
    frames_tab: dict[str, int] = {}
    streams_tab: dict[int, int] = {}
    act: list[int] = []
    addr: list[int] = []
    size: list[int] = []
    stream: list[int] = []
    frame: list[int] = []
    time_us: list[int] = []  # the event's time_us (the free_requested's for a FREE), from the first event's
    empty_cache_at: list[int] = []
    frameless: list[int] = []  # segment releases recorded without a stack (context=None)
    k = 0
    while k < len(raw):
        e = raw[k]
        a = ACTIONS.get(e.get("action"))
        k += 1
        if a is None:
            continue  # user annotations and actions this version does not know
        ad = int(e.get("device_free", 0) if a == OOM else e.get("addr", 0))
        if a == FREE_REQUESTED and k < len(raw) and raw[k].get("action") == "free_completed" and raw[k].get("addr") == ad:
            a = FREE
            k += 1
        if a in (SEGMENT_FREE, SEGMENT_UNMAP):
            if _from_empty_cache(e.get("frames")):
                empty_cache_at.append(len(act))
            elif not e.get("frames"):
                frameless.append(len(act))
        label = frame_label(e.get("frames"), keep_frames) if a in (ALLOC, OOM) else ""
        act.append(a)
        addr.append(ad)
        size.append(int(e.get("size", 0)))
        stream.append(streams_tab.setdefault(int(e.get("stream", 0)), len(streams_tab)))
        frame.append(frames_tab.setdefault(label, len(frames_tab)) if label else -1)
        time_us.append(int(e.get("time_us", 0)))
    time_us = [t - time_us[0] for t in time_us] if time_us else []
    empty_cache_at = sorted(empty_cache_at + _releases_outside_malloc(act, frameless))
    segs = [s for s in snapshot.get("segments", []) if s.get("device", device) == device]
    out = {
        "format": FORMAT, "version": VERSION, "device": device,
        "allocator_settings": _jsonable(snapshot.get("allocator_settings", {})),
        "raw_events": len(raw), "max_entries": max_entries,
        "action": act, "addr": addr, "size": size, "stream": stream, "frame": frame,
        "frames": list(frames_tab), "streams": list(streams_tab), "empty_cache_at": empty_cache_at,
        "time_us": time_us,
        "segments_end": [[int(s["address"]), int(s["total_size"]), int(s.get("allocated_size", 0)),
                          int(s.get("stream", 0)), s.get("segment_type", "large") == "large",
                          bool(s.get("is_expandable", False))] for s in segs],
        "extra": {},
    }
    out["integrity"] = check_integrity(out)
    return out


def _releases_outside_malloc(act: list[int], frameless: list[int]) -> list[int]:
    """Without stacks, which segment releases were empty_cache's: the OOM path of a malloc (release_cached_blocks,
    release_available_cached_blocks) is followed by that malloc's new segment or its OOM; a run of releases
    followed by anything else (or by nothing) is taken for empty_cache. An empty_cache just before an allocation
    that needs a new segment is taken for the OOM path: record stacks to tell them apart."""
    out: list[int] = []
    k = 0
    while k < len(frameless):
        run = [frameless[k]]
        while k + 1 < len(frameless) and frameless[k + 1] == run[-1] + 1:
            k += 1
            run.append(frameless[k])
        nxt = run[-1] + 1
        if nxt >= len(act) or act[nxt] not in (SEGMENT_ALLOC, SEGMENT_MAP, OOM):
            out += run
        k += 1
    return out


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def check_integrity(trace: dict) -> dict:
    """Does the trace hold every event since the allocator was empty? Replays its segment and block events and
    compares with the snapshot's final segments. Returns ``{"complete": bool, "problems": [...]}``."""
    problems: list[str] = []
    live: dict[int, int] = {}
    segs: dict[int, int] = {}
    starts: list[int] = []
    mapped = 0
    unknown_free = outside = 0
    for a, ad, sz in zip(trace["action"], trace["addr"], trace["size"]):
        if a == ALLOC:
            live[ad] = sz
            k = bisect_right(starts, ad) - 1
            if not mapped and (k < 0 or ad >= starts[k] + segs[starts[k]]):
                outside += 1
        elif a in (FREE_REQUESTED, FREE):
            if live.pop(ad, None) is None:
                unknown_free += 1
        elif a == SEGMENT_ALLOC:
            segs[ad] = sz
            insort(starts, ad)
        elif a == SEGMENT_FREE:
            if segs.pop(ad, None) is None:
                problems.append(f"segment_free of a segment the trace never allocated (0x{ad:x})")
            else:
                starts.remove(ad)
        elif a == SEGMENT_MAP:
            mapped += sz
        elif a == SEGMENT_UNMAP:
            mapped -= sz
    if unknown_free:
        problems.append(f"{unknown_free} frees of blocks the trace never allocated")
    if outside:
        problems.append(f"{outside} allocations outside every segment the trace allocated")
    if trace.get("max_entries") and trace.get("raw_events", 0) >= trace["max_entries"]:
        problems.append(f"the trace holds max_entries ({trace['max_entries']}) events: the ring buffer was full "
                        "and its oldest events were overwritten")
    end = trace.get("segments_end") or []
    end_reserved = sum(s[1] for s in end)
    replayed = sum(segs.values()) + mapped
    if replayed != end_reserved:
        problems.append(f"the trace's segment events end at {replayed} reserved bytes, the snapshot's segments "
                        f"hold {end_reserved}: events are missing (ring buffer full, or recording started late)")
    non_exp = {s[0] for s in end if not s[5]}
    if non_exp != set(segs):
        problems.append(f"{len(non_exp ^ set(segs))} segments differ between the replayed trace and the snapshot")
    return {"complete": not problems, "problems": problems}


# -- files -------------------------------------------------------------------------------------------------------
def write_trace(path, trace_dict: dict, extra: dict | None = None) -> None:
    """Write a compact trace as gzip'd JSON, atomically (a temporary file in the same folder, then os.replace).

    ``extra`` (e.g. ``{"phases": [...], "job": {...}}``) is stored under the trace's ``extra`` key."""
    data = dict(trace_dict)
    data["extra"] = {**trace_dict.get("extra", {}), **(extra or {})}
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".trace-", suffix=".json.gz", dir=folder)
    try:
        with os.fdopen(fd, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as gz:
            gz.write(json.dumps(data, separators=(",", ":")).encode())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_trace(path) -> dict:
    """Read a file written by write_trace; checks the format and version."""
    with gzip.open(os.fspath(path), "rb") as f:
        data = json.loads(f.read())
    if data.get("format") != FORMAT:
        raise ValueError(f"{path}: not a memplan allocator trace (format {data.get('format')!r}, expected {FORMAT!r})")
    if data.get("version") != VERSION:
        raise ValueError(f"{path}: trace version {data.get('version')!r}; this memplan reads version {VERSION}")
    return data


_FROM_REPLAY = ("classify_frame", "ledger_from_trace", "measured_reserved", "segment_addresses", "settings_config")


def __getattr__(name: str):
    """ledger_from_trace, measured_reserved … live in memplan.allocator.replay (which imports this module)."""
    if name in _FROM_REPLAY:
        from . import replay

        return getattr(replay, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# and, through __getattr__, the names of _FROM_REPLAY
__all__ = ["ACTIONS", "FORMAT", "MARKER_BYTES", "MARKER_FUNCTION", "VERSION", "check_integrity", "compact_trace",
           "frame_label", "marker_test", "read_trace", "short_frame", "write_trace"]
