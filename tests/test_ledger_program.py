"""The ledger program end to end: the third optimizer step repeats the second (estimator.ledger_steps)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.estimator import ledger_steps, ledger_supported
from memplan.estimator.program import build_ledger
from memplan.estimator.summary import summarize
from memplan.presets import load_model
from memplan.specs import Job, Layout, TrainingSpec, ZeroSpec


def _job(stage, ckpt, loop, micro, ga, seq, world, layers):
    model = load_model("llama-3.2-1b").model_copy(update={"num_layers": layers})
    training = TrainingSpec(seq_len=seq, micro_batch=micro, grad_accum=ga, dtype="bf16", checkpointing=ckpt,
                            attention="sdpa", optimizer="adamw", loop=loop, zero=ZeroSpec(stage=stage))
    return Job(model=model, training=training, layout=Layout(world=world, gpus_per_node=8))


@settings(max_examples=25, deadline=None)
@given(stage=st.sampled_from([0, 1, 2, 3]), ckpt=st.sampled_from(["none", "full"]),
       loop=st.sampled_from(["outputs", "loss"]), micro=st.sampled_from([1, 2]), ga=st.sampled_from([1, 2]),
       seq=st.sampled_from([256, 1024]), layers=st.integers(2, 4))
def test_third_step_repeats_the_second(stage, ckpt, loop, micro, ga, seq, layers):
    """Two steps read what three read: the same reserved peak, the same allocated to the unsplit-block slack."""
    job = _job(stage, ckpt, loop, micro, ga, seq, 1 if stage == 0 else 4, layers)
    assert ledger_supported(job)
    assert ledger_steps() == 2 and ledger_steps((0,)) == 3
    three = summarize(job, build_ledger(job, steps=3), timeline=False)
    two = summarize(job, build_ledger(job, steps=2), timeline=False)
    # the same tensors at the same moments: reserved equal; torch's allocated counter may differ by which large
    # blocks the cache hands out unsplit (each carries < 1 MiB of slack: should_split, kSmallSize)
    assert two.peak_reserved_bytes == three.peak_reserved_bytes
    assert abs(two.peak_allocated_bytes - three.peak_allocated_bytes) <= 0.001 * three.peak_allocated_bytes
