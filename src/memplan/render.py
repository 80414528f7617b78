"""Renderers for an Estimate: one JSON object (`estimate_json`) and a rich table (`render_estimate`).

Thin by design: they format what the core computed and compute nothing but shares and sums for display.
GiB is 2**30 bytes and labelled GiB. rich is imported only when a table is drawn, so ``--json`` stays fast.
"""

from __future__ import annotations

import json
from typing import IO, Any

from .result import Estimate
from .units import GiB, fmt_gib


def component_bytes(est: Estimate) -> dict[str, int]:
    """Bytes at the peak per component name (parts sharing a name are added), in the core's order."""
    out: dict[str, int] = {}
    for part in est.components:
        out[part.name] = out.get(part.name, 0) + part.bytes
    return out


def estimate_json(est: Estimate) -> dict[str, Any]:
    """The object `memplan estimate --json` prints (and `memplan check --json` embeds). Bytes are integers.

    Keys: peak_allocated_bytes, peak_reserved_bytes, device_total_bytes, peak_reserved_gpu_behind_bytes and
    device_total_gpu_behind_bytes (null unless DeepSpeed frees with record_stream: ZeRO-3; the bound on a GPU a
    whole phase behind, which the verdicts do not use), non_torch_bytes, components
    (name → bytes at the peak), component_details (name, bytes, detail per part), peak_phase, timeline
    (phase → allocated bytes), host_bytes_per_node, nvme_bytes_per_node, target_bytes, gpu_name, gpu_bytes,
    fits_target, fits_gpu, notes, trainable_params and frozen_params (issue 14: LoRA adapters and --freeze;
    estimator.train_set.parameter_counts), and job (the resolved inputs: model, training, layout, plus dp).
    """
    from .estimator.train_set import parameter_counts

    dumped = est.model_dump(mode="json")
    job = dumped["job"]
    job["layout"]["dp"] = est.job.layout.dp
    job["layout"]["nodes"] = est.job.layout.nodes
    return {
        "peak_allocated_bytes": est.peak_allocated_bytes,
        "peak_reserved_bytes": est.peak_reserved_bytes,
        "device_total_bytes": est.device_total_bytes,
        "peak_reserved_gpu_behind_bytes": est.peak_reserved_gpu_behind_bytes,
        "device_total_gpu_behind_bytes": est.device_total_gpu_behind_bytes,
        "non_torch_bytes": est.non_torch_bytes,
        "peak_phase": est.peak_phase,
        "components": component_bytes(est),
        "component_details": dumped["components"],
        "timeline": [{"phase": ph.name, "allocated_bytes": ph.allocated_bytes} for ph in est.timeline],
        "host_bytes_per_node": est.host_bytes_per_node,
        "nvme_bytes_per_node": est.nvme_bytes_per_node,
        "target_bytes": est.target_bytes,
        "gpu_name": est.gpu_name,
        "gpu_bytes": est.gpu_bytes,
        "fits_target": est.fits_target,
        "fits_gpu": est.fits_gpu,
        "notes": list(est.notes),
        **parameter_counts(est.job.training, est.job.model),
        "job": job,
    }


def write_json(est: Estimate, out: IO[str]) -> None:
    """One JSON object and a newline."""
    out.write(json.dumps(estimate_json(est), indent=2) + "\n")


def job_title(est: Estimate) -> str:
    """One line naming the job: model, tokens, layout, ZeRO, offload, dtype."""
    j = est.job
    t, z, lay = j.training, j.training.zero, j.layout
    offload = [f"{what} → {dev}" for what, dev in (("optimizer", z.offload_optimizer), ("params", z.offload_param))
               if dev != "none"]
    parts = [
        f"{j.model.name}", f"seq {t.seq_len}", f"micro-batch {t.micro_batch}",
        f"{lay.world} GPUs (dp {lay.dp} · tp {lay.tp} · pp {lay.pp} · sp {lay.sp})", f"ZeRO-{z.stage}",
        f"offload {', '.join(offload)}" if offload else "no offload", t.dtype, f"checkpointing {t.checkpointing}",
        f"{t.attention} attention", t.optimizer,
    ]
    return " · ".join(parts)


def _verdict(fits: bool | None, limit_bytes: int | None, total_bytes: int, label: str) -> str | None:
    if fits is None or limit_bytes is None:
        return None
    margin = limit_bytes - total_bytes
    word = "[green]fits[/green]" if fits else "[red]does not fit[/red]"
    side = "left" if margin >= 0 else "over"
    return f"{label} ({fmt_gib(limit_bytes)}): {word}, {fmt_gib(abs(margin))} {side}"


def render_estimate(est: Estimate, console=None) -> None:
    """Draw the breakdown at the peak and the summary on a rich Console (stdout by default)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    peak = est.peak_allocated_bytes
    table = Table(title=f"per-GPU memory at the peak ({est.peak_phase})", caption=job_title(est))
    table.add_column("component")
    table.add_column("GiB", justify="right")
    table.add_column("share of peak", justify="right")
    table.add_column("detail", overflow="fold")
    for part in est.components:
        share = f"{100 * part.bytes / peak:.1f}%" if peak else "-"
        table.add_row(part.name, f"{part.bytes / GiB:.2f}", share, part.detail)
    table.add_section()
    table.add_row("[bold]peak allocated[/bold]", f"[bold]{peak / GiB:.2f}[/bold]", "100.0%" if peak else "-", "")
    console.print(table)
    lines = [
        f"peak phase: {est.peak_phase}",
        (f"peak allocated {fmt_gib(peak)} · peak reserved {fmt_gib(est.peak_reserved_bytes)} · device total "
         f"{fmt_gib(est.device_total_bytes)} (reserved + {fmt_gib(est.non_torch_bytes)} CUDA context, NCCL)"),
        *([] if est.peak_reserved_gpu_behind_bytes is None else [
            f"on a GPU a whole phase behind the host (shared, slower): peak reserved up to "
            f"{fmt_gib(est.peak_reserved_gpu_behind_bytes)} · device total "
            f"{fmt_gib(est.device_total_gpu_behind_bytes)} "
            f"(ZeRO-3's record_stream frees wait for the next synchronization)"]),
        (f"per node: host RAM {fmt_gib(est.host_bytes_per_node)} (offload, pinned) · NVMe "
         f"{fmt_gib(est.nvme_bytes_per_node)}"),
    ]
    verdicts = [
        _verdict(est.fits_target, est.target_bytes, est.device_total_bytes, "target"),
        _verdict(est.fits_gpu, est.gpu_bytes, est.device_total_bytes, f"GPU {est.gpu_name}"),
    ]
    lines += [f"verdict vs {v}" for v in verdicts if v]
    lines += [f"note: {n}" for n in est.notes]
    for line in lines:
        console.print(line, highlight=False)
