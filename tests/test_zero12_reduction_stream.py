"""ZeRO-1/2's frees after a reduction on the reduction stream (estimator.zero12, _on_reduction_stream), worked by
hand on a toy group: rank 0 of 2 over four parameters, a bucket of 250 elements; with overlap_comm the tensor each
reduction reads is used on the reduction stream (average_tensor's _record_gradient_stream under cpu_offload,
allreduce_and_copy_with_multiple_ranks' ``buf.record_stream`` for this rank's slices), so its free waits for the
GPU (estimator.gpu_time); without overlap_comm the reduction runs on the default stream and nothing is deferred."""

from __future__ import annotations

import pytest

from memplan.estimator.autograd import Autograd
from memplan.estimator.flat_groups import FlatGroup
from memplan.estimator.optim import Optimizer
from memplan.estimator.zero12 import REDUCTION_STREAM, Zero12
from memplan.ledger import Ledger


def _run(numels, overlap: bool, offload: bool):
    """One backward of the group (grads produced last parameter first) and its epilogue; returns the ledger and
    {ledger name: stream it was recorded on} of the tensors recorded on another stream."""
    L = Ledger()
    names = [f"p{i}" for i in range(len(numels))]
    group = FlatGroup(list(names), list(numels), 2, 0)
    z = Zero12(L, 2, [group], 2, 250, overlap, 1, Optimizer("adam", on_gpu=not offload), offload=offload)
    z.initialize({})
    ag = Autograd(L)
    for name, n in reversed(list(zip(names, numels))):
        z.on_param_grad(ag, ag.param(name, 2 * n), ag.empty(f"grad.{name}", 2 * n))
    z.end_backward(ag, True)
    return L, {L.names[t]: s for t, s in L.stream_used.items()}


def test_without_overlap_comm_nothing_is_deferred():
    for offload in (False, True):
        _, used = _run([100, 100, 400, 100], overlap=False, offload=offload)
        assert used == {}


def test_an_extra_large_grad_and_the_bucket_wait_for_the_reduction_stream():
    # 700 elements, rank 0 holds [0, 350). p3 ([600, 700): rank 1's) fills buffer 0; p2 (400 > 250) first reduces
    # it (no slice for rank 0: not recorded; bucket.index swaps to 1), then goes alone; p1 reduces p2 (its slice
    # [200, 350) is rank 0's: its own grad is recorded; the index swaps back to 0); p1 and p0 fill buffer 0, reduced
    # at the epilogue and recorded
    L, used = _run([100, 100, 400, 100], overlap=True, offload=False)
    assert used == {"grad.p2": REDUCTION_STREAM, "zero.ipg_bucket": REDUCTION_STREAM}
    recorded_bucket = next(t for t in L.stream_used if L.names[t] == "zero.ipg_bucket")
    buckets = [t for t in range(len(L.names)) if L.names[t] == "zero.ipg_bucket"]
    assert recorded_bucket == buckets[0]  # two swaps: back to the first buffer


def test_a_remote_bucket_is_recorded_only_under_offload():
    # rank 1 of 2 over p0, p1 (100 each): p0 alone in the bucket has no slice for rank 1, so only the offload
    # path's _record_gradient_stream records the buffer
    group = FlatGroup(["p0", "p1"], [100, 100], 2, 1)  # rank 1 holds [100, 200): p1 only
    for offload, expect in ((False, {}), (True, {"zero.ipg_bucket": REDUCTION_STREAM})):
        L = Ledger()
        z = Zero12(L, 2, [group], 2, 250, True, 1, Optimizer("adam", on_gpu=not offload), offload=offload)
        z.initialize({})
        ag = Autograd(L)
        z.on_param_grad(ag, ag.param("p0", 200), ag.empty("grad.p0", 200))  # rank 0's alone in the bucket
        z.reduce_ipg_grads(ag)
        assert {L.names[t]: s for t, s in L.stream_used.items()} == expect, offload


@pytest.mark.parametrize("overlap", [False, True])
def test_each_reduction_queues_its_average_on_the_compute_queue(overlap):
    # average_tensor's div_ over what it reduces: 2 bytes × elements read and written, once per reduction
    L, _ = _run([100, 100, 400, 100], overlap=overlap, offload=False)
    reductions = [b for b, f, k in zip(L.work_bytes, L.work_flops, L.work_kernel) if b and not f]
    assert sorted(reductions) == sorted([2 * 2 * 100, 2 * 2 * 400, 2 * 2 * 200])
