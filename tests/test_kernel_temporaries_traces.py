"""Kernel temporaries the ledger predicts, against the committed GPU allocation traces: every cuDNN SDPA backward
workspace (blocks_kernels.cudnn_bwd_workspace_bytes: w = d, or 2·d for grouped-query attention without a mask)
and every CUDA reduction staging buffer (cuda_reduce.sum_rows_staging: a bias's grad, an RMSNorm weight's grad)
of a traced row's ledger is a size the row's trace allocated. The sizes are exact (odd byte counts: the fp32 row
and the 256 bytes of the workspace), so a wrong width or a wrong CTA count cannot match by chance."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from memplan.accuracy import iter_rows, job_of_row, skipped_steps
from memplan.allocator.trace import ALLOC
from memplan.estimator.program import build_ledger

ROOT = Path(__file__).resolve().parent.parent / "benchmarks" / "accuracy"
TRACES = {p.name.removesuffix(".json.gz"): p for d in ("traces", "traces-lone", "traces-lone-h100", "traces-19")
          for p in (ROOT / d).glob("*.json.gz")}
KINDS = {"cuDNN workspace": lambda name, size: name.endswith("cudnn.workspace.tmp") and size > 256,
         "reduction staging": lambda name, size: name.endswith("reduce_staging.tmp")}


@pytest.fixture(scope="module")
def predicted_and_traced():
    """(row name, kind → the ledger's sizes, the trace's allocation sizes) of every traced one-step-per-phase row."""
    out = []
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
    return out


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_predicted_kernel_temporary_is_a_traced_allocation(kind, predicted_and_traced):
    rows = [(name, sizes[kind], traced) for name, sizes, traced in predicted_and_traced if sizes[kind]]
    assert len(rows) >= 20, f"only {len(rows)} traced rows predict a {kind}"
    missing = {name: sorted(predicted - traced) for name, predicted, traced in rows if not predicted <= traced}
    assert not missing, f"{kind} sizes no trace allocated: {missing}"
