"""The capacity-planning page for one job: headline numbers, the breakdown at the peak, and four plots."""

from __future__ import annotations

from ..render import component_bytes, job_title
from ..result import Estimate
from ..units import GB, GiB
from . import plots
from .doc import Block, Bullets, Figure, Heading, Para, Table
from .series import Measured, seq_sweep, zero_sweep


def gib(n_bytes: int) -> str:
    """'x.xx GiB' for a table cell."""
    return f"{n_bytes / GiB:,.2f} GiB"


def gb(n_bytes: int) -> str:
    """'x.x GB' (10**9 bytes), for comparing with figures quoted in GB."""
    return f"{n_bytes / GB:,.1f} GB"


def verdict(fits: bool | None, limit_bytes: int | None, total_bytes: int) -> str:
    if fits is None or limit_bytes is None:
        return "—"
    margin = limit_bytes - total_bytes
    return f"{'fits' if fits else '**does not fit**'}: {gib(abs(margin))} {'left' if margin >= 0 else 'over'}"


def headline_table(est: Estimate) -> Table:
    """Peak allocated / reserved / device total, host and NVMe per node, and the verdicts."""
    rows = [
        ("peak allocated (torch.cuda.max_memory_allocated)", gib(est.peak_allocated_bytes), est.peak_phase),
        ("peak reserved (caching allocator)", gib(est.peak_reserved_bytes), ""),
        ("device total (reserved + CUDA context, NCCL)", gib(est.device_total_bytes), gb(est.device_total_bytes)),
        ("host RAM per node (offload, pinned)", gib(est.host_bytes_per_node), gb(est.host_bytes_per_node)),
        ("NVMe per node (offload)", gib(est.nvme_bytes_per_node), gb(est.nvme_bytes_per_node)),
    ]
    if est.target_bytes is not None:
        rows.append((f"target {gib(est.target_bytes)}", verdict(est.fits_target, est.target_bytes,
                                                                 est.device_total_bytes), ""))
    if est.gpu_bytes is not None:
        rows.append((f"GPU {est.gpu_name or ''} {gib(est.gpu_bytes)}",
                     verdict(est.fits_gpu, est.gpu_bytes, est.device_total_bytes), ""))
    return Table(("per GPU", "predicted", "note"), tuple(rows), align_right=(1,))


def breakdown_table(est: Estimate) -> Table:
    """The components at the peak, with their share and what each models."""
    total = est.peak_allocated_bytes or 1
    details = {p.name: p.detail for p in est.components}
    rows = tuple((f"`{name}`", gib(b), f"{100 * b / total:.1f}%", details.get(name, ""))
                 for name, b in component_bytes(est).items())
    rows += (("**peak allocated**", gib(est.peak_allocated_bytes), "100.0%", f"phase: {est.peak_phase}"),)
    return Table(("component", "GiB", "share", "what it is"), rows, align_right=(1, 2))


def zero_table(points) -> Table:
    rows = tuple((p.label, gib(p.est.device_total_bytes), gib(p.est.host_bytes_per_node),
                  gib(p.est.nvme_bytes_per_node), p.est.peak_phase) for p in points)
    return Table(("ZeRO / offload", "device total", "host RAM / node", "NVMe / node", "peak phase"), rows,
                 align_right=(1, 2, 3))


def measured_table(est: Estimate, measured: Measured) -> Table:
    """Measured phase peaks beside the predicted ones (same phase kinds)."""
    predicted: dict[str, int] = {}
    from .series import phase_kind

    for ph in est.timeline:
        kind = phase_kind(ph.name)
        predicted[kind] = max(predicted.get(kind, 0), ph.allocated_bytes)
    rows = []
    for kind in ("forward", "backward", "step"):
        if kind in measured.phase_peaks and kind in predicted:
            m, p = measured.phase_peaks[kind], predicted[kind]
            rows.append((f"{kind} phase peak", gib(m), gib(p), f"{100 * (p - m) / m:+.1f}%" if m else "—"))
    return Table(("allocated", "measured", "predicted", "error"), tuple(rows), align_right=(1, 2, 3))


def job_sections(est: Estimate, folder: str, measured: Measured | None = None, level: int = 2) -> list[Block]:
    """Breakdown, the four plots (files under ``folder``/), and the measured comparison when given."""
    blocks: list[Block] = [Heading("Predicted per-GPU memory", level), headline_table(est),
                           Heading("Breakdown at the peak", level + 1), breakdown_table(est)]
    blocks.append(Figure("Predicted allocation by component at each modelled moment of a step",
                         f"{folder}/components", plots.components_plot(est)))
    blocks.append(Heading("Sequence length and Ulysses sequence parallelism", level + 1))
    blocks.append(Figure("Device total against tokens per sequence, for Ulysses sp 1, 2, 4 and 8 (other flags as "
                         "the job; degrees the model or world size refuse are left out)",
                         f"{folder}/seq-sp", plots.seq_plot(seq_sweep(est.job), est)))
    points = zero_sweep(est.job)
    blocks += [Heading("ZeRO stage and offload", level + 1),
               Figure("Device total for each ZeRO stage and offload choice (host RAM / NVMe per node on the bars)",
                      f"{folder}/zero-offload", plots.zero_plot(points, est)), zero_table(points)]
    blocks.append(Heading("Step timeline", level + 1))
    if measured is not None:
        blocks.append(Para(f"Measured: verify report `{measured.name}`; dashed lines are its largest forward, "
                           "backward and optimizer-step peaks, the thin line its per-layer timeline if it "
                           "recorded one. " + (f"Depth: {measured.layers_note}." if measured.layers_note else "")))
        blocks.append(measured_table(est, measured))
    blocks.append(Figure("Allocated bytes through a step: predicted moments" + (
        " with the measured phase peaks overlaid" if measured else ""), f"{folder}/timeline",
        plots.timeline_plot(est, measured)))
    if est.notes:
        blocks += [Heading("Notes", level + 1), Bullets(tuple(est.notes))]
    return blocks


def job_page(est: Estimate, stem: str, command: str, measured: Measured | None = None,
             sources: tuple = ()) -> tuple[str, list[Block]]:
    """(title, blocks) of the report for one job; ``sources`` (memplan.resolve.Source): where each value of the
    job came from, listed for the values that were not flags."""
    from .. import __version__

    title = f"memplan report: {est.job.model.name}, seq {est.job.training.seq_len}, {est.job.layout.world} GPUs"
    blocks: list[Block] = [Heading(title, 1), Para(f"Regenerate: `{command}` (memplan {__version__})."),
                           Para(f"Job: {job_title(est)}.")]
    if sources:
        from ..sources import source_lines

        blocks.append(Bullets(tuple(source_lines(sources))))
    return title, blocks + job_sections(est, stem, measured)
