"""Kernel temporaries the ledger predicts, against the committed GPU allocation traces: every cuDNN SDPA backward
workspace (blocks_kernels.cudnn_bwd_workspace_bytes: w = d, or 2·d for grouped-query attention without a mask)
every CUDA reduction staging buffer (cuda_reduce.sum_rows_staging: a bias's grad, an RMSNorm weight's grad) and
every embedding backward's partial-segment offsets and fp32 partial sums (causal_lm._cuda_sorted_backward:
t / 10 + min(t, V) rows) of a traced row's ledger is a size the row's trace allocated. The sizes are exact (odd byte counts: the fp32 row
and the 256 bytes of the workspace), so a wrong width or a wrong CTA count cannot match by chance."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from memplan.accuracy import iter_rows, job_of_row, skipped_steps
from memplan.allocator.replay import ledger_from_trace
from memplan.allocator.trace import ALLOC
from memplan.estimator.program import build_ledger

ROOT = Path(__file__).resolve().parent.parent / "benchmarks" / "accuracy"
TRACES = {p.name.removesuffix(".json.gz"): p
          for d in ("traces", "traces-lone", "traces-lone-h100", "traces-19", "traces-20")
          for p in (ROOT / d).glob("*.json.gz")}
KINDS = {"cuDNN workspace": lambda name, size: name.endswith("cudnn.workspace.tmp") and size > 256,
         "reduction staging": lambda name, size: name.endswith("reduce_staging.tmp"),
         "embedding partial sums": lambda name, size: name.endswith(("grad_weight_per_segment.tmp",
                                                                     "partial_segment_offset.tmp"))}


@pytest.fixture(scope="module")
def predicted_and_traced():
    """(row name, kind → the ledger's sizes, the trace's allocation sizes) of every traced one-step-per-phase row."""
    out = []
    sorts.clear()
    for row in iter_rows(ROOT):
        path = TRACES.get(row["name"])
        if path is None or row.get("status") != "ok" or row.get("layers"):
            continue
        L = build_ledger(job_of_row(row), steps=1, skipped=skipped_steps(row))
        sizes = {kind: {size for name, size in zip(L.names, L.sizes) if test(name, size)}
                 for kind, test in KINDS.items()}
        with gzip.open(path) as f:
            trace = json.load(f)
        out.append((row["name"], sizes, {s for a, s in zip(trace["action"], trace["size"]) if a == ALLOC}))
        index_bytes = {size for name, size in zip(L.names, L.sizes) if name.endswith(".linear_indices.tmp")}
        if index_bytes:
            T = ledger_from_trace(trace, phases=[p["name"] for p in row["phases"]])
            sorts.append((row["name"], _count(L, index_bytes), _count(T, index_bytes)))
    return out


#: (row, the ledger's and the trace's allocations of an index_put sort's int64 buffer size in step 0's backward)
sorts: list[tuple[str, int, int]] = []


def _count(L, sizes: set[int], phase: str = "step0.micro0.backward") -> int:
    return next((sum(1 for e in L.events[start:stop] if e >= 0 and L.sizes[e] in sizes)
                 for label, start, stop in L.phase_spans() if label == phase), 0)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_predicted_kernel_temporary_is_a_traced_allocation(kind, predicted_and_traced):
    rows = [(name, sizes[kind], traced) for name, sizes, traced in predicted_and_traced if sizes[kind]]
    assert len(rows) >= 20, f"only {len(rows)} traced rows predict a {kind}"
    missing = {name: sorted(predicted - traced) for name, predicted, traced in rows if not predicted <= traced}
    assert not missing, f"{kind} sizes no trace allocated: {missing}"


def test_index_put_sorts_allocate_their_five_int64_buffers(predicted_and_traced):
    """An MoE backward's IndexBackward0 runs index_put_with_sort_kernel: remainder (a temporary), linear, sorted,
    orig and range buffers of the index's int64 size (blocks_moe.index_rows). In step 0's backward the traces hold
    at least as many blocks of that size as the ledger, and at most three more (other tensors of the same size);
    with three of the five buffers the ledger fell short by two per sort, six or more per MoE layer."""
    assert len(sorts) >= 10, f"only {len(sorts)} traced MoE rows"
    off = {name: (ledger, traced) for name, ledger, traced in sorts if not 0 <= traced - ledger <= 3}
    assert not off, f"index_put buffer counts (ledger, trace) off: {off}"
