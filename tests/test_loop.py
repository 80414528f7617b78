"""The training loops' own ledger events (memplan.estimator.loop): toy cases worked by hand and properties.

The real traces (tests/test_loop_trace.py) hold the order; here the sizes, the phases and what stays alive are
checked from the loops' code as the module docstring cites it.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.estimator.program import build_ledger
from memplan.hfconfig import model_from_config
from memplan.specs import Job, Layout, TrainingSpec, ZeroSpec

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512}


def job(loop="loss", stage=2, world=1, micro=1, seq=16, ga=1, offload="none", **training) -> Job:
    model = model_from_config(TINY, "tiny", "test")
    zero = ZeroSpec(stage=stage, offload_optimizer=offload)
    return Job(model=model, training=TrainingSpec(seq_len=seq, micro_batch=micro, grad_accum=ga, loop=loop,
                                                  zero=zero, **training), layout=Layout(world=world))


def live_at_marks(L, component: str) -> dict[str, list[tuple[str, int]]]:
    """At each phase mark: the (name, requested bytes) of the live tensors of ``component``."""
    alive: dict[int, None] = {}
    at = {m.at: m.label for m in L.marks if m.kind == "phase"}
    out = {}
    for i, ev in enumerate(L.events + [None]):
        if i in at:
            out[at[i]] = [(L.names[t], L.sizes[t]) for t in alive if L.components[t] == component]
        if ev is None:
            break
        if ev >= 0:
            alive[ev] = None
        else:
            del alive[~ev]
    return out


def test_trainer_phases_step_at_the_boundary_only():
    L = build_ledger(job("hf-trainer", ga=2), steps=2)
    assert [label for label, _, _ in L.phase_spans()] == [
        "init", "step0.micro0.forward", "step0.micro0.backward", "step0.micro1.forward", "step0.micro1.backward",
        "step0.micro1.step", "step1.micro0.forward", "step1.micro0.backward", "step1.micro1.forward",
        "step1.micro1.backward", "step1.micro1.step"]
    ds = build_ledger(job("loss", ga=2), steps=1)
    assert [label for label, _, _ in ds.phase_spans()][1:] == [
        "step0.micro0.forward", "step0.micro0.backward", "step0.micro0.step", "step0.micro1.forward",
        "step0.micro1.backward", "step0.micro1.step"]


def test_inputs_alive_in_each_phase_by_hand():
    # B = 2, S = 16, int64: a [B, S] tensor is 256 bytes, the positions [S] 128
    ds = live_at_marks(build_ledger(job("loss", micro=2, ga=2), steps=2), "inputs")
    for label, live in ds.items():
        if label != "init":  # position ids for the run, this micro-step's input ids
            assert live == [("loop.position_ids", 128), ("loop.input_ids", 256)], label
    tr = live_at_marks(build_ledger(job("hf-trainer", micro=2, ga=3), steps=2), "inputs")
    window = [("trainer.batch.input_ids", 256), ("trainer.batch.labels", 256)] * 3
    for label, live in tr.items():
        if label != "init":  # the whole window, fetched before its first micro-step; the last one freed
            assert live == window, label


def test_trainer_scalars_by_hand():
    # world 8: the label count is gathered (clone [1] int64, output [8] int64, .sum()); the loss is the summed
    # nll over that count (a 0-d fp32); stage 2 scales it (loss_scaler), stage 0 in bf16 does not
    L = build_ledger(job("hf-trainer", world=8, ga=2), steps=1)
    names = [(L.names[t], L.sizes[t]) for t in (ev for ev in L.events if ev >= 0)]
    counts = [n for n in names if n[0].startswith("trainer.") and n[0] not in (
        "trainer.batch.input_ids", "trainer.batch.labels")]
    assert counts[:10] == [
        ("trainer._tr_loss", 4),
        ("trainer.labels_ne", 15), ("trainer.labels_count", 8), ("trainer.num_items_in_batch", 8),
        ("trainer.labels_ne", 15), ("trainer.labels_count", 8), ("trainer.num_items_in_batch", 8),
        ("trainer.gather.clone", 8), ("trainer.gather.output", 64), ("trainer.num_items_in_batch", 8)]
    assert ("engine.scaled_loss", 4) in names and ("engine.loss_over_gas", 4) not in names  # scale_wrt_gas=False
    z0 = build_ledger(job("hf-trainer", stage=0), steps=1)
    assert "engine.scaled_loss" not in z0.names and "trainer.gather.clone" not in z0.names  # world 1: no gather
    ds = build_ledger(job("loss", stage=0), steps=1)
    assert "engine.loss_over_gas" in ds.names and "engine.scaled_loss" not in ds.names


def test_offload_clones_an_extra_large_grad():
    # reduce_bucket_size 10000 elements: only the embedding and lm_head (256·64 = 16384 each; the MLP's weights
    # are 64·128 = 8192) bypass the bucket; under optimizer offload DeepSpeed clones each before reducing it
    # (_offload_gradient_safety_enabled)
    small = {"reduce_bucket_size": 10000, "allgather_bucket_size": 10000}
    base = job("loss", world=2, optimizer="cpu_adam")
    z = base.training.zero.model_copy(update={**small, "offload_optimizer": "cpu"})
    off = base.model_copy(update={"training": base.training.model_copy(update={"zero": z})})
    L = build_ledger(off, steps=1)
    clones = [L.sizes[t] for t in (ev for ev in L.events if ev >= 0) if L.names[t] == "zero.extra_large_grad_clone"]
    assert clones == [2 * 16384, 2 * 16384]  # lm_head, then the embedding (backward order)
    on_gpu = off.model_copy(update={"training": off.training.model_copy(update={
        "optimizer": "adamw", "zero": z.model_copy(update={"offload_optimizer": "none"})})})
    assert "zero.extra_large_grad_clone" not in build_ledger(on_gpu, steps=1).names


def test_cublas_workspace_per_thread():
    L = build_ledger(job("loss"), steps=2)
    spans = {label: (a, z) for label, a, z in L.phase_spans()}
    at = [i for i, ev in enumerate(L.events) if ev >= 0 and L.names[ev] == "cublas.workspace"]
    assert len(at) == 2  # one per thread's handle, made once
    assert spans["step0.micro0.forward"][0] <= at[0] < spans["step0.micro0.forward"][1]
    assert spans["step0.micro0.backward"][0] <= at[1] < spans["step0.micro0.backward"][1]


@pytest.mark.parametrize("tied", [False, True])
def test_backward_workspace_follows_the_first_backward_gemm_output(tied):
    """The engine thread's handle makes its workspace at its first gemm, after that gemm's output exists: the
    lm_head's MmBackward0 allocates the weight's grad [vocab, hidden] first, so the workspace comes right after
    it and before the input's grad; a tied embedding's grad reaches its hook only at the embedding, which must
    not delay it (the traces of tied Qwen models place it so)."""
    config = dict(TINY, tie_word_embeddings=tied)
    model = model_from_config(config, "tiny", "test")
    j = Job(model=model, training=TrainingSpec(seq_len=16, micro_batch=1, loop="loss", zero=ZeroSpec(stage=2)),
            layout=Layout(world=1))
    L = build_ledger(j, steps=1)
    allocs = [t for t in L.events if t >= 0]
    ws = [k for k, t in enumerate(allocs) if L.names[t] == "cublas.workspace"]
    assert len(ws) == 2
    before, after = L.names[allocs[ws[1] - 1]], L.names[allocs[ws[1] + 1]]
    assert before == "grad.lm_head.weight" and L.sizes[allocs[ws[1] - 1]] == 2 * 256 * 64  # [vocab, hidden] bf16
    assert after == "grad.lm_head.input"


@settings(max_examples=25, deadline=None)
@given(loop=st.sampled_from(["outputs", "loss", "hf-trainer"]), micro=st.integers(1, 3), seq=st.sampled_from([8, 16]),
       ga=st.integers(1, 3), steps=st.integers(1, 3), world=st.sampled_from([1, 2, 8]), stage=st.sampled_from([0, 2]))
def test_the_loop_leaves_only_what_its_code_keeps(loop, micro, seq, ga, steps, world, stage):
    """After the last step, the loop's own tensors alive are exactly what its Python still holds: the DeepSpeed
    loop its positions (and, keeping outputs, the last logits); the Trainer its _tr_loss, the last window's
    batches and count, and the last loss."""
    L = build_ledger(job(loop, stage=stage, world=world, micro=micro, seq=seq, ga=ga), steps=steps)
    live = sorted((L.names[t], L.sizes[t]) for t in L.live() if L.components[t] in ("inputs", "loop_scalars"))
    if loop == "hf-trainer":
        batch = 8 * micro * seq
        expected = ([("trainer._tr_loss", 4), ("trainer.loss_over_num_items", 4), ("trainer.num_items_in_batch", 8)]
                    + [("trainer.batch.input_ids", batch), ("trainer.batch.labels", batch)] * ga)
    else:
        expected = [("loop.position_ids", 8 * seq)]
    assert live == sorted(expected)
    logits = [t for t in L.live() if L.names[t] == "lm_head"]
    assert len(logits) == (1 if loop == "outputs" else 0)


@pytest.mark.parametrize("preset", ["gemma-2-2b", "phi-3-mini", "olmo-2-1b"])
def test_phase_lists_outputs_minus_loss_is_the_output_object(preset):
    """issue 11 on the jobs the phase lists predict (the ledger's own is test_ledger_program; these families'
    full training and plain LoRA are on the ledger, a DoRA job is not): keeping the output object adds its logits [T, V]
    in the training dtype at every moment of the step, so at the peak."""
    from memplan.api import estimate
    from memplan.estimator import ledger_supported
    from memplan.presets import load_model
    from memplan.specs import LoraSpec

    model = load_model(preset)

    def job(loop):
        lora = LoraSpec(rank=8, targets=("all-linear",), use_dora=True)
        return Job(model=model, training=TrainingSpec(seq_len=1024, micro_batch=2, loop=loop, zero=ZeroSpec(stage=2),
                                                      lora=lora), layout=Layout(world=8))

    assert not ledger_supported(job("outputs"))
    logits = 2 * 2 * 1024 * model.vocab_size  # bf16 × micro-batch × seq × V
    assert estimate(job("outputs")).peak_allocated_bytes - estimate(job("loss")).peak_allocated_bytes == logits
