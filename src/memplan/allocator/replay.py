"""Compact traces (memplan.allocator.trace) as Ledgers, and the reserved/allocated bytes the trace itself shows.

``measured_reserved`` is the ground truth the simulator is checked against: reserved bytes from the trace's own
segment events, and allocated bytes the way torch's ``memory_allocated`` counts them. The trace's alloc events
carry the request before rounding, so allocated is rebuilt by following the real allocator's block layout at the
real addresses: the block handed out starts at the alloc's address, and whether the rest of the cached block was
split off is should_split's rule, which depends on sizes only. (With expandable segments every block is split,
so allocated is the rounded request.)
"""

from __future__ import annotations

from memplan.ledger import EMPTY_CACHE, Ledger

from .config import SMALL_SIZE_BYTES, AllocatorConfig, parse_alloc_conf
from .sim import round_size
from .trace import (
    ALLOC,
    FREE,
    FREE_COMPLETED,
    FREE_REQUESTED,
    MARKER_FUNCTION,
    OOM,
    SEGMENT_ALLOC,
    SEGMENT_FREE,
    SEGMENT_MAP,
    SEGMENT_UNMAP,
    check_integrity,
    marker_test,
)

#: frame → component, first match wins; the frame is the innermost one outside torch (trace.frame_label)
COMPONENT_RULES = (
    ("no Python frame: the C++ autograd engine (backward's activation and parameter gradients)", "autograd"),
    ("memplan/ (the measuring harness)", "harness"),
    ("deepspeed/runtime/zero/partition_parameters.py, partitioned_param_coordinator.py", "params_gathered"),
    ("deepspeed/runtime/zero/*, function named *reduce*, *bucket*, *ipg*, *average*", "grad_bucket"),
    ("deepspeed/runtime/zero/*, function named *grad*", "gradients"),
    ("a path with 'optimizer', deepspeed/ops/adam, deepspeed/runtime/fp16, or a stack through torch/optim",
     "optimizer_states"),
    ("other deepspeed/runtime/zero/*", "zero_buffers"),
    ("other deepspeed/*", "deepspeed_other"),
    ("transformers/*, modeling_*.py", "activations"),
    ("anything else", "other"),
)


def classify_frame(label: str) -> str:
    """The ledger component of an allocation whose frame label is ``label`` (see COMPONENT_RULES)."""
    if not label:
        return "autograd"
    if label.endswith(" [torch.optim]"):
        return "optimizer_states"
    path, _, func = label.split(" < ")[0].rpartition(":")
    if func == MARKER_FUNCTION:
        return "marker"
    if path.startswith("memplan/"):
        return "harness"
    if path.startswith("deepspeed/"):
        if path.endswith(("zero/partition_parameters.py", "zero/partitioned_param_coordinator.py")):
            return "params_gathered"
        zero = path.startswith("deepspeed/runtime/zero/")
        if zero and any(w in func for w in ("reduce", "bucket", "ipg", "average")):
            return "grad_bucket"
        if zero and "grad" in func:
            return "gradients"
    if "optimizer" in path or path.startswith(("deepspeed/ops/adam", "deepspeed/runtime/fp16")):
        return "optimizer_states"
    if path.startswith("deepspeed/runtime/zero/"):
        return "zero_buffers"
    if path.startswith("deepspeed/"):
        return "deepspeed_other"
    if path.startswith("transformers/") or "modeling_" in path:
        return "activations"
    return "other"


def _labels(trace: dict, phases: list[str] | None) -> list[str] | None:
    return phases if phases is not None else (trace.get("extra") or {}).get("phases")


def _require_complete(trace: dict, allow_incomplete: bool) -> dict:
    integrity = trace.get("integrity") or check_integrity(trace)
    if not integrity["complete"] and not allow_incomplete:
        raise ValueError("the trace does not hold every event since the allocator was empty: "
                         + "; ".join(integrity["problems"]) + " (pass allow_incomplete=True to replay what it holds)")
    return integrity


def ledger_from_trace(trace: dict, *, phases: list[str] | None = None, allow_incomplete: bool = False) -> Ledger:
    """A Ledger of the trace's tensors: alloc → Ledger.alloc (name: its frame label; component: classify_frame;
    size: the request), free_completed → Ledger.free; a tensor whose free never comes stays live.

    Phase marks: the n-th allocation from ``memplan_phase_marker`` starts the n-th label of ``phases`` (default:
    the trace's ``extra["phases"]``; ``phaseN`` when there are none); the marker's own events are dropped. A run
    of segment releases made by torch.cuda.empty_cache becomes one EMPTY_CACHE mark, and so does a run the OOM path
    made (``malloc`` → ``release_cached_blocks`` after a failed cudaMalloc: with max_split_size unset it frees every
    whole cached segment, as empty_cache does), labelled ``oom_path_release``: when the card was shared, the other
    processes' memory decided when that happened, which the trace records and no card size replays. Raises
    ValueError for a
    trace that lost events (see trace.check_integrity) unless ``allow_incomplete``, and when the markers and the
    labels disagree in number."""
    _require_complete(trace, allow_incomplete)
    labels = _labels(trace, phases)
    frames = trace["frames"]
    is_marker = marker_test(trace)
    names = [f or "(no python frame)" for f in frames]
    components = [classify_frame(f) for f in frames]
    empty_cache = set(trace.get("empty_cache_at", ()))
    led = Ledger()
    live: dict[int, int] = {}
    markers: set[int] = set()
    n_markers = 0
    in_release = False
    for idx, (a, ad, sz, st, fr) in enumerate(zip(trace["action"], trace["addr"], trace["size"], trace["stream"],
                                                   trace["frame"])):
        if a in (SEGMENT_FREE, SEGMENT_UNMAP):
            if not in_release:
                led.mark("empty_cache" if idx in empty_cache else "oom_path_release", EMPTY_CACHE)
            in_release = True
            continue
        in_release = False
        if a == ALLOC:
            if is_marker(fr, sz):
                markers.add(ad)
                led.mark(labels[n_markers] if labels and n_markers < len(labels) else f"phase{n_markers}")
                n_markers += 1
            elif fr >= 0:
                live[ad] = led.alloc(names[fr], sz, components[fr], st)
            else:
                live[ad] = led.alloc("(no python frame)", sz, "autograd", st)
        elif a in (FREE, FREE_COMPLETED):
            if ad in markers:
                markers.discard(ad)
                continue
            tid = live.pop(ad, None)
            if tid is not None:
                led.free(tid)
    if labels is not None and n_markers != len(labels):
        raise ValueError(f"the trace has {n_markers} phase markers ({MARKER_FUNCTION} allocations) but "
                         f"{len(labels)} phase labels")
    return led


class _GBlock:
    """A block at its real address, for rebuilding torch's allocated bytes (see the module docstring)."""

    __slots__ = ("addr", "free", "next", "prev", "size")

    def __init__(self, addr: int, size: int) -> None:
        self.addr, self.size, self.free = addr, size, True
        self.prev: _GBlock | None = None
        self.next: _GBlock | None = None


def settings_config(settings: dict, **fields) -> AllocatorConfig:
    """The AllocatorConfig a snapshot's ``allocator_settings`` describe: its PYTORCH_CUDA_ALLOC_CONF string when
    that parses (it also carries large_segment_size_mb, which the settings lack), overridden by the settings'
    own values (memory_snapshot.cpp writes max_split_size as -1 when unset, roundup_power2_divisions as 16 values
    keyed "1", "2", "4", … MiB). ``fields`` (card_bytes, …) are passed on."""
    base: dict = {}
    try:
        base = parse_alloc_conf(str(settings.get("PYTORCH_CUDA_ALLOC_CONF") or ""))
    except ValueError:
        pass
    base.pop("per_process_memory_fraction", None)
    ms = int(settings.get("max_split_size", -1) or -1)
    rp = settings.get("roundup_power2_divisions") or {}
    table = tuple(int(rp[k]) for k in sorted(rp, key=int)) if isinstance(rp, dict) else None
    base.update(expandable_segments=bool(settings.get("expandable_segments", False)),
                max_split_size_bytes=ms if 0 < ms < 2**62 else None,
                roundup_power2_divisions=table if table and len(table) == 16 and any(table) else None)
    base.update(fields)
    return AllocatorConfig(**base)


def segment_addresses(trace: dict) -> list[int]:
    """The addresses of the trace's cudaMalloc'd segments in order: simulate(..., segment_addresses=...) then
    breaks ties between equal-sized cached blocks as the GPU did."""
    return [ad for a, ad in zip(trace["action"], trace["addr"]) if a == SEGMENT_ALLOC]


def measured_reserved(trace: dict, *, phases: list[str] | None = None, allow_incomplete: bool = False) -> dict:
    """Peak, end and per-phase reserved and allocated bytes as the trace shows them (see the module docstring).

    ``allocated`` is torch's memory_allocated (block sizes), ``rounded`` the 512-rounded requests (what Ledger.peak
    counts); phases start at the phase-marker allocations, with peaks reset there as
    torch.cuda.reset_peak_memory_stats does. Event indices (``*_event``) count the events of
    ``ledger_from_trace(trace)``: the ledger event at or just after the trace event. Returns a JSON-ready dict."""
    integrity = _require_complete(trace, allow_incomplete)
    labels = _labels(trace, phases)
    cfg = settings_config(trace.get("allocator_settings") or {})
    msplit = cfg.max_split_size_bytes or 1 << 62
    is_marker = marker_test(trace)
    empty_cache = set(trace.get("empty_cache_at", ()))
    expandable = cfg.expandable_segments or SEGMENT_MAP in trace["action"]
    blocks: dict[int, _GBlock] = {}
    held: dict[int, int] = {}  # addr -> (allocated bytes, rounded bytes) of live blocks
    reserved = allocated = rounded = 0
    peaks = {"reserved": [0, 0], "allocated": [0, 0], "rounded": [0, 0]}
    phase_rows: list[dict] = []
    phase: dict | None = None
    ledger_pos = n_markers = unknown = 0
    markers: set[int] = set()
    counts = {"segment_allocs": 0, "segment_frees": 0, "empty_cache_releases": 0, "oom_path_releases": 0, "ooms": 0}

    def bump(at: int) -> None:
        for key, value in (("reserved", reserved), ("allocated", allocated), ("rounded", rounded)):
            if value > peaks[key][0]:
                peaks[key] = [value, at]
            if phase is not None and value > phase[f"peak_{key}_bytes"]:
                phase[f"peak_{key}_bytes"] = value

    pending: set[int] = set()  # addresses of ledger tensors whose free has not completed
    for idx, (a, ad, sz, fr) in enumerate(zip(trace["action"], trace["addr"], trace["size"], trace["frame"])):
        at = ledger_pos  # the ledger event at or just after this trace event
        if a in (SEGMENT_ALLOC, SEGMENT_MAP):
            reserved += sz
            counts["segment_allocs"] += 1
            if a == SEGMENT_ALLOC and not expandable:
                blocks[ad] = _GBlock(ad, sz)
        elif a in (SEGMENT_FREE, SEGMENT_UNMAP):
            reserved -= sz
            counts["segment_frees"] += 1
            counts["empty_cache_releases" if idx in empty_cache else "oom_path_releases"] += 1
            blocks.pop(ad, None)
        elif a == OOM:
            counts["ooms"] += 1
        elif a == ALLOC:
            if is_marker(fr, sz):
                markers.add(ad)
                if phase is not None:
                    phase_rows.append(phase)
                label = labels[n_markers] if labels and n_markers < len(labels) else f"phase{n_markers}"
                phase = {"label": label, "ledger_start": ledger_pos, "peak_reserved_bytes": reserved,
                         "peak_allocated_bytes": allocated, "peak_rounded_bytes": rounded}
                n_markers += 1
            else:
                pending.add(ad)
                ledger_pos += 1
            r = round_size(sz, cfg) if sz > 0 else 0
            got = r
            if not expandable:
                b = blocks.get(ad)
                if b is None or not b.free:
                    unknown += 1
                else:
                    rem = b.size - r
                    if (rem >= 512) if r <= SMALL_SIZE_BYTES else (r < msplit and rem > SMALL_SIZE_BYTES):
                        nb = _GBlock(ad + r, rem)
                        nb.prev, nb.next = b, b.next
                        if b.next is not None:
                            b.next.prev = nb
                        b.next, b.size = nb, r
                        blocks[nb.addr] = nb
                    b.free = False
                    got = b.size
            held[ad] = (got, r)
            allocated += got
            rounded += r
        if a in (FREE_REQUESTED, FREE):
            got, r = held.pop(ad, (0, 0))
            allocated -= got
            rounded -= r
        if a in (FREE_COMPLETED, FREE):
            if ad in markers:
                markers.discard(ad)
            elif ad in pending:
                pending.discard(ad)
                ledger_pos += 1
            b = blocks.get(ad)
            if b is not None and not b.free:
                b.free = True
                for nb in (b.prev, b.next):
                    if nb is not None and nb.free:
                        lo, hi = (nb, b) if nb is b.prev else (b, nb)
                        lo.size += hi.size
                        lo.next = hi.next
                        if hi.next is not None:
                            hi.next.prev = lo
                        del blocks[hi.addr]
                        b = lo
        bump(at)
    if phase is not None:
        phase_rows.append(phase)
    return {
        "peak_reserved_bytes": peaks["reserved"][0], "peak_reserved_event": peaks["reserved"][1],
        "peak_allocated_bytes": peaks["allocated"][0], "peak_allocated_event": peaks["allocated"][1],
        "peak_rounded_bytes": peaks["rounded"][0], "peak_rounded_event": peaks["rounded"][1],
        "reserved_end_bytes": reserved, "allocated_end_bytes": allocated, "rounded_end_bytes": rounded,
        "phases": phase_rows, "ledger_events": ledger_pos, **counts,
        "blocks_not_found": unknown, "complete": integrity["complete"], "problems": list(integrity["problems"]),
    }
