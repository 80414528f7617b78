"""CUDA's reduction staging (estimator/cuda_reduce.py) against what the H200 allocated
(benchmarks/allocator/gpu/reduce_staging.json)."""

import json
from pathlib import Path

import pytest

from memplan.estimator.cuda_reduce import sum_rows_staging

DATA = Path(__file__).resolve().parents[1] / "benchmarks" / "allocator" / "gpu" / "reduce_staging.json"
BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}


@pytest.mark.parametrize("row", json.loads(DATA.read_text())["measured"], ids=lambda r: f"{r['rows']}x{r['out']}-{r['dtype']}")
def test_staging_equals_the_measured_allocations(row):
    allocs = row["reduce_grad_allocs"]
    assert allocs[0] == row["out"] * BYTES[row["dtype"]]  # the result comes first
    buf, sem = sum_rows_staging(row["rows"], row["out"])
    assert [x for x in (buf, sem) if x] == allocs[1:]


def test_small_reductions_need_no_staging():
    assert sum_rows_staging(1, 4096) == (0, 0)
    buf, sem = sum_rows_staging(1 << 20, 1024)
    assert buf > 0 and sem > 0 and buf % (4 * 1024) == 0
