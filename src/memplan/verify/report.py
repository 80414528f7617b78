"""Writing and rendering a verify row: JSON + Markdown files (atomic), a rich table, a one-line summary."""

from __future__ import annotations

import json
import os
from typing import Any

from ..units import GiB


def _gib(n: int | None) -> str:
    return "—" if n is None else f"{n / GiB:.3f}"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:+.2f}%"


def summary_line(row: dict[str, Any]) -> str:
    """name, status, measured peak GiB, predicted GiB, error % (the batch runner prints one per job)."""
    pred = (row.get("predicted") or {}).get("peak_allocated_bytes")
    cmp = next((c for c in row.get("comparison") or [] if c["what"] == "peak allocated"), None)
    text = (f"{row['name']}: {row['status']}  measured {_gib(row.get('peak_allocated_bytes'))} GiB  "
            f"predicted {_gib(pred)} GiB  error {_pct(cmp['error_pct'] if cmp else None)}  "
            f"({row.get('wall_s', 0):.0f} s)")
    if row.get("error"):
        text += f"  [{row['error']}]"
    return text


def _table_rows(row: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    out = [(c["what"], _gib(c["predicted_bytes"]), _gib(c["measured_bytes"]), _pct(c["error_pct"]))
           for c in row.get("comparison") or []]
    if not out:
        out = [("peak allocated", "—", _gib(row.get("peak_allocated_bytes")), "—"),
               ("peak reserved", "—", _gib(row.get("peak_reserved_bytes")), "—")]
    out.append(("init peak allocated", "—", _gib(row.get("init_peak_allocated_bytes")), "—"))
    return out


def _header_lines(row: dict[str, Any]) -> list[str]:
    env = row.get("env") or {}
    lines = [f"status: {row.get('status')}" + (f" — {row['error']}" if row.get("error") else ""),
             (f"mode: {row.get('mode')} ({((row.get('job') or {}).get('layout') or {}).get('world')} ranks), device {row.get('device')}, "
             f"steps {row.get('steps')}, peak phase {row.get('peak_phase')}"),
             (f"env: {env.get('gpu')} driver {env.get('driver')} cuda {env.get('cuda')}, torch {env.get('torch')}, "
             f"deepspeed {env.get('deepspeed')}, transformers {env.get('transformers')}, "
             f"python {env.get('python')}, host {env.get('hostname')}"),
             f"command: {' '.join(row.get('command') or [])}"]
    if row.get("layers"):
        lay = row["layers"]
        measured = ", ".join(f"{m['num_layers']} layers: {_gib(m['peak_allocated_bytes'])} GiB"
                             for m in lay["measured"])
        lines.append(f"reduced depth: {measured}; extrapolated to {lay['full_layers']} layers ({lay['method']})")
    if row.get("meta_params") is not None:
        lines.append(f"parameters: meta device {row['meta_params']:,}, memplan {row.get('analytic_params')}")
    if row.get("predicted_error"):
        lines.append(f"predicted: {row['predicted_error']}")
    return lines


def to_markdown(row: dict[str, Any]) -> str:
    """The row as a Markdown report: header facts, predicted vs measured, per-phase peaks."""
    lines = [f"# memplan verify: {row['name']}", ""] + [f"- {line}" for line in _header_lines(row)]
    lines += ["", "| what | predicted GiB | measured GiB | error |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in _table_rows(row)]
    lines += ["", "| phase | peak allocated GiB | peak reserved GiB | allocated at end GiB |",
              "| --- | ---: | ---: | ---: |"]
    lines += [f"| {p['name']} | {_gib(p.get('peak_allocated_bytes'))} | {_gib(p.get('peak_reserved_bytes'))} | "
              f"{_gib(p.get('allocated_end_bytes'))} |" for p in row.get("phases") or []]
    if row.get("per_rank"):
        lines += ["", "| rank | status | peak allocated GiB | peak reserved GiB |", "| ---: | --- | ---: | ---: |"]
        lines += [f"| {r['rank']} | {r['status']} | {_gib(r['peak_allocated_bytes'])} | "
                  f"{_gib(r['peak_reserved_bytes'])} |" for r in row["per_rank"]]
    return "\n".join(lines) + "\n"


def write_report(row: dict[str, Any], out_dir: str) -> tuple[str, str]:
    """Write <out_dir>/<name>.json and .md, both or neither (memplan.outputs.write_files); return both paths."""
    from ..outputs import check_name, write_files

    base = os.path.join(out_dir, check_name(row["name"], "--name"))
    write_files({base + ".json": json.dumps(row, indent=1, sort_keys=False, default=str) + "\n",
                 base + ".md": to_markdown(row)}, "--out")
    return base + ".json", base + ".md"


def render(row: dict[str, Any], console=None) -> None:
    """Print the rich table of predicted vs measured with % error, and the header facts."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"memplan verify: {row['name']}")
    for col, justify in (("what", "left"), ("predicted GiB", "right"), ("measured GiB", "right"),
                         ("error", "right")):
        table.add_column(col, justify=justify)
    for r in _table_rows(row):
        table.add_row(*r)
    console.print(table)
    for line in _header_lines(row):
        console.print(line, markup=False, highlight=False)


def dumps(row: dict[str, Any]) -> str:
    """The row as one JSON line (for rows.jsonl)."""
    return json.dumps(row, default=str)
