"""The numbers a report plots, computed from `memplan.api.estimate` (pure: no files, no matplotlib).

- `phase_stacks(est)`: bytes per component at every modelled moment of a step (for stacked bars);
- `seq_sweep(job)`: the estimate against sequence length for Ulysses sp 1/2/4/8;
- `zero_sweep(job)`: the estimate for every ZeRO stage and offload choice DeepSpeed accepts;
- `measured_of(row)`: the measured phases and timeline of a `memplan verify` report (a row of
  benchmarks/accuracy/*.jsonl), checked as hostile input.
Variants the specs refuse (sp not dividing the heads, seq beyond the positions, ...) are left out, not errors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from ..api import estimate
from ..errors import InputError, shorten
from ..result import Estimate
from ..specs import Job
from ..units import MAX_SIZE_BYTES

#: Ulysses degrees a report compares (DeepSpeed-Ulysses, Jacobs et al. 2023, splits the sequence over sp ranks)
SP_DEGREES = (1, 2, 4, 8)
#: (ZeRO stage, offload_optimizer, offload_param) choices compared: offload_optimizer needs stage >= 1 and
#: offload_param stage 3 (the ZeroSpec validators; memplan.plan.space.zero_problem applies the same rules)
ZERO_CHOICES = (
    (0, "none", "none"), (1, "none", "none"), (1, "cpu", "none"), (2, "none", "none"), (2, "cpu", "none"),
    (2, "nvme", "none"), (3, "none", "none"), (3, "cpu", "none"), (3, "nvme", "none"), (3, "cpu", "cpu"),
    (3, "nvme", "nvme"),
)


@dataclass(frozen=True)
class Point:
    """One variant of the job and what the estimator says about it."""

    label: str
    x: int
    est: Estimate


def variant(job: Job, *, layout: dict | None = None, training: dict | None = None,
            zero: dict | None = None) -> Job | None:
    """``job`` with some fields changed, validated by the specs; None when they refuse the combination."""
    data = job.model_dump()
    data["layout"].update(layout or {})
    data["training"].update(training or {})
    data["training"]["zero"].update(zero or {})
    try:
        return Job.model_validate(data)
    except (ValidationError, InputError):
        return None


def phase_stacks(est: Estimate) -> tuple[tuple[str, ...], dict[str, list[int]]]:
    """(phase names, component → bytes at each phase), components in first-seen order."""
    names = tuple(ph.name for ph in est.timeline)
    stacks: dict[str, list[int]] = {}
    for i, ph in enumerate(est.timeline):
        for part in ph.parts:
            stacks.setdefault(part.name, [0] * len(names))[i] += part.bytes
    return names, stacks


def sweep_seqs(seq_len: int, max_positions: int) -> tuple[int, ...]:
    """Sequence lengths around the job's: seq / 16 … seq · 2 by powers of two, from 128 tokens up to the
    model's max_position_embeddings (learned positions stop there; RoPE models are trained up to it)."""
    seqs = [seq_len >> k for k in range(4, -1, -1)] + [seq_len * 2]
    return tuple(s for s in seqs if 128 <= s and (s <= max_positions or s == seq_len))


def seq_sweep(job: Job) -> dict[int, list[Point]]:
    """sp → estimates over sweep_seqs (dp = world / (tp·pp·sp) follows from the layout)."""
    out: dict[int, list[Point]] = {}
    for sp in SP_DEGREES:
        points = []
        for seq in sweep_seqs(job.training.seq_len, job.model.max_position_embeddings):
            v = variant(job, layout={"sp": sp}, training={"seq_len": seq})
            if v is not None:
                points.append(Point(f"sp {sp}", seq, estimate(v)))
        if points:
            out[sp] = points
    return out


def zero_label(stage: int, offload_optimizer: str, offload_param: str) -> str:
    parts = [f"ZeRO-{stage}"]
    if offload_optimizer != "none":
        parts.append(f"opt→{offload_optimizer}")
    if offload_param != "none":
        parts.append(f"param→{offload_param}")
    return " ".join(parts)


def zero_sweep(job: Job) -> list[Point]:
    """The job under every ZeRO stage / offload choice; the optimizer becomes DeepSpeedCPUAdam under optimizer
    offload (DeepSpeed requires it, engine._configure_optimizer) and AdamW otherwise."""
    out = []
    for stage, oo, op in ZERO_CHOICES:
        optimizer = job.training.optimizer
        if oo != "none":
            optimizer = "cpu_adam"
        elif optimizer == "cpu_adam":
            optimizer = "adamw"
        v = variant(job, training={"optimizer": optimizer},
                    zero={"stage": stage, "offload_optimizer": oo, "offload_param": op})
        if v is not None:
            out.append(Point(zero_label(stage, oo, op), stage, estimate(v)))
    return out


@dataclass(frozen=True)
class Measured:
    """What a verify report measured: peak per phase kind, and the per-layer samples of its timeline."""

    name: str
    peak_allocated_bytes: int
    phase_peaks: dict[str, int]  # 'forward' / 'backward' / 'step' → the largest peak over the run
    samples: tuple[tuple[str, str, int], ...]  # (phase kind, label, allocated bytes) in measured order
    layers_note: str  # how a reduced-depth run was extrapolated ('' for a full-depth run)


def phase_kind(name: str) -> str:
    """'forward', 'backward' or 'step' for a phase name (estimator: 'forward, loss'; verify: 'step0.micro3.step')."""
    last = name.split(".")[-1].split(",")[0].strip().lower()
    return last if last in ("forward", "backward") else "step"


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SIZE_BYTES:
        raise InputError("--verify", f"{where} is not a byte count; allowed: a verify report (memplan verify JSON), "
                                     f"bytes up to {MAX_SIZE_BYTES}")
    return value


def measured_of(row: Any) -> Measured:
    """The measured figures of a verify report; InputError('--verify', ...) when it is not one."""
    if not isinstance(row, dict) or not isinstance(row.get("phases"), list):
        raise InputError("--verify", "no 'phases' list; allowed: a memplan verify report (a row of "
                                     "benchmarks/accuracy/*.jsonl)")
    if row.get("status", "ok") != "ok":
        raise InputError("--verify", f"the run's status is {shorten(row.get('status'), 40)}; allowed: status 'ok'")
    peaks: dict[str, int] = {}
    for i, ph in enumerate(row["phases"]):
        if not isinstance(ph, dict) or not isinstance(ph.get("name"), str):
            raise InputError("--verify", f"phases[{i}] has no name; allowed: a memplan verify report")
        if ph["name"] == "init":
            continue
        kind = phase_kind(ph["name"])
        peaks[kind] = max(peaks.get(kind, 0), _int(ph.get("peak_allocated_bytes"), f"phases[{i}]"))
    samples = []
    for i, t in enumerate(row.get("timeline") or []):
        if not isinstance(t, dict) or not isinstance(t.get("label"), str):
            raise InputError("--verify", f"timeline[{i}] has no label; allowed: a memplan verify report")
        samples.append((phase_kind(str(t.get("phase", t["label"]))), t["label"],
                        _int(t.get("allocated_bytes"), f"timeline[{i}]")))
    if not peaks:
        raise InputError("--verify", "no measured phase besides init; allowed: a verify report of a finished run")
    layers = row.get("layers") if isinstance(row.get("layers"), dict) else {}
    return Measured(name=str(row.get("name", "verify"))[:80], peak_allocated_bytes=max(peaks.values()),
                    phase_peaks=peaks, samples=tuple(samples), layers_note=str(layers.get("method", ""))[:300])


def job_of_row(row: dict) -> Job:
    """The verify report's Job as memplan.accuracy reads it; a malformed job names the --verify field."""
    from ..accuracy import job_of_row as accuracy_job_of_row
    from ..bounds import check_job

    if not isinstance(row.get("job"), dict):
        raise InputError("--verify job", "missing; allowed: a verify report holding its Job")
    try:
        job = accuracy_job_of_row(row)
    except ValidationError as err:
        from ..errors import from_pydantic

        raise from_pydantic(err, prefix="--verify job.") from None
    check_job(job, "--verify job.")
    return job
