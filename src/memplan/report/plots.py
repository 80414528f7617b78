"""The report's four plots, drawn with matplotlib (the `report` extra, imported only here and only when drawn).

Each function returns {'png': bytes, 'svg': bytes}. Output is deterministic (fixed SVG hash salt, no dates),
so a regenerated report only changes where the numbers do. Sizes are shown in GiB (2**30 bytes).
"""

from __future__ import annotations

import io

from ..errors import InputError
from ..result import Estimate
from ..units import GiB
from .series import Measured, Point, phase_kind, phase_stacks

#: a colour-blind-safe cycle (Okabe & Ito 2008, "Color Universal Design")
COLOURS = ("#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000",
           "#999999", "#882255", "#44AA99", "#117733")
_SEGMENTS = ("forward", "backward", "step")


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise InputError("report", "needs matplotlib; allowed: install the report extra, "
                                   "pip install -e '.[report]'") from None
    matplotlib.use("Agg")
    matplotlib.rcParams.update({"svg.hashsalt": "memplan", "svg.fonttype": "path", "font.size": 9})
    import matplotlib.pyplot as plt

    return plt


def _save(fig) -> dict[str, bytes]:
    out = {}
    for fmt, meta in (("png", {"Software": None}), ("svg", {"Date": None, "Creator": None})):
        buf = io.BytesIO()
        fig.savefig(buf, format=fmt, dpi=110, bbox_inches="tight", metadata=meta)
        out[fmt] = buf.getvalue()
    fig.clf()
    import matplotlib.pyplot as plt

    plt.close(fig)
    return out


def _limits(ax, target_bytes: int | None, gpu_bytes: int | None, gpu_name: str | None, top_bytes: int = 0) -> None:
    """Target and GPU capacity as horizontal lines; with ``top_bytes``, only those below 4× it (so that a
    small job's bars are not flattened by an 80 GiB line)."""
    for value, label, style in ((target_bytes, "target", "--"), (gpu_bytes, gpu_name or "GPU", ":")):
        if value and (not top_bytes or value <= 4 * top_bytes):
            ax.axhline(value / GiB, color="#D55E00", linestyle=style, linewidth=1.2,
                       label=f"{label} {value / GiB:.1f} GiB")


def components_plot(est: Estimate) -> dict[str, bytes]:
    """Stacked bars: allocated bytes per component at every modelled moment of the step."""
    plt = _pyplot()
    names, stacks = phase_stacks(est)
    fig, ax = plt.subplots(figsize=(9, 4.6))
    bottom = [0.0] * len(names)
    for i, (part, values) in enumerate(stacks.items()):
        heights = [v / GiB for v in values]
        ax.bar(range(len(names)), heights, bottom=bottom, color=COLOURS[i % len(COLOURS)], label=part,
               edgecolor="white", linewidth=0.5)
        bottom = [b + h for b, h in zip(bottom, heights)]
    peak = names.index(est.peak_phase) if est.peak_phase in names else None
    labels = [n + ("\n(peak)" if i == peak else "") for i, n in enumerate(names)]
    ax.set_xticks(range(len(names)), labels, rotation=20, ha="right")
    _limits(ax, est.target_bytes, est.gpu_bytes, est.gpu_name, est.peak_allocated_bytes)
    ax.set_ylabel("allocated per GPU (GiB)")
    ax.set_title("predicted allocation by component at each moment of a step")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.grid(axis="y", alpha=0.3)
    return _save(fig)


def seq_plot(sweep: dict[int, list[Point]], est: Estimate) -> dict[str, bytes]:
    """Device total against sequence length, one line per Ulysses degree."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.4))
    for i, (sp, points) in enumerate(sweep.items()):
        ax.plot([p.x for p in points], [p.est.device_total_bytes / GiB for p in points], marker="o",
                color=COLOURS[i % len(COLOURS)], label=f"sp {sp}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.axvline(est.job.training.seq_len, color="#999999", linewidth=0.8)
    _limits(ax, est.target_bytes, est.gpu_bytes, est.gpu_name)
    ax.set_xlabel("tokens per sequence")
    ax.set_ylabel("device total per GPU (GiB, log)")
    ax.set_title("predicted device total against sequence length (Ulysses sp 1/2/4/8)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return _save(fig)


def zero_plot(points: list[Point], est: Estimate) -> dict[str, bytes]:
    """Device total for each ZeRO stage and offload choice, host RAM per node written on each bar."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.6))
    heights = [p.est.device_total_bytes / GiB for p in points]
    ax.bar(range(len(points)), heights, color=[COLOURS[p.x % len(COLOURS)] for p in points])
    for i, p in enumerate(points):
        host = p.est.host_bytes_per_node / GiB
        nvme = p.est.nvme_bytes_per_node / GiB
        text = (f"host {host:.0f}" if host else "") + (f"\nnvme {nvme:.0f}" if nvme else "")
        if text:
            ax.annotate(text, (i, heights[i]), ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(points)), [p.label for p in points], rotation=30, ha="right")
    ax.set_yscale("log")
    _limits(ax, est.target_bytes, est.gpu_bytes, est.gpu_name)
    ax.set_ylabel("device total per GPU (GiB, log)")
    ax.set_title("predicted device total by ZeRO stage and offload (host RAM / NVMe per node in GiB)")
    if est.target_bytes or est.gpu_bytes:
        ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3, which="both")
    return _save(fig)


def _positions(kinds: list[str]) -> list[float]:
    """x of each moment: forward in [0, 1), backward in [1, 2), step in [2, 3), evenly within its segment."""
    counts = {k: kinds.count(k) for k in _SEGMENTS}
    seen = dict.fromkeys(_SEGMENTS, 0)
    xs = []
    for k in kinds:
        seen[k] += 1
        xs.append(_SEGMENTS.index(k) + seen[k] / (counts[k] + 1))
    return xs


def timeline_plot(est: Estimate, measured: Measured | None = None) -> dict[str, bytes]:
    """Predicted allocation at each modelled moment; a verify report's timeline and phase peaks over it."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.4))
    kinds = [phase_kind(ph.name) for ph in est.timeline]
    xs = _positions(kinds)
    ys = [ph.allocated_bytes / GiB for ph in est.timeline]
    ax.plot(xs, ys, marker="o", color=COLOURS[0], label="predicted (memplan estimate)")
    for i, (x, y, ph) in enumerate(zip(xs, ys, est.timeline)):
        ax.annotate(ph.name, (x, y), textcoords="offset points", xytext=(0, 6 if i % 2 == 0 else -12),
                    ha="center", fontsize=6)
    if measured is not None:
        if measured.samples:
            mx = _positions([s[0] for s in measured.samples])
            ax.plot(mx, [s[2] / GiB for s in measured.samples], color=COLOURS[3], linewidth=1,
                    label=f"measured timeline ({measured.name})")
        for i, kind in enumerate(_SEGMENTS):
            if kind in measured.phase_peaks:
                ax.hlines(measured.phase_peaks[kind] / GiB, i + 0.05, i + 0.95, colors=COLOURS[3], linestyles="--",
                          label="measured phase peak" if i == 0 else None)
    for edge in (1, 2):
        ax.axvline(edge, color="#999999", linewidth=0.6)
    ax.set_xticks([0.5, 1.5, 2.5], ["forward", "backward", "optimizer step"])
    ax.set_xlim(0, 3)
    ax.set_ylim(bottom=0)
    _limits(ax, est.target_bytes, est.gpu_bytes, est.gpu_name, est.peak_allocated_bytes)
    ax.set_ylabel("allocated per GPU (GiB)")
    ax.set_title("step timeline: predicted" + (" and measured" if measured else ""))
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig)
