"""A finding: what `memplan check` reports about one key or flag."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Severity = Literal["error", "warning", "info"]
SEVERITY_ORDER: dict[str, int] = {"error": 0, "warning": 1, "info": 2}


class Finding(BaseModel):
    """error: DeepSpeed or Megatron-DeepSpeed refuses it at launch. warning: silently ignored or not what
    it looks like. info: worth knowing."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    severity: Severity
    subject: str = Field(description="the config key path (zero_optimization.stage) or flag (--batch-size)")
    message: str = Field(description="what is wrong and why, citing the code that decides it")
    fix: str = ""


def error(subject: str, message: str, fix: str = "") -> Finding:
    return Finding(severity="error", subject=subject, message=message, fix=fix)


def warning(subject: str, message: str, fix: str = "") -> Finding:
    return Finding(severity="warning", subject=subject, message=message, fix=fix)


def info(subject: str, message: str, fix: str = "") -> Finding:
    return Finding(severity="info", subject=subject, message=message, fix=fix)


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Errors first, then warnings, then info; the order of discovery within a severity."""
    return sorted(findings, key=lambda f: SEVERITY_ORDER[f.severity])
