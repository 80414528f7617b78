"""A simulator of PyTorch's CUDA caching allocator, replaying a memplan Ledger to predict reserved memory.

``simulate(ledger, AllocatorConfig(...))`` replays the ledger's allocation and free events through a model of
``c10/cuda/CUDACachingAllocator.cpp`` (torch 2.11; docs/allocator.md says what was read and what is not modelled)
and returns a SimResult: peak and per-phase reserved and allocated bytes, fragmentation at the reserved peak,
cudaMalloc retries and, with a card size, the allocation that would run out of memory.

Submodules imported on demand: ``memplan.allocator.trace`` (torch memory snapshots to compact traces and
Ledgers), ``memplan.allocator.chrome`` (Chrome trace-event JSON for Perfetto). Pure Python; no torch.
"""

from __future__ import annotations

from .config import AllocatorConfig, parse_alloc_conf
from .result import OomInfo, PhasePeak, SimResult
from .sim import allocation_size, ledger_from_events, replay_series, round_size, simulate, simulate_events

__all__ = [
    "AllocatorConfig",
    "OomInfo",
    "PhasePeak",
    "SimResult",
    "allocation_size",
    "ledger_from_events",
    "parse_alloc_conf",
    "replay_series",
    "round_size",
    "simulate",
    "simulate_events",
]
