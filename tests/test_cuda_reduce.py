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


@pytest.mark.parametrize("tiny", ["llama_gqa", "olmo2", "gemma2"])
def test_a_norm_weight_grad_stages_after_its_sum_on_cuda_only(tiny):
    """The RMSNorm weight's grad is summed over the rows by validate_outputs (trace19-s4-041). Worked by hand for
    [4096 rows, 64]: vec 4, a block of 16 × 8 threads, 512 values per thread column, 32 CTAs: 4 · 64 · 32 · 16 · 4
    = 524288 staging bytes and 4 semaphore bytes (one block column), right after the sum's result (Llama's
    [64] bf16 grad, OLMo 2's fp32 sum before its cast, Gemma's fp32 (1 + w) grad)."""
    from memplan.estimator import model_check

    assert sum_rows_staging(4096, 64) == (524288, 4)
    cfg = model_check.TINY[tiny]
    norms = 2 * 2 + 1 if tiny == "llama_gqa" else 2 * 4 + 1  # two layers' norms and the final one
    ledger, _ = model_check.micro_step(cfg, 1, 4096, "bf16", "sdpa", "cuda")
    events = [(e >= 0, ledger.names[e if e >= 0 else ~e], ledger.sizes[e if e >= 0 else ~e]) for e in ledger.events]
    staged = [i for i, (alloc, name, _) in enumerate(events) if alloc and name.endswith("reduce_staging.tmp")]
    assert len(staged) == norms
    for i in staged:
        before, here, after = events[i - 1], events[i], events[i + 1]
        assert before[0] and before[1].endswith((".reduced", ".summed"))
        assert after[0] and after[1].endswith("reduce_semaphores.tmp")
        if "_norm." not in here[1]:  # the hidden-width norms (OLMo 2's q_norm / k_norm span other widths)
            assert (here[2], after[2]) == (524288, 4)
    cpu, _ = model_check.micro_step(cfg, 1, 4096, "bf16", "sdpa", "cpu")
    assert not any(name.endswith("reduce_staging.tmp") for name in cpu.names)
