"""The plan search (memplan.plan.search) over the FAKE estimator of test_plan_fake: validity, budgets, pruning."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from test_plan_fake import fake_quick_peak

from memplan.plan.emit import candidate_job
from memplan.plan.hardware import resolve_hardware
from memplan.plan.search import search
from memplan.plan.space import PlanSpace, default_global_batch, default_target_bytes, layout_problem
from memplan.presets import load_model
from memplan.specs import Job, Layout, ModelSpec, TrainingSpec

GIB = 2**30
HW, _ = resolve_hardware("a100-80g")


def space(model="qwen2.5-0.5b", seq=4096, world=8, target_gib=40, **kw) -> PlanSpace:
    fields = {"model": load_model(model), "seq_len": seq, "global_batch": kw.pop("global_batch", 4 * world), "world": world,
                  "hardware": HW, "target_bytes": target_gib * GIB, "host_ram_bytes_per_node": HW.host_ram_bytes_per_node,
                  "nvme_bytes_per_node": HW.nvme_bytes_per_node, "max_micro_batch": 8}
    fields.update(kw)
    return PlanSpace(**fields)


def test_defaults_by_hand():
    # 4Mi tokens / 32768 = 128 sequences, already a multiple of 8
    assert default_global_batch(32768, 8) == 128
    # 4Mi / 3000 = 1398.1 → 1399 sequences → next multiple of 16: 1408
    assert default_global_batch(3000, 16) == 1408
    # 80 GiB less max(2 GiB, 5%·80 GiB = 4 GiB)
    assert default_target_bytes(80 * GIB) == 76 * GIB
    assert default_target_bytes(20 * GIB) == 18 * GIB


def _all(result):
    return result.candidates + result.closest


@settings(max_examples=15, deadline=None)
@given(target=st.integers(2, 80), host_gb=st.sampled_from([1, 50, 2000]), nvme_gb=st.sampled_from([0, 1, 30000]),
       model=st.sampled_from(["qwen2.5-0.5b", "llama-3.2-1b", "tinymixtral"]), world=st.sampled_from([4, 8, 16]))
def test_feasible_candidates_meet_every_budget_and_are_valid_jobs(target, host_gb, nvme_gb, model, world):
    sp_ = space(model=model, world=world, target_gib=target, host_ram_bytes_per_node=host_gb * 10**9,
                nvme_bytes_per_node=nvme_gb * 10**9)
    result = search(sp_, fake_quick_peak)
    for c in result.candidates:
        assert c.device_total_bytes <= sp_.target_bytes
        assert c.host_bytes_per_node <= sp_.host_ram_bytes_per_node
        assert c.nvme_bytes_per_node <= sp_.nvme_bytes_per_node
    for c in _all(result):
        job = candidate_job(sp_, c)  # full validation: raises if the search let an invalid layout through
        assert job.training.micro_batch * job.training.grad_accum * job.layout.dp == sp_.global_batch
    times = [c.step_time_s for c in result.candidates]
    assert times == sorted(times)


@settings(max_examples=10, deadline=None)
@given(target=st.integers(4, 60), model=st.sampled_from(["qwen2.5-0.5b", "llama-3.2-1b"]),
       seq=st.sampled_from([2048, 8192]))
def test_pruning_loses_no_feasible_candidate(target, model, seq):
    sp_ = space(model=model, seq=seq, target_gib=target, host_ram_bytes_per_node=10**11)
    pruned, full = search(sp_, fake_quick_peak), search(sp_, fake_quick_peak, prune=False)

    def key(c):
        return (c.zero, c.tp, c.pp, c.sp, c.offload_optimizer, c.offload_param, c.checkpointing, c.attention,
                c.micro_batch)
    assert {key(c) for c in pruned.candidates} == {key(c) for c in full.candidates}
    assert pruned.searched == full.searched == full.evaluated
    assert pruned.evaluated <= full.evaluated


def test_exclusions_are_respected():
    sp_ = space(zero_stages=(2, 3), offload_devices=("none",), max_tp=2, max_pp=1, checkpointing=("full",),
                attention=("flash",))
    result = search(sp_, fake_quick_peak, prune=False)
    assert result.evaluated > 0
    for c in _all(result):
        assert c.zero in (2, 3) and c.offload_optimizer == c.offload_param == "none"
        assert c.tp <= 2 and c.pp == 1 and c.checkpointing == "full" and c.attention == "flash"


@settings(max_examples=200, deadline=None)
@given(heads=st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]), kv_div=st.sampled_from([1, 2, 4]),
       layers=st.integers(1, 6), seq=st.sampled_from([6, 8, 12, 16]),
       tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2, 8]), sp=st.sampled_from([1, 2, 3, 4]))
def test_layout_problem_agrees_with_the_job_validator(heads, kv_div, layers, seq, tp, pp, sp):
    kv = heads // kv_div if heads % kv_div == 0 else heads
    m = ModelSpec(name="t", family="llama", hidden_size=heads * 4, num_layers=layers, num_heads=heads,
                  num_kv_heads=kv, head_dim=4, intermediate_size=8, vocab_size=16, max_position_embeddings=64)
    world = tp * pp * sp
    try:
        Job(model=m, training=TrainingSpec(seq_len=seq), layout=Layout(world=world, tp=tp, pp=pp, sp=sp))
        valid = True
    except ValidationError:
        valid = False
    assert (layout_problem(m, seq, tp, pp, sp) is None) == valid


def test_nothing_fits_keeps_the_closest():
    sp_ = space(target_gib=1)
    result = search(sp_, fake_quick_peak)
    assert result.feasible == 0 and result.closest
    assert all(c.misses for c in result.closest)
    ratios = [max(c.device_total_bytes / sp_.target_bytes, c.host_bytes_per_node / sp_.host_ram_bytes_per_node)
              for c in result.closest]
    assert ratios == sorted(ratios)


@settings(max_examples=150, deadline=None)
@given(heads=st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]), layers=st.integers(1, 6), seq=st.sampled_from([6, 8, 12, 16]),
       tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2, 8]), sp=st.sampled_from([1, 2, 3, 4]))
def test_layout_problem_agrees_with_check_rules(heads, layers, seq, tp, pp, sp):
    """For multi-head models within max_position_embeddings and at least pp layers, plan's rules and memplan
    check's agree (check only warns about fewer layers than pp; the Job validator refuses it)."""
    from memplan.plan.space import check_problem

    layers = max(layers, pp)
    m = ModelSpec(name="t", family="llama", hidden_size=heads * 4, num_layers=layers, num_heads=heads,
                  num_kv_heads=heads, head_dim=4, intermediate_size=8, vocab_size=16, max_position_embeddings=64)
    world = tp * pp * sp
    assert (layout_problem(m, seq, tp, pp, sp) is None) == (check_problem(m, seq, world, tp, pp, sp) is None)


@pytest.mark.parametrize("model, seq, world, target_gib", [
    ("qwen2.5-0.5b", 4096, 8, 16), ("tinymixtral", 2048, 4, 8), ("gpt2-xl", 1024, 8, 24), ("llama-3-8b", 8192, 16, 40),
])
def test_pruning_is_exact_with_the_real_estimator(model, seq, world, target_gib):
    """The pruning rules rest on the estimator's monotonicity (micro-batch, checkpointing): check it holds."""
    pytest.importorskip("memplan.estimator")
    sp_ = space(model=model, seq=seq, world=world, target_gib=target_gib, host_ram_bytes_per_node=10**11,
                nvme_bytes_per_node=10**12, max_micro_batch=4)
    pruned, full = search(sp_), search(sp_, prune=False)

    def key(c):
        return (c.zero, c.tp, c.pp, c.sp, c.offload_optimizer, c.offload_param, c.checkpointing, c.attention,
                c.micro_batch)
    assert {key(c) for c in pruned.candidates} == {key(c) for c in full.candidates}
    assert pruned.feasible == full.feasible


def test_selective_is_searched_only_when_the_estimator_models_it():
    sp_ = space(checkpointing=("selective", "none"))
    modelled = search(sp_, fake_quick_peak, prune=False)
    assert any(c.checkpointing == "selective" for c in modelled.candidates) and not modelled.notes

    def selective_as_none(job):
        t = job.training
        if t.checkpointing == "selective":
            job = job.model_copy(update={"training": t.model_copy(update={"checkpointing": "none"})})
        return fake_quick_peak(job)
    unmodelled = search(sp_, selective_as_none, prune=False)
    assert all(c.checkpointing == "none" for c in unmodelled.candidates + unmodelled.closest)
    assert unmodelled.notes
