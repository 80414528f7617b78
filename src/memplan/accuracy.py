"""The measured accuracy matrix: verify rows under benchmarks/accuracy/ held against the estimator.

Each row is one `memplan verify` report (JSON lines, one object a line) with the Job, the environment,
the exact command and the measured peaks. A row measured at reduced depth (``layers``) is compared at
each depth it was measured at, with the model cut to that many layers.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .specs import Job


@dataclass(frozen=True)
class Comparison:
    """One measured job against its estimate."""

    name: str
    measured_bytes: int
    predicted_bytes: int
    measured_phase: str | None
    predicted_phase: str

    @property
    def error(self) -> float:
        """Signed relative error of the prediction: (predicted − measured) / measured."""
        return (self.predicted_bytes - self.measured_bytes) / self.measured_bytes


def iter_rows(folder: Path) -> Iterator[dict]:
    """Every row of every rows*.jsonl file under ``folder``, in file order."""
    from .inputs import read_json_lines

    for path in sorted(folder.glob("rows*.jsonl")):
        for _, row in read_json_lines(path, "rows"):
            yield row


def job_of_row(row: dict) -> Job:
    """The row's Job, with a preset model resolved again from its preset (the config that really ran), so
    that fields the ModelSpec gained since the row was measured are filled from the same config.json."""
    from .errors import InputError
    from .presets import load_model

    raw = row.get("job") or {}
    training = raw.get("training", {}) if isinstance(raw, dict) else None
    if isinstance(training, dict) and "loop" not in training:
        # rows measured before verify ran other loops: its worker kept only the loss (``loss = engine(...).loss``)
        raw = {**raw, "training": {**training, "loop": "loss"}}
    job = Job.model_validate(raw)
    try:
        model = load_model(job.model.name)
    except InputError:
        return job
    return job.model_copy(update={"model": model.model_copy(update={"num_layers": job.model.num_layers})})


def _measured_points(row: dict) -> Iterator[tuple[str, Job, int, str | None]]:
    job = job_of_row(row)
    layers = row.get("layers")
    if layers and layers.get("measured"):
        for m in layers["measured"]:
            cut = job.model.model_copy(update={"num_layers": m["num_layers"]})
            yield (f"{row['name']}@{m['num_layers']}L", job.model_copy(update={"model": cut}),
                   m["peak_allocated_bytes"], m.get("peak_phase"))
    else:
        yield row["name"], job, row["peak_allocated_bytes"], row.get("peak_phase")


def compare_rows(rows) -> list[Comparison]:
    """Estimate every successfully measured point of ``rows``."""
    from .estimator import quick_peak

    out = []
    for row in rows:
        if row.get("status") != "ok":
            continue
        for name, job, measured, phase in _measured_points(row):
            never_stepped = row.get("skipped_steps", 0) >= row.get("steps", 3)
            q = quick_peak(job, rank0=row.get("mode", "emulated") == "emulated", stepped=not never_stepped)
            out.append(Comparison(name, measured, q.peak_allocated_bytes, phase, q.peak_phase))
    return out


def summary(comparisons: list[Comparison]) -> tuple[float, float]:
    """(median |error|, worst |error|)."""
    errs = [abs(c.error) for c in comparisons]
    return statistics.median(errs), max(errs)
