"""ZeRO-2 offloaded with fp32 accumulation (zero12.Zero12 ``compact``), worked by hand on a toy group.

Four bf16 parameters of 100 elements over 2 ranks: the flat group is 400 elements (already aligned to 2·2), each
rank's partition 200 — rank 0 holds parameters 0 and 1, rank 1 parameters 2 and 3. Backward delivers grads last
parameter first (3, 2, 1, 0) into a 250-element IPG bucket, so the bucket overflows at parameter 1 (200 + 100 >
250): the first reduction holds only rank 1's parameters (3, 2) and builds nothing on rank 0; the second (1, 0, at
the end of backward) is rank 0's, and builds the compact fp32 partition (4 · 200 bytes) first. The measured row
this holds is s1-049 (tests/test_accuracy.py).
"""

from __future__ import annotations

from memplan.estimator.autograd import Autograd
from memplan.estimator.flat_groups import FlatGroup
from memplan.estimator.optim import Optimizer
from memplan.estimator.zero12 import Zero12
from memplan.ledger import Ledger

NAMES = ["p0", "p1", "p2", "p3"]


def _run():
    L = Ledger()
    group = FlatGroup(list(NAMES), [100] * 4, 2, 0)
    z = Zero12(L, 2, [group], 2, 250, False, 1, Optimizer("cpu_adam", on_gpu=False), offload=True, compact=True)
    z.initialize({})
    ag = Autograd(L)
    start = len(L.events)
    for name in reversed(NAMES):
        z.on_param_grad(ag, ag.param(name, 200), ag.empty(f"grad.{name}", 200))
    z.end_backward(ag, True)
    backward = [(L.names[e if e >= 0 else ~e], L.sizes[e if e >= 0 else ~e], e >= 0) for e in L.events[start:]]
    mid = len(L.events)
    z.step(True)
    step = [(L.names[~e], L.sizes[~e]) for e in L.events[mid:] if e < 0]
    return backward, step


def test_the_partition_is_built_by_the_first_reduction_of_a_local_slice():
    backward, _ = _run()
    names = [n for n, _, alloc in backward if alloc]
    first_flat = names.index("zero.allreduce_flat")
    built = names.index("zero.compact_grad_partition")
    assert built > first_flat  # the first flat all-reduce (rank 1's p3, p2) comes before it
    assert [s for n, s, a in backward if a and n == "zero.compact_grad_partition"] == [4 * 200]


def test_each_local_slice_is_cast_to_fp32_and_normed_in_fp64():
    backward, _ = _run()
    casts = [s for n, s, a in backward if a and n == "zero.compact_add_fp32"]
    norms = [s for n, s, a in backward if a and n == "zero.offload_norm_fp64"]
    assert casts == [4 * 100, 4 * 100]  # p1 and p0, this rank's
    assert norms == [8 * 100, 8 * 100]
    assert not [n for n, _, a in backward if a and n == "zero.grads_in_partition"]  # no 16-bit partition copy


def test_the_step_drops_the_partition():
    _, step = _run()
    assert ("zero.compact_grad_partition", 4 * 200) in step
