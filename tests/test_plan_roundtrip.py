"""The round trip: every row `memplan plan --emit N` writes, read back by `memplan check --ds-config ...
--launch-file ...` and by `memplan plan --ds-config ... --launch-file ...` (plan.user), is the same Job with the
same estimate (the real estimator, Megatron-DeepSpeed jobs: plan --model-impl megatron)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan.budget import BudgetRequest
from memplan.check.command import CheckRequest, check
from memplan.check.launch import parse_launch
from memplan.plan.emit import candidate_job, emit
from memplan.plan.render import candidate_dict
from memplan.plan.request import PlanRequest, plan_space
from memplan.plan.search import search
from memplan.plan.user import user_job
from memplan.resolve import JobRequest

pytest.importorskip("memplan.estimator")


def plan(model: str, seq: int, gpus: int, gpu: str, target_gib: int | None, stages: tuple[int, ...],
         max_micro: int = 2):
    req = PlanRequest(job=JobRequest(model=model, seq=seq, gpus=gpus, model_impl="megatron"),
                      budget=BudgetRequest(gpu=gpu, target_bytes=target_gib * 2**30 if target_gib else None),
                      zero_stages=stages, max_micro_batch=max_micro, checkpointing=("full", "selective", "none"))
    space, _, _ = plan_space(req)
    return space, search(space)


def round_trip(space, result, model: str) -> int:
    """Emit every row, read it back both ways, compare; returns the rows checked."""
    rows = result.candidates
    for i, row in enumerate(rows, 1):
        with tempfile.TemporaryDirectory() as tmp:
            out = emit(space, rows, i, str(Path(tmp) / "row"), candidate_dict(row))
            ds, text = str(out / "ds_config.json"), (out / "launch.sh").read_text()
            launch = parse_launch(text, "--launch-file")
            job = candidate_job(space, row)
            checked = check(CheckRequest(ds_config=ds, launch=launch, model=model))
            assert not [f for f in checked.findings if f.severity == "error"], (i, checked.findings)
            assert checked.estimate_of == "as launched"
            assert checked.estimate.job == job, i
            assert (checked.estimate.peak_allocated_bytes, checked.estimate.device_total_bytes) == (
                row.peak_allocated_bytes, row.device_total_bytes), i
            assert user_job(model, space, ds, launch).job == job, i
    return len(rows)


@pytest.mark.parametrize("case", [
    ("llama-3.2-1b", 2048, 8, "a100-80g", None, (1, 3), 1),  # tp, pp, sp and dp rows, ZeRO 1 and 3, flash and eager
    ("gpt2-large", 1024, 8, "a100-40g", 6, (0, 1), 2),  # learned positions, tied; pipeline rows (PipelineEngine)
    ("llama-3.2-1b", 4096, 16, "a100-40g", 6, (2, 3), 2),  # two nodes, offload rows (cpu / nvme)
    ("176b", 32768, 8, "a100-80g", 24, (3,), 2),  # the article's model at the article's budget
], ids=["llama-dp-tp-pp-sp", "gpt2-pipeline", "llama-two-nodes-offload", "article"])
def test_every_emitted_row_reads_back_as_the_same_job(case):
    space, result = plan(*case)
    assert result.candidates, case
    assert round_trip(space, result, case[0]) == len(result.candidates)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model=st.sampled_from(["llama-3.2-1b", "gpt2-large", "llama-2-7b"]), gpus=st.sampled_from([2, 4, 8]),
       seq=st.sampled_from([1024, 2048]), stage=st.sampled_from([0, 1, 2, 3]), target=st.sampled_from([8, 20, 60]))
def test_round_trip_property(model, gpus, seq, stage, target):
    """Any small plan: every row it would emit reads back as itself."""
    space, result = plan(model, seq, gpus, "a100-80g", target, (stage,), 1)
    assert round_trip(space, result, model) == len(result.candidates)


def test_emit_needs_a_megatron_plan():
    from memplan.errors import InputError
    from memplan.plan.emit import emit_problem

    with pytest.raises(InputError, match="--model-impl megatron"):
        emit_problem(PlanRequest(job=JobRequest(model="llama-3.2-1b")))


def test_a_model_megatron_cannot_build_is_refused():
    from memplan.errors import InputError

    with pytest.raises(InputError) as info:
        plan_space(PlanRequest(job=JobRequest(model="qwen2.5-0.5b", model_impl="megatron")))
    assert info.value.field == "--model-impl" and "biases" in info.value.message
