"""Fit a calibration from measured points and apply it to an Estimate (pure: no files, no printing).

The model. The shipped estimator already meets the accuracy bar (tests/test_accuracy.py); a calibration only
absorbs drift when torch, DeepSpeed or transformers change what they allocate. One multiplicative factor per
peak phase class (the predicted peak phase without its step and micro-step: "forward", "backward", "step"),
fitted by least squares on the relative residual of peak allocated bytes:

    minimise Σᵢ ((f·pᵢ − mᵢ) / mᵢ)²   ⇒   f = Σᵢ rᵢ / Σᵢ rᵢ²,   rᵢ = pᵢ / mᵢ

(p: predicted, m: measured peak allocated bytes of point i). Relative residuals, because the bar is relative
and the measured peaks span 1 to 100+ GiB: an unweighted fit would follow the largest jobs only. No additive
offset: a constant in bytes fitted on such a spread would be wrong for every size but the typical one.
A class with fewer than MIN_CLASS_POINTS points uses the factor fitted on all points. Factors are clamped to
[FACTOR_MIN, FACTOR_MAX]: a drift beyond that is a modelling error to fix in the estimator, not to calibrate.

Applying: one factor (the class of the estimate's peak phase) scales peak allocated, peak reserved, every part
of the breakdown and every phase of the timeline, so the parts still sum to the total and the peak phase stays
the peak. Host RAM, NVMe and the memory torch does not see are left as they are.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..result import Estimate, Part, Phase

SCHEMA_VERSION = 1
#: the range a factor may take (clamped when fitting, refused when loading)
FACTOR_MIN, FACTOR_MAX = 0.8, 1.25
#: measured rows needed to fit at all, and points a peak phase class needs for a factor of its own
MIN_ROWS = 3
MIN_CLASS_POINTS = 3


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Point(_Frozen):
    """One measured peak against its estimate (a row, or one depth of a reduced-depth row)."""

    name: str
    row: str = Field(description="the verify row the point comes from")
    measured_bytes: int = Field(gt=0)
    predicted_bytes: int = Field(gt=0)
    predicted_phase: str


class Environment(_Frozen):
    """Where rows were measured (a verify row's env)."""

    torch: str | None = None
    deepspeed: str | None = None
    transformers: str | None = None
    gpu: str | None = None

    def label(self) -> str:
        fields = (("torch", self.torch), ("deepspeed", self.deepspeed), ("transformers", self.transformers))
        words = [f"{k} {v}" for k, v in fields if v] + ([self.gpu] if self.gpu else [])
        return " · ".join(words) or "unknown"


class ClassFactor(_Frozen):
    """The factor for estimates whose peak falls in ``phase_class``."""

    phase_class: str
    factor: float = Field(ge=FACTOR_MIN, le=FACTOR_MAX)
    points: int = Field(ge=0, description="points the factor was fitted on")
    clamped: bool = Field(description="the least-squares factor fell outside the bounds")


class Calibration(_Frozen):
    """The calibration file `memplan calibrate` writes and `memplan estimate --calibration FILE` reads."""

    schema_version: Literal[1]
    created_at: str
    memplan_version: str
    environments: tuple[Environment, ...]
    rows: tuple[str, ...] = Field(min_length=MIN_ROWS, description="names of the verify rows fitted on")
    default: ClassFactor = Field(description="fitted on all points; used for classes without a factor")
    factors: tuple[ClassFactor, ...]
    points: tuple[Point, ...] = Field(min_length=MIN_ROWS)

    @model_validator(mode="after")
    def _one_factor_per_class(self):
        classes = [f.phase_class for f in self.factors]
        if len(set(classes)) != len(classes):
            raise ValueError(f"factors: phase classes {classes} repeat; allowed: one factor per phase class")
        return self

    def factor_for(self, phase: str) -> ClassFactor:
        """The factor for an estimate whose peak phase is ``phase``."""
        cls = phase_class(phase)
        return next((f for f in self.factors if f.phase_class == cls), self.default)


_STEP_MICRO = re.compile(r"^(?:step\d+\.)?(?:micro\d+\.)?")


def phase_class(phase: str) -> str:
    """The phase without its step and micro-step (the ledger's marks, `estimator/loop.py`) or layer detail:
    'step2.micro0.backward' → 'backward'; 'step0.micro0.step' → 'step'; 'backward, layer 0' → 'backward'."""
    return _STEP_MICRO.sub("", phase.split(",")[0].strip(), count=1)


def _least_squares_factor(points: list[Point], cls: str) -> ClassFactor:
    ratios = [p.predicted_bytes / p.measured_bytes for p in points]
    raw = sum(ratios) / sum(r * r for r in ratios)
    factor = min(max(raw, FACTOR_MIN), FACTOR_MAX)
    return ClassFactor(phase_class=cls, factor=factor, points=len(points), clamped=factor != raw)


def fit(points: list[Point], environments: list[Environment], *, created_at: str, memplan_version: str) -> Calibration:
    """The calibration of ``points`` (InputError-free: the caller checks there are at least MIN_ROWS rows)."""
    by_class: dict[str, list[Point]] = {}
    for p in points:
        by_class.setdefault(phase_class(p.predicted_phase), []).append(p)
    factors = tuple(_least_squares_factor(ps, cls) for cls, ps in sorted(by_class.items())
                    if len(ps) >= MIN_CLASS_POINTS)
    return Calibration(
        schema_version=SCHEMA_VERSION, created_at=created_at, memplan_version=memplan_version,
        environments=tuple(dict.fromkeys(environments)), rows=tuple(dict.fromkeys(p.row for p in points)),
        default=_least_squares_factor(points, "all"), factors=factors, points=tuple(points),
    )


def calibrated_bytes(cal: Calibration, point: Point) -> int:
    """The point's prediction after calibration."""
    return round(cal.factor_for(point.predicted_phase).factor * point.predicted_bytes)


def scale_parts(parts: tuple[Part, ...], factor: float) -> tuple[Part, ...]:
    """Every part times ``factor`` in whole bytes, rounded so that they sum to round(factor · total)
    (largest remainder: the parts with the largest dropped fractions get the leftover bytes)."""
    exact = [p.bytes * factor for p in parts]
    floors = [int(x) for x in exact]
    leftover = round(sum(p.bytes for p in parts) * factor) - sum(floors)
    order = sorted(range(len(parts)), key=lambda i: exact[i] - floors[i], reverse=True)
    for i in order[:leftover]:
        floors[i] += 1
    return tuple(p.model_copy(update={"bytes": b}) for p, b in zip(parts, floors))


def apply(est: Estimate, cal: Calibration, source: str) -> Estimate:
    """``est`` scaled by the factor of its peak phase class, with a note naming ``source`` (the file)."""
    cf = cal.factor_for(est.peak_phase)
    timeline = tuple(Phase(name=ph.name, parts=scale_parts(ph.parts, cf.factor)) for ph in est.timeline)
    envs = "; ".join(e.label() for e in cal.environments) or "unknown"
    which = (f"the {cf.phase_class} factor, {cf.points} points" if cf.phase_class != "all"
             else f"the all-points factor, {cf.points} points")
    note = f"calibrated with {source} ({len(cal.rows)} rows, env {envs}): peak × {cf.factor:.4f} ({which})"
    return est.model_copy(update={
        "components": scale_parts(est.components, cf.factor), "timeline": timeline,
        "peak_reserved_bytes": round(est.peak_reserved_bytes * cf.factor), "notes": (*est.notes, note),
    })
