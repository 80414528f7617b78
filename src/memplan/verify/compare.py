"""memplan's prediction for the measured Job, and predicted vs measured wherever both exist.

error % = (predicted − measured) / measured · 100: positive means memplan over-predicts.
Phase kinds: a measured phase "step{s}.micro{m}.forward" is of kind "forward" (likewise backward, step); an
estimate timeline phase is of the kind its name starts with ("forward…", "backward…", "optimizer…"/"step…").
"""

from __future__ import annotations

from typing import Any

from ..specs import Job

#: estimate timeline phase name prefix → measured phase kind
_KIND_OF_PREFIX = (("forward", "forward"), ("backward", "backward"), ("optimizer", "step"), ("step", "step"))


def error_pct(predicted: int | None, measured: int | None) -> float | None:
    """(predicted − measured)/measured in percent; None when either is missing or measured is 0."""
    if predicted is None or not measured:
        return None
    return round(100.0 * (predicted - measured) / measured, 3)


def predict(job: Job, emulated: bool = False) -> tuple[dict[str, Any] | None, str | None]:
    """(memplan's estimate as a compact dict, why it is missing); ``emulated``: of rank 0 emulated on one GPU,
    as the row measured it. Never raises."""
    try:
        from ..api import estimate

        est = estimate(job, emulated=emulated)
    except (ImportError, NotImplementedError) as exc:
        return None, f"estimator unavailable: {type(exc).__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - an estimator failure must not lose a measurement
        return None, f"estimate failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return {
        "peak_allocated_bytes": est.peak_allocated_bytes,
        "peak_reserved_bytes": est.peak_reserved_bytes,
        "device_total_bytes": est.device_total_bytes,
        "non_torch_bytes": est.non_torch_bytes,
        "peak_phase": est.peak_phase,
        "components": {p.name: p.bytes for p in est.components},
        "timeline": [{"name": ph.name, "allocated_bytes": ph.allocated_bytes} for ph in est.timeline],
        "notes": list(est.notes),
    }, None


def _phase_kind(name: str) -> str | None:
    low = name.lower()
    for prefix, kind in _KIND_OF_PREFIX:
        if low.startswith(prefix):
            return kind
    return None


def _measured_kind_peaks(phases: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in phases or []:
        kind = p["name"].rsplit(".", 1)[-1]
        if p["name"] != "init" and p.get("peak_allocated_bytes") is not None:
            out[kind] = max(out.get(kind, 0), p["peak_allocated_bytes"])
    return out


def comparison(predicted: dict[str, Any], row: dict[str, Any]) -> list[dict[str, Any]]:
    """Rows of {what, predicted_bytes, measured_bytes, error_pct} for every measured counterpart."""
    pairs = [
        ("peak allocated", predicted["peak_allocated_bytes"], row.get("peak_allocated_bytes")),
        ("peak reserved", predicted["peak_reserved_bytes"], row.get("peak_reserved_bytes")),
    ]
    predicted_kinds: dict[str, int] = {}
    for ph in predicted["timeline"]:
        kind = _phase_kind(ph["name"])
        if kind:
            predicted_kinds[kind] = max(predicted_kinds.get(kind, 0), ph["allocated_bytes"])
    measured_kinds = _measured_kind_peaks(row.get("phases") or [])
    for kind in ("forward", "backward", "step"):
        if kind in predicted_kinds and kind in measured_kinds:
            pairs.append((f"{kind} phase peak", predicted_kinds[kind], measured_kinds[kind]))
    return [{"what": what, "predicted_bytes": p, "measured_bytes": m, "error_pct": error_pct(p, m)}
            for what, p, m in pairs if m is not None]


def predicted_and_comparison(job: Job, row: dict[str, Any]) -> dict[str, Any]:
    """The row's "predicted", "predicted_error" and "comparison" fields."""
    predicted, why = predict(job, row.get("mode", "emulated") == "emulated")
    return {
        "predicted": predicted,
        "predicted_error": why,
        "comparison": comparison(predicted, row) if predicted else [],
    }
