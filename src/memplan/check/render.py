"""Drawing `memplan check`'s findings and verdict with rich."""

from __future__ import annotations

_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def render_check(result, console=None) -> None:
    """Findings grouped by severity, then the memory verdict, the node budgets and where the job's values came
    from (``result``: memplan.check.command.CheckResult)."""
    from rich.console import Console
    from rich.markup import escape

    console = console or Console()
    findings = result.findings
    for severity in ("error", "warning", "info"):
        group = [f for f in findings if f.severity == severity]
        if not group:
            continue
        console.print(f"[{_STYLE[severity]}]{severity.upper()}S ({len(group)})[/]")
        for f in group:
            console.print(f"  [{_STYLE[severity]}]{escape(f.subject)}[/]: {escape(f.message)}")
            if f.fix:
                console.print(f"    fix: {escape(f.fix)}")
    est = result.estimate
    if est is None:
        return
    from ..budget import node_checks, node_lines
    from ..render import render_estimate
    from ..sources import source_lines

    console.print(f"\n[bold]memory verdict ({escape(result.estimate_of)})[/]")
    render_estimate(est, console)
    checks = node_checks(est.host_bytes_per_node, est.nvme_bytes_per_node, result.budget)
    for line in node_lines(checks) + source_lines(result.sources):
        console.print(line, highlight=False, markup=False)
