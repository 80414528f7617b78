"""The GPU-behind bound of reserved (estimator.gpu_behind): record_stream frees held to the next synchronization.

Toy ledgers worked by hand, a property of the reordering, and the estimate's fields for it. The bound against the
measured rows is in tests/test_accuracy.py; the timed figure the verdicts use, tests/test_gpu_time.py."""

from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.allocator import simulate
from memplan.api import estimate
from memplan.estimator import quick_peak
from memplan.estimator.gpu_behind import gpu_behind
from memplan.ledger import EMPTY_CACHE, Ledger
from memplan.presets import load_model
from memplan.specs import Job
from memplan.units import MiB

GATHER = 2  # a side stream (ZeRO-3's all-gather stream in the estimator)


def _two_gathers(record: bool, stream: int = GATHER) -> Ledger:
    """Phase a gathers 100 MiB, releases it (record_stream on the compute stream when ``record``), gathers
    100 MiB again; phase b starts."""
    L = Ledger()
    L.mark("a")
    x = L.alloc("layer0.weight (gathered)", 100 * MiB, "params_gathered", stream)
    if record:
        L.record_stream(x, 0)
    L.free(x)
    y = L.alloc("layer1.weight (gathered)", 100 * MiB, "params_gathered", stream)
    L.free(y)
    L.mark("b")
    L.free(L.alloc("activation", 4 * MiB, "activations"))
    return L


def test_a_deferred_free_moves_to_the_next_mark_and_its_block_is_not_reused():
    L = _two_gathers(record=True)
    late = gpu_behind(L)
    # the free of x (event 1) now comes after y's free, just before phase b's first event
    assert late.events == [0, 1, ~1, ~0, 2, ~2]
    assert [(m.label, m.at) for m in late.marks] == [("a", 0), ("b", 4)]
    # keeping up, the second gather reuses the first one's 100 MiB segment; behind, it needs its own (plus, in
    # both, phase b's 4 MiB activation in a 20 MiB segment of the default stream: kLargeBuffer)
    assert simulate(L).peak_reserved_bytes == 100 * MiB + 20 * MiB
    assert simulate(late).peak_reserved_bytes == 200 * MiB + 20 * MiB


def test_record_stream_on_the_allocation_stream_is_ignored():
    # CUDACachingAllocator's recordStream returns at once for the block's own stream: no deferred free
    assert gpu_behind(_two_gathers(record=True, stream=0)) is None
    assert gpu_behind(_two_gathers(record=False)) is None


def test_empty_cache_synchronizes_so_the_pending_free_lands_before_it():
    L = Ledger()
    x = L.alloc("gathered", 100 * MiB, "params_gathered", GATHER)
    L.record_stream(x, 0)
    L.free(x)
    L.mark("empty_cache", EMPTY_CACHE)
    L.free(L.alloc("next", 100 * MiB, "params_gathered", GATHER))
    late = gpu_behind(L)
    assert late.events == L.events and late.marks == L.marks  # nothing came between the free and the mark
    r = simulate(late)
    assert r.num_device_free == 1 and r.peak_reserved_bytes == 100 * MiB  # empty_cache gave the segment back


_EVENTS = st.lists(st.tuples(st.sampled_from(("alloc", "free", "mark")), st.integers(1, 64), st.booleans()),
                   max_size=60)


@settings(max_examples=60, deadline=None)
@given(_EVENTS)
def test_the_reordering_keeps_every_event_and_only_delays_recorded_frees(script):
    L = Ledger()
    live: list[int] = []
    for kind, mib, flag in script:
        if kind == "alloc":
            t = L.alloc("t", mib * MiB, "x", GATHER if flag else 0)
            if flag:
                L.record_stream(t, 0)
            live.append(t)
        elif kind == "free" and live:
            L.free(live.pop(mib % len(live)))
        elif kind == "mark":
            L.mark(f"m{len(L.marks)}")
    late = gpu_behind(L)
    if late is None:
        assert not L.stream_used
        return
    assert sorted(late.events) == sorted(L.events)
    assert [e for e in late.events if e >= 0] == [e for e in L.events if e >= 0]  # allocations keep their order
    pos = {e: i for i, e in enumerate(late.events)}
    for i, e in enumerate(L.events):
        if e < 0:
            assert pos[e] > pos[~e]  # still after its allocation
            if ~e not in L.stream_used:
                # an ordinary free keeps its place among the events that are not delayed frees
                before = [x for x in L.events[:i] if x >= 0 or ~x not in L.stream_used]
                assert [x for x in late.events[:pos[e]] if x >= 0 or ~x not in L.stream_used] == before
    assert [m.label for m in late.marks] == [m.label for m in L.marks]
    assert [m.at for m in late.marks] == sorted(m.at for m in late.marks)


def _zero3(**training) -> Job:
    return Job(model=load_model("llama-3.2-1b"), layout={"world": 8},
               training={"seq_len": 4096, "zero": {"stage": 3}, **training})


def test_zero3_carries_the_bound_beside_the_timed_figure_the_verdicts_use():
    job = _zero3()
    q = quick_peak(job)
    assert q.peak_reserved_behind_bytes is not None and q.peak_reserved_behind_bytes >= q.peak_reserved_bytes
    est = estimate(job)
    assert est.peak_reserved_gpu_behind_bytes == q.peak_reserved_behind_bytes
    assert est.device_total_gpu_behind_bytes == est.peak_reserved_gpu_behind_bytes + est.non_torch_bytes
    assert est.device_total_bytes == q.device_total_bytes  # the timed figure (estimator.gpu_time)
    at_the_edge = est.model_copy(update={"gpu_bytes": est.device_total_bytes, "target_bytes": est.device_total_bytes})
    assert at_the_edge.fits_gpu is True and at_the_edge.fits_target is True
    under = est.model_copy(update={"gpu_bytes": est.device_total_bytes - 1})
    assert under.fits_gpu is False


def test_without_zero3_there_is_no_bound():
    job = _zero3().model_copy(update={"training": _zero3().training.model_copy(
        update={"zero": _zero3().training.zero.model_copy(update={"stage": 2})})})
    est = estimate(job)
    assert est.peak_reserved_gpu_behind_bytes is None and est.device_total_gpu_behind_bytes is None
    assert quick_peak(job).peak_reserved_behind_bytes is None
