"""How a plan is shown: the `--json` object and the rich table. Thin: no search, no estimation here."""

from __future__ import annotations

from typing import Any

from ..units import GB, fmt_gib
from .candidate import Candidate, PlanResult
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


def plan_dict(result: PlanResult, top: int, notes: list[str], user: dict | None = None,
              sources: tuple = ()) -> dict[str, Any]:
    """The --json object: candidates (top N), closest misses, assumptions, counts, the user's config, and where
    each fixed fact of the plan came from ("sources")."""
    from ..sources import sources_json

    out = {
        "candidates": [candidate_dict(c) for c in result.shown(top)],
        "closest": [] if result.shown(top) else [candidate_dict(c) for c in result.closest[:top]],
        "assumptions": assumptions(result.space, notes, result.notes),
        "searched": result.searched,
        "evaluated": result.evaluated,
        "feasible": result.feasible,
        "invalid": dict(result.invalid),
    }
    out["sources"] = sources_json(sources)
    if user is not None:
        out["user_config"] = user
    return out


def _gib(n: int) -> str:
    """Per-node needs in GiB (memplan's unit for what a job needs), "-" for none."""
    return "-" if n == 0 else f"{n / 2**30:,.0f}"


def _row(i: int, c: Candidate) -> list[str]:
    off = "/".join(x if x != "none" else "-" for x in (c.offload_optimizer, c.offload_param))
    return [
        str(i), str(c.zero), off, f"{c.tp}/{c.pp}/{c.sp}/{c.dp}", c.checkpointing,
        "=".join((c.attention, *c.same_as_attention)), f"{c.micro_batch}×{c.grad_accum}",
        f"{c.device_total_bytes / 2**30:,.1f}", _gib(c.host_bytes_per_node), _gib(c.nvme_bytes_per_node),
        f"{c.step_time_s:,.1f}", f"{c.tokens_per_s:,.0f}", c.binding if c.fits else "over " + ", ".join(c.misses),
    ]


#: column headings (GiB per GPU for the device total, GiB per node for host RAM and NVMe, LEGEND below the
#: table): a row fits a 100-column terminal
HEADS = ("#", "ZeRO", "offload", "tp/pp/sp/dp", "ckpt", "attention", "micro×acc", "GiB", "host", "NVMe", "step s",
         "tokens/s", "binding")
LEGEND = ("ZeRO stage; offload: optimizer/params; GiB: device total per GPU; host, NVMe: GiB per node; step s: "
          "seconds per optimizer step")
_RIGHT = ("#", "GiB", "host", "NVMe", "step s", "tokens/s")


def _table(title: str, rows: list[Candidate]):
    from rich.table import Table

    table = Table(title=title, title_justify="left", caption=LEGEND, caption_justify="left", box=None,
                  pad_edge=False, padding=(0, 1, 0, 0), header_style="bold underline")
    for h in HEADS:
        table.add_column(h, justify="right" if h in _RIGHT else "left", overflow="fold",
                         no_wrap=h != "binding")
    for i, c in enumerate(rows, 1):
        table.add_row(*_row(i, c))
    return table


def _assumption_lines(space: PlanSpace, notes: list[str]) -> list[str]:
    hw, a = space.hardware, space.perf
    return [
        (f"model {space.model.name}, seq {space.seq_len}, global batch {space.global_batch} sequences "
        f"({space.global_batch * space.seq_len:,} tokens/step), {space.world} GPUs ({space.gpus_per_node}/node), "
        f"{space.dtype}"),
        (f"budgets: device total ≤ {fmt_gib(space.target_bytes)} per GPU; host RAM {_node(space.host_ram_bytes_per_node)}"
        f" and NVMe {_node(space.nvme_bytes_per_node)} per node"),
        (f"speed: {hw.name} {hw.dense_flops / 1e12:.0f} TFLOP/s dense at {a.compute_efficiency:.0%}; NVLink "
        f"{hw.nvlink_bytes_per_s / GB:.0f} GB/s, InfiniBand {hw.inter_node_bytes_per_s / GB:.0f} GB/s per GPU at "
        f"{a.comm_efficiency:.0%}; PCIe {hw.pcie_bytes_per_s / GB:.0f} GB/s at {a.pcie_efficiency:.0%}; NVMe "
        f"{hw.nvme_bytes_per_s_per_node / GB:.0f} GB/s/node; CPU Adam {hw.cpu_adam_params_per_s_per_node:.0e} "
        "params/s/node (docs/performance-model.md)"),
        *notes,
    ]


def _node(n: int) -> str:
    """A node budget: GiB, with the vendor's decimal figure beside it (a DGX's 2 TB)."""
    from ..nodes import fmt_vendor_bytes

    return "none" if n == 0 else f"{fmt_gib(n)} ({fmt_vendor_bytes(n)})"


def render(result: PlanResult, top: int, notes: list[str], console, user_lines: list[str] | None = None,
           sources: tuple = ()) -> None:
    """Print the plan: the fitting rows (or the closest misses, said plainly), assumptions, counts, and where the
    plan's fixed facts came from."""
    space = result.space
    if result.shown(top):
        console.print(_table(f"{result.feasible} of {result.searched} configurations pass the memory screen; the "
                             f"fastest {len(result.shown(top))} of {len(result.candidates)} distinct rows, "
                             "confirmed by the estimator", result.shown(top)))
    else:
        console.print(f"[bold red]No configuration fits[/] {fmt_gib(space.target_bytes)} per GPU with host RAM "
                      f"{_node(space.host_ram_bytes_per_node)} and NVMe {_node(space.nvme_bytes_per_node)} per node "
                      f"({result.searched} configurations searched). The closest:")
        console.print(_table("closest misses (by how far over budget)", list(result.closest[:top])))
    for line in user_lines or []:
        console.print(line)
    console.print(f"searched {result.searched}, evaluated {result.evaluated}, feasible {result.feasible}; "
                  "dropped as invalid: " + (", ".join(f"{k} ({v})" for k, v in result.invalid.items()) or "none"))
    for line in _assumption_lines(space, [*notes, *result.notes]):
        console.print(f"[dim]assumption: {line}[/]")
    from ..sources import source_lines

    for line in source_lines(sources):
        console.print(line, highlight=False, markup=False)
