"""How a plan is shown: the `--json` object and the rich table. Thin: no search, no estimation here."""

from __future__ import annotations

from typing import Any

from ..units import GB, fmt_gib
from .search import Candidate, PlanResult
from .space import PlanSpace


def candidate_dict(c: Candidate) -> dict[str, Any]:
    """One row for --json (bytes as integers, seconds as floats)."""
    return {
        "zero": c.zero, "tp": c.tp, "pp": c.pp, "sp": c.sp, "dp": c.dp,
        "offload_optimizer": c.offload_optimizer, "offload_param": c.offload_param,
        "checkpointing": c.checkpointing, "attention": c.attention,
        "same_as_attention": list(c.same_as_attention),
        "micro_batch": c.micro_batch, "grad_accum": c.grad_accum,
        "peak_allocated_bytes": c.peak_allocated_bytes, "peak_reserved_bytes": c.peak_reserved_bytes,
        "device_total_bytes": c.device_total_bytes, "host_bytes_per_node": c.host_bytes_per_node,
        "nvme_bytes_per_node": c.nvme_bytes_per_node, "peak_phase": c.peak_phase,
        "step_time_s": c.step_time_s, "tokens_per_s": c.tokens_per_s, "binding": c.binding,
        "fits": c.fits, "misses": list(c.misses), "confirmed": c.confirmed,
        "step_terms_s": {t.name: t.seconds for t in c.step.terms},
    }


def assumptions(space: PlanSpace, notes: list[str], space_notes: tuple[str, ...] = ()) -> dict[str, Any]:
    """Everything the ranking rests on, for the output and --json."""
    return {
        "performance": space.perf.model_dump(),
        "hardware": space.hardware.model_dump(),
        "target_bytes": space.target_bytes,
        "host_ram_bytes_per_node": space.host_ram_bytes_per_node,
        "nvme_bytes_per_node": space.nvme_bytes_per_node,
        "global_batch": space.global_batch,
        "tokens_per_step": space.global_batch * space.seq_len,
        "dtype": space.dtype,
        "model": space.model.name,
        "seq_len": space.seq_len,
        "world": space.world,
        "gpus_per_node": space.gpus_per_node,
        "notes": [*notes, *space_notes],
        "docs": "docs/performance-model.md",
    }


def plan_dict(result: PlanResult, top: int, notes: list[str], user: dict | None = None) -> dict[str, Any]:
    """The --json object: candidates (top N), closest misses, assumptions, counts, the user's config."""
    out = {
        "candidates": [candidate_dict(c) for c in result.shown(top)],
        "closest": [] if result.shown(top) else [candidate_dict(c) for c in result.closest[:top]],
        "assumptions": assumptions(result.space, notes, result.notes),
        "searched": result.searched,
        "evaluated": result.evaluated,
        "feasible": result.feasible,
        "invalid": dict(result.invalid),
    }
    if user is not None:
        out["user_config"] = user
    return out


def _size(n: int) -> str:
    return "-" if n == 0 else (f"{n / 10**12:.2f} TB" if n >= 10**12 else f"{n / GB:.0f} GB")


def _row(i: int, c: Candidate) -> list[str]:
    off = "/".join(x if x != "none" else "-" for x in (c.offload_optimizer, c.offload_param))
    return [
        str(i), str(c.zero), off, f"{c.tp}/{c.pp}/{c.sp}/{c.dp}", c.checkpointing,
        " = ".join((c.attention, *c.same_as_attention)),
        f"{c.micro_batch}×{c.grad_accum}", fmt_gib(c.peak_allocated_bytes, 1), fmt_gib(c.device_total_bytes, 1),
        _size(c.host_bytes_per_node), _size(c.nvme_bytes_per_node), f"{c.step_time_s:,.1f}",
        f"{c.tokens_per_s:,.0f}", c.binding if c.fits else "over " + ", ".join(c.misses),
    ]


def _table(title: str, rows: list[Candidate]):
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    heads = ["#", "ZeRO", "offload opt/param", "tp/pp/sp/dp", "ckpt", "attention", "micro×accum", "peak alloc",
             "device total", "host RAM/node", "NVMe/node", "step s", "tokens/s", "binding"]
    for h in heads:
        table.add_column(h, justify="right" if h in ("#", "step s", "tokens/s") else "left", overflow="fold")
    for i, c in enumerate(rows, 1):
        table.add_row(*_row(i, c))
    return table


def _assumption_lines(space: PlanSpace, notes: list[str]) -> list[str]:
    hw, a = space.hardware, space.perf
    return [
        (f"model {space.model.name}, seq {space.seq_len}, global batch {space.global_batch} sequences "
        f"({space.global_batch * space.seq_len:,} tokens/step), {space.world} GPUs ({space.gpus_per_node}/node), "
        f"{space.dtype}"),
        (f"budgets: device total ≤ {fmt_gib(space.target_bytes)} per GPU; host RAM {_size(space.host_ram_bytes_per_node)}"
        f" and NVMe {_size(space.nvme_bytes_per_node)} per node"),
        (f"speed: {hw.name} {hw.dense_flops / 1e12:.0f} TFLOP/s dense at {a.compute_efficiency:.0%}; NVLink "
        f"{hw.nvlink_bytes_per_s / GB:.0f} GB/s, InfiniBand {hw.inter_node_bytes_per_s / GB:.0f} GB/s per GPU at "
        f"{a.comm_efficiency:.0%}; PCIe {hw.pcie_bytes_per_s / GB:.0f} GB/s at {a.pcie_efficiency:.0%}; NVMe "
        f"{hw.nvme_bytes_per_s_per_node / GB:.0f} GB/s/node; CPU Adam {hw.cpu_adam_params_per_s_per_node:.0e} "
        "params/s/node (docs/performance-model.md)"),
        *notes,
    ]


def render(result: PlanResult, top: int, notes: list[str], console, user_lines: list[str] | None = None) -> None:
    """Print the plan: the fitting rows (or the closest misses, said plainly), assumptions, counts."""
    space = result.space
    if result.shown(top):
        console.print(_table(f"{result.feasible} of {result.searched} configurations pass the memory screen; the "
                             f"fastest {len(result.shown(top))} of {len(result.candidates)} distinct rows, "
                             "confirmed by the estimator", result.shown(top)))
    else:
        console.print(f"[bold red]No configuration fits[/] {fmt_gib(space.target_bytes)} per GPU with host RAM "
                      f"{_size(space.host_ram_bytes_per_node)} and NVMe {_size(space.nvme_bytes_per_node)} per node "
                      f"({result.searched} configurations searched). The closest:")
        console.print(_table("closest misses (by how far over budget)", list(result.closest[:top])))
    for line in user_lines or []:
        console.print(line)
    console.print(f"searched {result.searched}, evaluated {result.evaluated}, feasible {result.feasible}; "
                  "dropped as invalid: " + (", ".join(f"{k} ({v})" for k, v in result.invalid.items()) or "none"))
    for line in _assumption_lines(space, [*notes, *result.notes]):
        console.print(f"[dim]assumption: {line}[/]")
