"""The performance model (memplan.plan.perf): toy cases worked by hand, and properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.plan.hardware import resolve_hardware
from memplan.plan.perf import PerfAssumptions, layer_matmul_params, micro_step_flops, model_costs, ring_bytes, step_time
from memplan.specs import Job, Layout, ModelSpec, TrainingSpec, ZeroSpec

A100, _ = resolve_hardware("a100-80g")
ASSUME = PerfAssumptions()


def toy_model(**changes) -> ModelSpec:
    """h 4, 2 layers, 2 heads of 2, MLP 8 (not gated), vocab 10."""
    fields = {"name": "toy", "family": "gpt2", "hidden_size": 4, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2, "head_dim": 2,
                  "intermediate_size": 8, "vocab_size": 10, "max_position_embeddings": 64, "gated_mlp": False,
                  "norm": "layernorm", "position_embedding": "learned", "tie_word_embeddings": True}
    fields.update(changes)
    return ModelSpec(**fields)


def job(model: ModelSpec, seq=3, micro=1, accum=1, ckpt="none", stage=0, world=1, tp=1, pp=1, sp=1, **zero):
    t = TrainingSpec(seq_len=seq, micro_batch=micro, grad_accum=accum, checkpointing=ckpt,
                     zero=ZeroSpec(stage=stage, **zero), optimizer="cpu_adam" if zero else "adamw")
    return Job(model=model, training=t, layout=Layout(world=world, tp=tp, pp=pp, sp=sp))


def test_layer_matmul_params_by_hand():
    # q, o: 2·(4·4) = 32; k, v: 2·(4·4) = 32; MLP fc_in + fc_out: 2·(4·8) = 64 → 128
    assert layer_matmul_params(toy_model()) == 128


def test_micro_step_flops_by_hand():
    c = model_costs(toy_model(), 3)
    # P_mm = 2 layers · 128 + LM head 4·10 = 296; forward 2·296·3 tokens = 1776
    # attention forward 4·L·q·s² = 4·2·4·9 = 288; training = 3 · (1776 + 288) = 6192
    assert micro_step_flops(c, 3, 1, "none") == 6192
    # full recompute adds the layers' forward: 2·256·3 + 288 = 1824
    assert micro_step_flops(c, 3, 1, "full") == 6192 + 1824
    # selective adds the attention core's forward only
    assert micro_step_flops(c, 3, 1, "selective") == 6192 + 288
    assert micro_step_flops(c, 3, 2, "none") == 2 * 6192


def test_ring_bytes_by_hand():
    assert ring_bytes(100, 4) == 75  # (4-1)/4 · 100
    assert ring_bytes(100, 4, all_reduce=True) == 150
    assert ring_bytes(100, 1) == 0


def test_pipeline_bubble_is_pp_minus_1_over_accum():
    m = toy_model(num_layers=8)
    st_ = step_time(job(m, accum=8, world=4, pp=4, stage=1), model_costs(m, 3), A100, ASSUME)
    micro = sum(t.seconds for t in st_.terms if t.name not in ("pipeline_bubble", "zero_step_comm", "optimizer_gpu"))
    bubble = next(t.seconds for t in st_.terms if t.name == "pipeline_bubble")
    assert bubble / micro == pytest.approx(3 / 8)


def test_compute_term_by_hand():
    m = toy_model()
    st_ = step_time(job(m), model_costs(m, 3), A100, ASSUME)
    compute = next(t.seconds for t in st_.terms if t.name == "compute")
    assert compute == pytest.approx(6192 / (0.5 * A100.dense_flops))


def test_zero3_comm_per_micro_step_by_hand():
    m = toy_model()
    c = model_costs(m, 3)
    j = job(m, world=8, stage=3, overlap_comm=False)
    st_ = step_time(j, c, A100, ASSUME)
    zero = next(t.seconds for t in st_.terms if t.name == "zero_comm")
    # 2 all-gathers of bf16 params + 1 reduce-scatter of bf16 grads, each 7/8 of P·2 bytes, over NVLink at 80%
    expected = 3 * (7 / 8) * c.total_params * 2 / (A100.nvlink_bytes_per_s * 0.8)
    assert zero == pytest.approx(expected)


def test_tp_group_beyond_a_node_uses_infiniband():
    m = toy_model(num_heads=16, num_kv_heads=16, hidden_size=32)
    c = model_costs(m, 3)
    inside = step_time(job(m, world=16, tp=8), c, A100, ASSUME)
    across = step_time(job(m, world=16, tp=16), c, A100, ASSUME)
    tp_in = next(t.seconds for t in inside.terms if t.name == "tp_allreduce")
    tp_out = next(t.seconds for t in across.terms if t.name == "tp_allreduce")
    assert tp_out > tp_in * (A100.nvlink_bytes_per_s / A100.inter_node_bytes_per_s) / 2


def test_offload_adds_offload_terms():
    m = toy_model()
    st_ = step_time(job(m, world=8, stage=3, offload_optimizer="nvme", offload_param="cpu"), model_costs(m, 3),
                    A100, ASSUME)
    names = {t.name for t in st_.terms}
    assert {"cpu_adam", "nvme_optimizer", "pcie_params"} <= names
    assert "optimizer_gpu" not in names


layouts = st.sampled_from([(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1), (1, 1, 4), (4, 1, 1)])


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(2, 8), extra_layers=st.integers(1, 8), width=st.integers(1, 64), extra=st.integers(1, 64),
       layout=layouts, stage=st.sampled_from([0, 1, 2, 3]), ckpt=st.sampled_from(["none", "selective", "full"]),
       offload=st.sampled_from(["none", "cpu", "nvme"]), micro=st.integers(1, 4), accum=st.integers(1, 8))
def test_step_time_never_falls_when_the_model_grows(layers, extra_layers, width, extra, layout, stage, ckpt, offload,
                                                   micro, accum):
    tp, pp, sp = layout
    if pp > 1 and stage >= 2:
        stage = 1
    zero = {} if stage == 0 or offload == "none" else {"offload_optimizer": offload}
    small = toy_model(num_heads=8, num_kv_heads=8, hidden_size=16, num_layers=layers, intermediate_size=width)
    big = small.model_copy(update={"num_layers": layers + extra_layers, "intermediate_size": width + extra})
    times = []
    for m in (small, big):
        j = job(m, seq=64, micro=micro, accum=accum, ckpt=ckpt, stage=stage, world=8, tp=tp, pp=pp, sp=sp, **zero)
        st_ = step_time(j, model_costs(m, 64), A100, ASSUME)
        assert all(t.seconds >= 0 for t in st_.terms)
        assert st_.seconds == pytest.approx(sum(st_.by_category().values()))
        times.append(st_.seconds)
    assert times[1] >= times[0]


def test_ulysses_alltoall_by_hand():
    m = toy_model()  # q = k = 4 wide, 2 layers
    c = model_costs(m, 8)
    st_ = step_time(job(m, seq=8, world=2, sp=2), c, A100, ASSUME)
    a2a = next(t.seconds for t in st_.terms if t.name == "ulysses_alltoall")
    # per layer and pass: (sp-1)/sp · b·(s/sp) · (2q + 2k) · 2 bytes = 1/2 · 4 · 16 · 2 = 64 bytes;
    # forward + backward, 2 layers → 256 bytes over NVLink at 80%
    assert a2a == pytest.approx(256 / (A100.nvlink_bytes_per_s * 0.8))


def test_eager_attention_adds_score_traffic():
    m = toy_model()
    c = model_costs(m, 3)
    eager = step_time(job(m).model_copy(update={"training": job(m).training.model_copy(
        update={"attention": "eager"})}), c, A100, ASSUME)
    scores = next(t.seconds for t in eager.terms if t.name == "eager_attention_scores")
    # L·a·s² = 2·2·9 = 36 score elements, 60 bytes each at HBM bandwidth
    assert scores == pytest.approx(36 * 60 / A100.hbm_bytes_per_s)
