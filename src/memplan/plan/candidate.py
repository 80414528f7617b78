"""A plan's rows: one evaluated configuration (Candidate) with its memory, needs per node and step time, and the
search's result (PlanResult); how a job and the estimator's figure become a row (make_candidate, with_time)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ..specs import Job
from .perf import ModelCosts, StepTime, model_costs, step_time, tokens_per_step
from .space import PlanSpace


class Candidate(NamedTuple):
    """One evaluated configuration: its layout and settings, memory, needs per node and speed."""

    zero: int
    tp: int
    pp: int
    sp: int
    dp: int
    offload_optimizer: str
    offload_param: str
    checkpointing: str
    attention: str
    micro_batch: int
    grad_accum: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_total_bytes: int
    host_bytes_per_node: int
    nvme_bytes_per_node: int
    peak_phase: str
    misses: tuple[str, ...]  # why it does not fit: "target", "host RAM", "NVMe"; empty when it fits
    job: Job  # what was estimated (built without validation; emit.candidate_job validates)
    step: StepTime | None = None  # None until timed: the search times the feasible ones and the kept misses
    step_time_s: float = float("nan")
    tokens_per_s: float = float("nan")
    binding: str = ""  # memory / compute / comm / offload / bubble
    same_as_attention: tuple[str, ...] = ()  # other attention implementations with identical memory and time
    confirmed: bool = True  # its figures are the estimator's (False: screened only, memplan.plan.confirm)

    @property
    def fits(self) -> bool:
        return not self.misses


@dataclass(frozen=True)
class PlanResult:
    """Feasible candidates by step time, the closest misses by device total, and the counts."""

    space: PlanSpace
    candidates: tuple[Candidate, ...]
    closest: tuple[Candidate, ...]
    searched: int  # valid configurations covered (evaluated + skipped by pruning)
    evaluated: int  # configurations the estimator and the perf model ran on
    feasible: int = 0  # evaluated configurations that fit (rows merged by attention count separately)
    invalid: dict[str, int] = field(default_factory=dict)  # dropped combinations by rule
    notes: tuple[str, ...] = ()  # what the search changed about the space, and why
    confirmed: int = 0  # jobs the estimator (the ledger) ran on to confirm the shown rows (memplan.plan.confirm)

    def shown(self, top: int) -> list[Candidate]:
        """The rows to show: of the fastest ``top``, those whose figures are the estimator's (all of them unless
        the confirmation stopped at its limit)."""
        return [c for c in self.candidates[:top] if c.confirmed]


def make_candidate(space: PlanSpace, job: Job, peak, costs: ModelCosts | None = None,
                   timed: bool = True) -> Candidate:
    """A Candidate for ``job`` from the estimator's ``peak``; with ``timed``, its step time too."""
    t, lay, z = job.training, job.layout, job.training.zero
    misses = tuple(name for name, over in (
        ("target", peak.device_total_bytes > space.target_bytes),
        ("host RAM", peak.host_bytes_per_node > space.host_ram_bytes_per_node),
        ("NVMe", peak.nvme_bytes_per_node > space.nvme_bytes_per_node),
    ) if over)
    cand = Candidate(
        zero=z.stage, tp=lay.tp, pp=lay.pp, sp=lay.sp, dp=lay.dp, offload_optimizer=z.offload_optimizer,
        offload_param=z.offload_param, checkpointing=t.checkpointing, attention=t.attention,
        micro_batch=t.micro_batch, grad_accum=t.grad_accum,
        peak_allocated_bytes=int(peak.peak_allocated_bytes), peak_reserved_bytes=int(peak.peak_reserved_bytes),
        device_total_bytes=int(peak.device_total_bytes), host_bytes_per_node=int(peak.host_bytes_per_node),
        nvme_bytes_per_node=int(peak.nvme_bytes_per_node), peak_phase=str(peak.peak_phase), misses=misses, job=job,
    )
    return with_time(space, cand, costs) if timed else cand


def with_time(space: PlanSpace, c: Candidate, costs: ModelCosts | None = None) -> Candidate:
    """The candidate with its step time, tokens/s and binding constraint (perf.step_time)."""
    costs = costs or model_costs(space.model, space.seq_len)
    step = step_time(c.job, costs, space.hardware, space.perf)
    seconds = step.seconds
    headroom = space.target_bytes - c.device_total_bytes
    tight = 0 <= headroom < space.perf.tight_headroom_fraction * space.target_bytes
    return c._replace(step=step, step_time_s=seconds, tokens_per_s=tokens_per_step(c.job) / seconds,
                      binding="memory" if tight else step.dominant())
