"""Drawing `memplan check`'s findings and verdict with rich."""

from __future__ import annotations

from .findings import Finding

_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def render_check(findings: list[Finding], est, label: str, console=None) -> None:
    """Findings grouped by severity, then the memory verdict."""
    from rich.console import Console
    from rich.markup import escape

    console = console or Console()
    for severity in ("error", "warning", "info"):
        group = [f for f in findings if f.severity == severity]
        if not group:
            continue
        console.print(f"[{_STYLE[severity]}]{severity.upper()}S ({len(group)})[/]")
        for f in group:
            console.print(f"  [{_STYLE[severity]}]{escape(f.subject)}[/]: {escape(f.message)}")
            if f.fix:
                console.print(f"    fix: {escape(f.fix)}")
    if est is None:
        return
    from ..render import render_estimate

    console.print(f"\n[bold]memory verdict ({escape(label)})[/]")
    render_estimate(est, console)
