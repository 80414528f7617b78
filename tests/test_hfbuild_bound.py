"""verify's bound_partitions: garbage in a ZeRO-3 partition becomes finite and bounded, with no allocation.

The garbage is the kind a plain ``deepspeed.zero.Init`` leaves in an MoE expert built with ``torch.empty``
(hfbuild.bound_partitions' docstring); the test plants it on a CPU tensor standing in for ``ds_tensor``."""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from memplan.verify.hfbuild import PARTITION_BOUND, bound_partitions


class _Owner(torch.nn.Module):
    def __init__(self, values: list[float]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(0))
        self.weight.ds_tensor = torch.tensor(values, dtype=torch.float32)
        self.plain = torch.nn.Parameter(torch.tensor([100.0]))  # no ds_tensor: left as it is
        self.index = torch.nn.Parameter(torch.tensor([3]), requires_grad=False)
        self.index.ds_tensor = torch.tensor([7, -9], dtype=torch.int64)  # not floating: left as it is


def test_garbage_partitions_become_finite_and_bounded_in_place():
    owner = _Owner([2.8e19, math.inf, -math.inf, math.nan, 0.5, -3.0])
    storage = owner.weight.ds_tensor.data_ptr()
    bound_partitions(owner)
    part = owner.weight.ds_tensor
    assert part.data_ptr() == storage
    assert torch.isfinite(part).all()
    assert part.abs().max().item() <= PARTITION_BOUND
    assert part.tolist() == [PARTITION_BOUND, 0.0, 0.0, 0.0, 0.5, -3.0]
    assert owner.plain.tolist() == [100.0]
    assert owner.index.ds_tensor.tolist() == [7, -9]


def test_bounding_makes_no_allocation():
    from torch.profiler import ProfilerActivity, profile

    owner = _Owner([1e30] * 4096)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        bound_partitions(owner)
    allocated = [event for event in prof.events() if getattr(event, "cpu_memory_usage", 0) > 0]
    assert allocated == []
    assert owner.weight.ds_tensor.max().item() == PARTITION_BOUND
