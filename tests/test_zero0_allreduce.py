"""The engine's gradient allreduce without ZeRO (estimator.zero0, Zero0.end_backward), worked by hand:
allreduce_no_retain walks the grads in parameter order and flattens a bucket once it holds more than
MEMORY_OPT_ALLREDUCE_SIZE elements (one grad alone is viewed, not copied), whenever there is a process group."""

from __future__ import annotations

from memplan.estimator.autograd import Autograd
from memplan.estimator.optim import Optimizer
from memplan.estimator.zero0 import MEMORY_OPT_ALLREDUCE_SIZE, Zero0
from memplan.ledger import Ledger

M = MEMORY_OPT_ALLREDUCE_SIZE


def _flats(numels, world: int) -> list[int]:
    L = Ledger()
    z = Zero0(L, [f"p{i}" for i in range(len(numels))], list(numels), 4, Optimizer("adamw", on_gpu=True), world)
    z.end_backward(Autograd(L), True)
    return [L.sizes[e] for e in L.events if e >= 0 and L.names[e] == "engine.allreduce_flat"]


def test_buckets_close_past_the_size_and_a_lone_grad_is_not_copied():
    # 0.3 M + 0.3 M is not more than M; the 1.2 M grad joins them and closes a bucket of 1.8 M (a copy); the last
    # two, 0.1 M + 0.1 M, close at the end
    numels = [3 * M // 10, 3 * M // 10, 12 * M // 10, M // 10, M // 10]
    assert _flats(numels, world=2) == [4 * (18 * M // 10), 4 * (2 * M // 10)]
    # 1.2 M first closes a bucket of its own (viewed), and so does the lone 0.1 M left at the end
    assert _flats([12 * M // 10, M // 10], world=2) == []


def test_a_pipeline_without_data_parallelism_still_flattens_and_one_gpu_does_not():
    numels = [M // 2, M // 2, M // 2]
    assert _flats(numels, world=2) == [4 * (3 * M // 2)]  # 0.5 + 0.5 = M is not more than M: the third closes it
    assert _flats(numels, world=1) == []
