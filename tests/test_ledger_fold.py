"""Gradient accumulation folded (estimator/fold.py): the folded ledger reads the peaks of the whole one."""

from hypothesis import given, settings
from hypothesis import strategies as st
from test_ledger_program import _job

from memplan.estimator.fold import FOLD_ABOVE, folded
from memplan.estimator.program import build_ledger
from memplan.estimator.summary import allocator_config, summarize


def _build(job, steps, skipped):
    return build_ledger(job, steps=steps, skipped=skipped)


@settings(max_examples=15, deadline=None)
@given(stage=st.sampled_from([0, 1, 2, 3]), ckpt=st.sampled_from(["none", "full"]),
       loop=st.sampled_from(["outputs", "loss"]), micro=st.sampled_from([1, 2]),
       ga=st.integers(FOLD_ABOVE + 1, 12), seq=st.sampled_from([256, 1024]), layers=st.integers(2, 3))
def test_folded_reads_the_whole_jobs_peaks(stage, ckpt, loop, micro, ga, seq, layers):
    job = _job(stage, ckpt, loop, micro, ga, seq, 1 if stage == 0 else 4, layers)
    config = allocator_config(job)
    short = folded(job, _build, 2, (), config)
    whole = summarize(job, build_ledger(job, steps=2))
    if short is None:  # no fixed point found below ga: the whole job is built (nothing to compare)
        return
    L, sim = short
    got = summarize(job, L, sim=sim)
    assert L.phase_spans()[-1][0] == f"step1.micro{ga - 1}.step"  # the boundary named as in the whole job
    assert (got.peak_allocated_bytes, got.peak_reserved_bytes, got.peak_phase) == (
        whole.peak_allocated_bytes, whole.peak_reserved_bytes, whole.peak_phase)
    assert len(L.events) < len(build_ledger(job, steps=2).events)


def test_folding_happens_on_a_plain_job():
    """A ZeRO-2 job of 16 micro-steps folds (the check above is not vacuous)."""
    job = _job(2, "none", "loss", 1, 16, 256, 4, 2)
    assert folded(job, _build, 2, (), allocator_config(job)) is not None


@settings(max_examples=6, deadline=None)
@given(stage=st.sampled_from([1, 3]), loop=st.sampled_from(["outputs", "loss"]), ga=st.integers(13, 41),
       seq=st.sampled_from([256, 1024]))
def test_long_accumulation_folds_exactly(stage, loop, ga, seq):
    """Past the first probes (K doubling from FOLD_START, any cycle period): folded equals whole."""
    job = _job(stage, "none", loop, 1, ga, seq, 4, 2)
    short = folded(job, _build, 2, (), allocator_config(job))
    if short is None:
        return
    whole = summarize(job, build_ledger(job, steps=2))
    got = summarize(job, short[0], sim=short[1])
    assert (got.peak_allocated_bytes, got.peak_reserved_bytes, got.peak_phase) == (
        whole.peak_allocated_bytes, whole.peak_reserved_bytes, whole.peak_phase)
