"""memplan.allocator.trace: torch memory snapshots to compact traces, Ledgers and measured peaks.

Hand-built snapshots are shaped like torch 2.11's (keys as benchmarks/allocator/gpu/snapshots.json.gz shows
them); the real ones come from that file. The last test replays every committed GPU trace.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from memplan.allocator import simulate
from memplan.allocator.trace import (
    ALLOC,
    FREE,
    FREE_COMPLETED,
    FREE_REQUESTED,
    MARKER_BYTES,
    SEGMENT_ALLOC,
    SEGMENT_FREE,
    classify_frame,
    compact_trace,
    frame_label,
    ledger_from_trace,
    measured_reserved,
    read_trace,
    segment_addresses,
    settings_config,
    write_trace,
)
from memplan.ledger import EMPTY_CACHE, PHASE

MiB = 2**20
ROOT = Path(__file__).resolve().parents[1]
SITE = "/opt/torch/.venv/lib/python3.12/site-packages/"  # a venv under a folder named torch, as on the H200
TORCH_LINEAR = {"name": "forward", "filename": SITE + "torch/nn/modules/linear.py", "line": 134}
LLAMA = {"name": "forward", "filename": SITE + "transformers/models/llama/modeling_llama.py", "line": 310}
ZERO = {"name": "reduce_ipg_grads", "filename": SITE + "deepspeed/runtime/zero/stage_1_and_2.py", "line": 1200}
HARNESS = {"name": "run_step", "filename": "/work/src/memplan/verify/harness.py", "line": 40}
MARKER = {"name": "memplan_phase_marker", "filename": "/work/src/memplan/verify/harness.py", "line": 12}
EMPTY = {"name": "empty_cache", "filename": SITE + "torch/cuda/memory.py", "line": 224}


class Snap:
    """Builds a snapshot dict the way torch.cuda.memory._snapshot() returns it."""

    def __init__(self) -> None:
        self.trace: list[dict] = []

    def ev(self, action, addr, size, stream=0, frames=()):
        self.trace.append({"action": action, "addr": addr, "size": size, "stream": stream, "time_us": 1_700_000 + len(self.trace),
                           "compile_context": "N/A", "user_metadata": "", "frames": list(frames)})
        return self

    def snapshot(self, segments) -> dict:
        segs = [{"device": 0, "address": a, "total_size": t, "allocated_size": al, "active_size": al, "requested_size": al,
                 "stream": s, "segment_type": "large" if t > 2 * MiB else "small", "segment_pool_id": [0, 0],
                 "is_expandable": False, "frames": [], "blocks": []} for a, t, al, s in segments]
        return {"segments": segs, "device_traces": [self.trace], "external_annotations": [],
                "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1,
                                       "garbage_collection_threshold": 0.0, "expandable_segments": False,
                                       "pinned_num_register_threads": 1, "release_lock_on_cudamalloc": False,
                                       "pinned_use_cuda_host_register": False, "graph_capture_record_stream_reuse": False,
                                       "roundup_power2_divisions": {str(2**k): 0 for k in range(16)}}}


A, B, C = 0x7F0E5A600000, 0x7F0E5BA00000, 0x7F0E58000000
SIDE = 633746080  # a cudaStream_t


def hand_snapshot() -> dict:
    s = Snap()
    s.ev("segment_alloc", B, 2 * MiB, frames=[MARKER, HARNESS])
    s.ev("alloc", B, 512, frames=[MARKER, HARNESS]).ev("free_requested", B, 512).ev("free_completed", B, 512)
    s.ev("segment_alloc", A, 20 * MiB, frames=[TORCH_LINEAR, LLAMA])
    s.ev("alloc", A, 5 * MiB, frames=[TORCH_LINEAR, LLAMA])  # 5 MiB in a 20 MiB segment, split
    s.ev("alloc", B, 1000)  # no Python frame: the autograd engine's thread
    s.ev("segment_alloc", C, 20 * MiB, SIDE, frames=[ZERO]).ev("alloc", C, 3 * MiB, SIDE, frames=[ZERO])
    s.ev("free_requested", A, 5 * MiB)  # used on SIDE (record_stream): the free completes later
    s.ev("alloc", B + 1024, MiB, frames=[HARNESS])
    s.ev("free_completed", A, 5 * MiB)  # at a later malloc's process_events, before its alloc
    s.ev("alloc", A, 4 * MiB, frames=[TORCH_LINEAR, LLAMA])
    s.ev("alloc", B + 1024 + MiB, 512, frames=[MARKER, HARNESS])  # the second phase marker
    s.ev("free_requested", B + 1024 + MiB, 512).ev("free_completed", B + 1024 + MiB, 512)
    s.ev("free_requested", C, 3 * MiB, SIDE).ev("free_completed", C, 3 * MiB, SIDE)
    s.ev("segment_free", C, 20 * MiB, SIDE, frames=[EMPTY, HARNESS])  # torch.cuda.empty_cache()
    s.ev("snapshot", 0, 4 * MiB + 1024 + MiB)
    return s.snapshot([(A, 20 * MiB, 4 * MiB, 0), (B, 2 * MiB, 1024 + MiB, 0)])


def test_compact_trace_keeps_what_replay_and_attribution_need():
    t = compact_trace(hand_snapshot())
    assert t["integrity"] == {"complete": True, "problems": []}
    # free_requested + free_completed back to back become FREE; the deferred pair stays two events
    assert t["action"] == [SEGMENT_ALLOC, ALLOC, FREE, SEGMENT_ALLOC, ALLOC, ALLOC, SEGMENT_ALLOC, ALLOC,
                           FREE_REQUESTED, ALLOC, FREE_COMPLETED, ALLOC, ALLOC, FREE, FREE, SEGMENT_FREE, 9]
    assert t["frames"] == ["memplan/verify/harness.py:memplan_phase_marker",
                           "transformers/models/llama/modeling_llama.py:forward",  # torch's linear.py skipped
                           "deepspeed/runtime/zero/stage_1_and_2.py:reduce_ipg_grads",
                           "memplan/verify/harness.py:run_step"]
    assert t["streams"] == [0, SIDE] and t["empty_cache_at"] == [15]
    assert json.loads(json.dumps(t)) == t  # JSON-ready


def test_ledger_from_trace_maps_markers_to_labels_and_frames_to_components():
    t = compact_trace(hand_snapshot())
    t["extra"] = {"phases": ["forward", "backward"]}
    led = ledger_from_trace(t)
    assert led.names == ["transformers/models/llama/modeling_llama.py:forward", "(no python frame)",
                         "deepspeed/runtime/zero/stage_1_and_2.py:reduce_ipg_grads", "memplan/verify/harness.py:run_step",
                         "transformers/models/llama/modeling_llama.py:forward"]
    assert led.components == ["activations", "autograd", "grad_bucket", "harness", "activations"]
    assert led.sizes == [5 * MiB, 1000, 3 * MiB, MiB, 4 * MiB] and led.streams == [0, 0, 1, 0, 0]
    # the first tensor's free comes at free_completed, after the 1 MiB allocation; the markers are dropped
    assert led.events == [0, 1, 2, 3, ~0, 4, ~2]
    assert [(m.at, m.label, m.kind) for m in led.marks] == [(0, "forward", PHASE), (6, "backward", PHASE),
                                                             (7, "empty_cache", EMPTY_CACHE)]
    with pytest.raises(ValueError, match="2 phase markers .* but 3 phase labels"):
        ledger_from_trace(t, phases=["a", "b", "c"])
    del t["extra"]
    assert [m.label for m in ledger_from_trace(t).marks if m.kind == PHASE] == ["phase0", "phase1"]


def test_a_trace_without_stacks_finds_its_phase_markers_by_size():
    """_record_memory_history(context=None) records no frames (ZeRO-3 needs it): the marker is the one
    allocation of MARKER_BYTES, and a 512-byte tensor is not one."""
    s = Snap()
    s.ev("segment_alloc", B, 2 * MiB)
    s.ev("alloc", B, MARKER_BYTES).ev("free_requested", B, MARKER_BYTES).ev("free_completed", B, MARKER_BYTES)
    s.ev("segment_alloc", A, 20 * MiB).ev("alloc", A, 5 * MiB)
    s.ev("alloc", B + 512, 512)  # 512 bytes: a tensor, not a marker
    s.ev("alloc", B + 1024, MARKER_BYTES).ev("free_requested", B + 1024, MARKER_BYTES)
    s.ev("free_completed", B + 1024, MARKER_BYTES)
    s.ev("free_requested", A, 5 * MiB).ev("free_completed", A, 5 * MiB)
    t = compact_trace(s.snapshot([(A, 20 * MiB, 0, 0), (B, 2 * MiB, 512, 0)]))
    assert t["frames"] == [] and t["integrity"]["complete"]
    led = ledger_from_trace(t, phases=["forward", "backward"])
    assert led.sizes == [5 * MiB, 512] and led.events == [0, 1, ~0]
    assert [(m.at, m.label) for m in led.marks] == [(0, "forward"), (2, "backward")]
    m = measured_reserved(t, phases=["forward", "backward"])
    assert [p["label"] for p in m["phases"]] == ["forward", "backward"]


def test_measured_reserved_by_hand_and_the_replay_agrees():
    t = compact_trace(hand_snapshot())
    m = measured_reserved(t, phases=["forward", "backward"])
    # reserved: 2 (small) + 20 + 20 (SIDE) = 42 MiB, then empty_cache frees SIDE's segment: 22 MiB at the end
    assert (m["peak_reserved_bytes"], m["reserved_end_bytes"]) == (42 * MiB, 22 * MiB)
    # allocated (block sizes, all split here): 5 MiB + 1024 (1000 rounded) + 3 MiB = 8 MiB + 1024; the deferred
    # free drops 5 MiB at free_requested (memory_allocated does), + 1 MiB, + 4 MiB: 8 MiB + 1024 again, and the
    # second marker's 512 bytes on top: 8 MiB + 1536. The ledger drops the markers: its replay peaks 512 lower.
    assert m["peak_allocated_bytes"] == 8 * MiB + 1536
    assert m["peak_rounded_bytes"] == 8 * MiB + 1536
    assert (m["empty_cache_releases"], m["oom_path_releases"], m["segment_allocs"]) == (1, 0, 3)
    assert [p["label"] for p in m["phases"]] == ["forward", "backward"]
    led = ledger_from_trace(t)
    r = simulate(led, settings_config(t["allocator_settings"]))
    assert r.peak_reserved_bytes == m["peak_reserved_bytes"] and r.reserved_end_bytes == m["reserved_end_bytes"]
    # the ledger frees the record_stream'd 5 MiB at free_completed (when its block can be reused), so the replay
    # counts it as allocated until then: 5 + 3 + 1 MiB + 1024, where memory_allocated had dropped it already
    assert r.peak_allocated_bytes == 9 * MiB + 1024
    assert segment_addresses(t) == [B, A, C]


def test_ring_buffer_overflow_is_detected():
    s = Snap()  # the oldest events were overwritten: the trace starts with frees of blocks it never saw
    s.ev("free_requested", A, 5 * MiB).ev("free_completed", A, 5 * MiB)
    s.ev("alloc", A + 5 * MiB, MiB, frames=[HARNESS])
    snap = s.snapshot([(A, 20 * MiB, MiB, 0)])
    t = compact_trace(snap, max_entries=3)
    problems = " | ".join(t["integrity"]["problems"])
    assert not t["integrity"]["complete"]
    assert "1 frees of blocks the trace never allocated" in problems
    assert "allocations outside every segment" in problems and "ring buffer was full" in problems
    assert "segment events end at 0 reserved bytes, the snapshot's segments hold 20971520" in problems
    with pytest.raises(ValueError, match="does not hold every event"):
        ledger_from_trace(t)
    assert ledger_from_trace(t, allow_incomplete=True).sizes == [MiB]


def real_snapshots() -> dict:
    with gzip.open(ROOT / "benchmarks/allocator/gpu/snapshots.json.gz", "rt") as f:
        return json.load(f)


def test_real_snapshots_from_torch_2_11():
    snaps = real_snapshots()
    for run in ("snap0", "snap1"):  # default and expandable_segments:True
        t = compact_trace(snaps[run]["basic"])
        assert t["integrity"]["complete"], t["integrity"]
        m = measured_reserved(t)
        led = ledger_from_trace(t)
        assert [mk.kind for mk in led.marks] == [EMPTY_CACHE]  # found from the frames of the segment releases
        r = simulate(led, settings_config(t["allocator_settings"]))
        assert (r.peak_reserved_bytes, r.reserved_end_bytes) == (m["peak_reserved_bytes"], m["reserved_end_bytes"])
        assert m["reserved_end_bytes"] == sum(s["total_size"] for s in snaps[run]["basic"]["segments"])
    oom = compact_trace(snaps["snap0"]["oom"])
    m = measured_reserved(oom)
    assert (m["ooms"], m["oom_path_releases"], m["peak_reserved_bytes"]) == (1, 1, 40 * MiB)
    ring = compact_trace(snaps["snap0"]["ringbuffer"], max_entries=40)
    assert not ring["integrity"]["complete"] and "ring buffer was full" in " ".join(ring["integrity"]["problems"])


def test_write_and_read_trace(tmp_path):
    t = compact_trace(hand_snapshot())
    path = tmp_path / "job.json.gz"
    write_trace(path, t, {"phases": ["forward", "backward"], "job": {"model": "toy"}})
    back = read_trace(path)
    assert back["extra"] == {"phases": ["forward", "backward"], "job": {"model": "toy"}}
    assert {k: v for k, v in back.items() if k != "extra"} == {k: v for k, v in t.items() if k != "extra"}
    assert [p.name for p in tmp_path.iterdir()] == ["job.json.gz"]  # no temporary file left behind
    with gzip.open(tmp_path / "other.json.gz", "wt") as f:
        json.dump({"format": "something else"}, f)
    with pytest.raises(ValueError, match="not a memplan allocator trace"):
        read_trace(tmp_path / "other.json.gz")
    with gzip.open(tmp_path / "v9.json.gz", "wt") as f:
        json.dump({**t, "version": 9}, f)
    with pytest.raises(ValueError, match="version 9"):
        read_trace(tmp_path / "v9.json.gz")


def test_committed_traces_of_a_1b_job_are_small():
    for p in (ROOT / "benchmarks/allocator/gpu").glob("trace_*.json.gz"):
        assert p.stat().st_size < 2 * MiB, p  # 3 steps of a 1.1B Llama: about 52 kB


def test_frame_label_rules():
    assert frame_label([TORCH_LINEAR, LLAMA, HARNESS]) == "transformers/models/llama/modeling_llama.py:forward"
    assert frame_label([TORCH_LINEAR, LLAMA, HARNESS], keep_frames=2) == (
        "transformers/models/llama/modeling_llama.py:forward < memplan/verify/harness.py:run_step")
    cpp = {"name": "malloc", "filename": "/src/c10/cuda/CUDACachingAllocator.cpp", "line": 1}
    stdlib = {"name": "inner", "filename": "/usr/lib/python3.12/contextlib.py", "line": 81}
    optim = {"name": "_multi_tensor_adamw", "filename": SITE + "torch/optim/adamw.py", "line": 500}
    assert frame_label([cpp, stdlib, HARNESS]) == "memplan/verify/harness.py:run_step"
    assert frame_label([optim, stdlib, HARNESS]) == "memplan/verify/harness.py:run_step [torch.optim]"
    assert frame_label([TORCH_LINEAR, MARKER, HARNESS]) == "memplan/verify/harness.py:memplan_phase_marker"
    assert frame_label([]) == frame_label(None) == frame_label([TORCH_LINEAR]) == ""
    assert frame_label([LLAMA], keep_frames=0) == ""
    assert frame_label([MARKER], keep_frames=0) == "memplan/verify/harness.py:memplan_phase_marker"


def test_empty_cache_without_stacks_is_told_from_the_oom_path_by_what_follows():
    snap = hand_snapshot()
    for e in snap["device_traces"][0]:
        e["frames"] = []
    # the release of SIDE's segment is followed by the snapshot event, not by a new segment: empty_cache
    assert compact_trace(snap)["empty_cache_at"] == [15]
    snap["device_traces"][0].insert(-1, {**snap["device_traces"][0][4], "addr": C})  # a segment_alloc right after
    assert compact_trace(snap)["empty_cache_at"] == []  # ... reads as an OOM-path release (record stacks!)


@pytest.mark.parametrize(("label", "component"), [
    ("", "autograd"),
    ("memplan/verify/harness.py:run_step", "harness"),
    ("memplan/verify/harness.py:run_step [torch.optim]", "optimizer_states"),
    ("deepspeed/runtime/zero/partition_parameters.py:_all_gather", "params_gathered"),
    ("deepspeed/runtime/zero/stage3.py:__reduce_and_partition_ipg_grads", "grad_bucket"),
    ("deepspeed/runtime/zero/stage3.py:_create_fp32_partitions_grad", "gradients"),
    ("deepspeed/ops/adam/fused_adam.py:step", "optimizer_states"),
    ("deepspeed/runtime/bf16_optimizer.py:_setup_for_real_optimizer", "optimizer_states"),
    ("deepspeed/runtime/zero/contiguous_memory_allocator.py:allocate_tensor", "zero_buffers"),
    ("deepspeed/runtime/engine.py:forward", "deepspeed_other"),
    ("transformers/models/gpt2/modeling_gpt2.py:forward", "activations"),
    ("train.py:main", "other"),
])
def test_classify_frame(label, component):
    assert classify_frame(label) == component


#: traces/: recorded with Python stacks; traces-lone/ (H200) and traces-lone-h100/: ZeRO-3 jobs run alone on the
#: GPU, recorded without stacks; traces-19/: seed 11's check rows run alone and diagnosis traces (H200, no stacks); traces-20/: seed 12's
#: check rows run alone (H100, no stacks; a pipeline row's last stage as NAME.rankN); traces-22/: seed 13's (H100);
#: traces-23/: seed 13's H100-sized lines; traces-25/: two studied rows traced again alone on an H100; traces-26/:
#: seed 14's H100-sized lines; traces-27/: seed 15's H100-sized lines and seed 14's s14-023
TRACE_DIRS = [ROOT / "benchmarks/accuracy/traces", ROOT / "benchmarks/accuracy/traces-lone",
              ROOT / "benchmarks/accuracy/traces-lone-h100", ROOT / "benchmarks/accuracy/traces-19",
              ROOT / "benchmarks/accuracy/traces-20", ROOT / "benchmarks/accuracy/traces-22",
              ROOT / "benchmarks/accuracy/traces-23", ROOT / "benchmarks/accuracy/traces-25",
              ROOT / "benchmarks/accuracy/traces-26", ROOT / "benchmarks/accuracy/traces-27",
              ROOT / "benchmarks/allocator/gpu"]
TRACE_FILES = sorted(p for d in TRACE_DIRS for p in d.glob("*.json.gz")
                     if p.name.startswith("trace") or d.name.startswith("traces"))


#: traces the simulator replays within 2 % only with the driver's own segment addresses (the test below): where
#: equal-sized cached blocks tie, best fit takes the lowest address, and the simulated addresses (each new segment
#: below the last, none reused) order them otherwise than cudaMalloc did, which reuses the virtual ranges that
#: init's empty_cache released (ZeRO-3's defragmentation) by rules of the driver's own (issue 12)
ADDRESS_GAPS = {
    "tr25-s5-024-llama-3-405b-L3-loss-z3-w64-s4k.json.gz": (
        "405B-width ZeRO-3 in fp32 at 4K: the 8 GiB math-attention grads of step 1 find no free 8 GiB block where "
        "the simulated addresses had step 0's 3.3 GiB weight grads split one (+13.8 %; 0.00 % with the trace's "
        "addresses)"),
}


@pytest.mark.skipif(not TRACE_FILES, reason="no GPU traces are committed under benchmarks/accuracy/traces/ "
                                            "or benchmarks/allocator/gpu/ yet")
@pytest.mark.parametrize("path", [pytest.param(p, marks=[pytest.mark.xfail(strict=True, reason=ADDRESS_GAPS[p.name])]
                                               if p.name in ADDRESS_GAPS else []) for p in TRACE_FILES],
                         ids=lambda p: p.name)
def test_every_committed_gpu_trace_replays_within_2_percent(path):
    trace = read_trace(path)
    m = measured_reserved(trace)
    r = simulate(ledger_from_trace(trace), settings_config(trace["allocator_settings"]))
    assert abs(r.peak_reserved_bytes - m["peak_reserved_bytes"]) <= 0.02 * m["peak_reserved_bytes"], (
        r.peak_reserved_bytes, m["peak_reserved_bytes"])


@pytest.mark.skipif(not TRACE_FILES, reason="no GPU traces committed")
@pytest.mark.parametrize("path", TRACE_FILES, ids=lambda p: p.name)
def test_every_committed_gpu_trace_replays_within_half_a_percent_at_its_own_addresses(path):
    """The simulator's rules alone, free of the address model: each segment placed where cudaMalloc put it
    (trace.segment_addresses), every committed trace's peak reserved within 0.5 %."""
    trace = read_trace(path)
    m = measured_reserved(trace)
    r = simulate(ledger_from_trace(trace), settings_config(trace["allocator_settings"]),
                 segment_addresses=segment_addresses(trace))
    assert abs(r.peak_reserved_bytes - m["peak_reserved_bytes"]) <= 0.005 * m["peak_reserved_bytes"], (
        r.peak_reserved_bytes, m["peak_reserved_bytes"])
