"""The per-GPU memory estimator: phases of a step → the peak and its breakdown (pure, no torch)."""

from __future__ import annotations

from typing import NamedTuple

from ..result import Estimate, Part, Phase
from ..specs import Job
from .layout import rank_share
from .overheads import non_torch_bytes, reserved_bytes
from .phases import build_phases, model_states


class QuickPeak(NamedTuple):
    """The headline numbers without the typed breakdown (for `plan`'s hot loop)."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_total_bytes: int
    host_bytes_per_node: int
    nvme_bytes_per_node: int
    peak_phase: str


def _ranks_per_node(job: Job) -> int:
    return min(job.layout.world, job.layout.gpus_per_node)


def quick_peak(job: Job, rank0: bool = False, stepped: bool = True) -> QuickPeak:
    """Peak allocated, reserved, device total, host and NVMe per node, and the peak phase.

    ``rank0``: rank 0's figures instead of the most loaded rank's (what an emulated verify measures);
    ``stepped=False``: before the first successful optimizer step (see build_phases)."""
    phases = build_phases(job, rank0, stepped)
    name, parts = max(phases, key=lambda ph: sum(p[1] for p in ph[1]))
    peak = sum(p[1] for p in parts)
    st = model_states(job, rank_share(job))
    reserved = reserved_bytes(job, peak, parts)
    other = non_torch_bytes(job)
    rpn = _ranks_per_node(job)
    return QuickPeak(peak, reserved, reserved + other, st.host_bytes * rpn, st.nvme_bytes * rpn, name)


def estimate_job(job: Job) -> Estimate:
    """The full typed estimate: the breakdown at the peak and the timeline of phases."""
    phases = build_phases(job)
    timeline = tuple(
        Phase(name=name, parts=tuple(Part(name=p[0], bytes=p[1], detail=p[2]) for p in parts if p[1]))
        for name, parts in phases
    )
    peak_phase = max(timeline, key=lambda ph: ph.allocated_bytes)
    merged: dict[str, int] = {}
    details: dict[str, str] = {}
    for p in peak_phase.parts:
        merged[p.name] = merged.get(p.name, 0) + p.bytes
        details.setdefault(p.name, p.detail)
    components = tuple(Part(name=k, bytes=v, detail=details[k]) for k, v in merged.items())
    q = quick_peak(job)
    return Estimate(
        job=job, peak_phase=peak_phase.name, components=components, timeline=timeline,
        peak_reserved_bytes=q.peak_reserved_bytes, non_torch_bytes=q.device_total_bytes - q.peak_reserved_bytes,
        host_bytes_per_node=q.host_bytes_per_node, nvme_bytes_per_node=q.nvme_bytes_per_node,
    )
