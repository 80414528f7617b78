"""The seed's verdict: reports/176b-seq32k-8xa100.md answers the article (../shared/seed, examples/seed-176b/).

(a) its configuration as written, through `memplan check`, and the nearest valid variant; (b) each numeric
claim beside memplan's figure; (c) what `memplan plan` finds under 24 GiB on 8×A100-80GB; (d) the evidence,
the committed reduced-depth verify report of the 176b preset measured on an H200.
"""

from __future__ import annotations

from .. import __version__
from ..api import estimate
from ..result import Estimate
from ..units import GiB
from . import claims, plots
from .doc import Block, Bullets, Code, Figure, Heading, Para, Table
from .page import gb, gib, job_sections, verdict
from .seed_data import (
    CHECK_ARGV,
    PLAN_ARGV,
    TARGET_BYTES,
    VERIFY_ROW,
    VERIFY_SOURCE,
    CheckResult,
    Evidence,
    estimate_on_a100,
    load_evidence,
    run_check,
    run_plan,
    seed_job,
)
from .series import job_of_row, measured_of, variant

STEM = "176b-seq32k-8xa100"
COMMAND = "memplan report --seed --out reports/"


def _variant_rows(named: list[tuple[str, Estimate]]) -> Table:
    rows = tuple((name, gib(e.peak_allocated_bytes), gib(e.device_total_bytes), gb(e.host_bytes_per_node),
                  gb(e.nvme_bytes_per_node), verdict(e.fits_target, e.target_bytes, e.device_total_bytes),
                  verdict(e.fits_gpu, e.gpu_bytes, e.device_total_bytes)) for name, e in named)
    return Table(("job", "peak allocated", "device total", "host RAM / node", "NVMe / node", "vs 24 GiB",
                  "vs A100-80GB"), rows, align_right=(1, 2, 3, 4))


def section_a(check: CheckResult, sp8: Estimate, sp8_full: Estimate) -> list[Block]:
    errors = [f for f in check.findings if f.severity == "error"]
    warnings = [f for f in check.findings if f.severity == "warning"]
    impl = ("Megatron-DeepSpeed's GPT under GPTModelPipe, CoreAttention" if check.estimate and
            check.estimate.job.training.model_impl == "megatron" else "eager attention")
    named = [((f"memplan check's verdict ({check.estimate_of}, as launched: {impl}, grad_accum "
              f"{check.estimate.job.training.grad_accum}; section (e))"), estimate_on_a100(check.estimate.job))
             ] if check.estimate else []
    named += [(("nearest valid variant: ZeRO-3, sp 8, fp16, offload optimizer cpu, micro-batch 1, seq 32768, "
               "8 GPUs, sdpa"), sp8), ("the same with full activation checkpointing", sp8_full)]
    return [
        Heading("(a) The article's configuration as written", 2),
        Para("`memplan check " + " ".join(CHECK_ARGV) + "` (run as a library call): "
             f"**{len(errors)} errors, {len(warnings)} warnings: the launch as written is refused.** Why:"),
        Table(("severity", "what", "why"), tuple((f.severity, f"`{f.subject}`", f.message)
                                                 for f in errors + warnings)),
        Para("Memory, against the article's 24 GB (taken as 24 GiB) and an A100-80GB (80 GiB as nvidia-smi "
             "reports it), per GPU; host RAM and NVMe per node:"),
        _variant_rows(named),
        Para(f"The nearest valid variant needs {gib(sp8.device_total_bytes)} per GPU, "
             f"{sp8.device_total_bytes / TARGET_BYTES:.1f}× the claim; with full checkpointing "
             f"{gib(sp8_full.device_total_bytes)}, which fits an A100-80GB but not 24 GiB, and still "
             f"{gb(sp8_full.host_bytes_per_node)} of pinned host RAM per node for the offloaded optimizer. "
             "The plots below are for the nearest valid variant (no checkpointing)."),
    ] + job_sections(sp8, STEM, level=3)


def _layout_problems(model, seq: int) -> dict[str, str]:
    from ..plan.space import check_problem, zero_problem

    out = {}
    for tp, pp, sp in ((2, 2, 2), (1, 2, 4)):
        why = [w for w in (check_problem(model, seq, 8, tp, pp, sp), zero_problem(3, pp, "cpu", "none")) if w]
        out[f"TP={tp}, PP={pp}, SP={sp}"] = "; ".join(why) or "valid"
    return out


def section_b(sp8: Estimate, sp8_full: Estimate, evidence: Evidence, host_ram_bytes: int) -> list[Block]:
    job = sp8.job
    no_sp = estimate(variant(job, layout={"sp": 1}))
    no_sp_full = estimate(variant(job, layout={"sp": 1}, training={"checkpointing": "full"}))
    eager_job = variant(job, training={"attention": "eager"})
    eager = estimate(eager_job) if eager_job is not None else None
    blocks: list[Block] = [Heading("(b) The article's claims, one by one", 2),
                           Para("Every figure is for the nearest valid variant (ZeRO-3, sp 8, fp16, optimizer "
                                "offloaded to cpu, seq 32768, micro-batch 1, 8 GPUs, sdpa, no checkpointing) unless "
                                "the row says otherwise.")]
    blocks += claims.claim_params(sp8) + claims.claim_partition(sp8) + claims.claim_adam(sp8, host_ram_bytes)
    blocks += claims.claim_grads(sp8) + claims.claim_activations(no_sp, sp8, sp8_full, no_sp_full, eager)
    blocks += claims.claim_total(sp8, sp8_full, evidence.measured_full_bytes)
    return blocks + claims.claim_layouts(_layout_problems(job.model, job.training.seq_len))


def _plan_table(result) -> Table:
    rows = []
    for c in result.candidates or result.closest:
        rows.append((f"ZeRO-{c.zero}", f"{c.offload_optimizer}/{c.offload_param}", f"{c.tp}/{c.pp}/{c.sp}/{c.dp}",
                     c.checkpointing, f"{c.micro_batch}×{c.grad_accum}", gib(c.device_total_bytes),
                     gb(c.host_bytes_per_node), gb(c.nvme_bytes_per_node), f"{c.step_time_s:,.0f} s",
                     f"{c.tokens_per_s:,.0f}", "fits" if c.fits else "misses: " + ", ".join(c.misses)))
    return Table(("ZeRO", "offload opt/param", "tp/pp/sp/dp", "ckpt", "micro×accum", "device total",
                  "host RAM / node", "NVMe / node", "step", "tokens/s", ""), tuple(rows), align_right=(5, 6, 7, 8, 9))


def plan_summary(result) -> str:
    """What every fitting configuration has in common, or that none fits."""
    rows = result.candidates
    if not rows:
        return "**No configuration reaches 24 GiB** per GPU on 8×A100-80GB (closest misses in section (c))."

    def values(attr: str) -> str:
        return " or ".join(dict.fromkeys(str(getattr(c, attr)) for c in rows))

    best = rows[0]
    return (f"Only ZeRO-{values('zero')} with the optimizer offloaded to {values('offload_optimizer')}, the "
            f"parameters to {values('offload_param')}, {values('checkpointing')} checkpointing and sp "
            f"{values('sp')} reaches 24 GiB; the fastest needs {gb(best.host_bytes_per_node)} host RAM and "
            f"{gb(best.nvme_bytes_per_node)} NVMe per node and about {best.step_time_s / 3600:.1f} h per "
            f"{best.micro_batch * best.grad_accum * best.dp}-sequence step (section (c)).")


def section_c(plans: dict) -> list[Block]:
    blocks: list[Block] = [Heading("(c) What does reach 24 GiB on 8×A100-80GB", 2)]
    for dtype, (result, _notes) in plans.items():
        verdict_line = (f"**{len(result.candidates)} distinct configurations fit** ({result.feasible} evaluated "
                        f"configurations fit, of {result.searched} searched)" if result.candidates else
                        "**None fits**; the closest misses")
        blocks += [Heading(f"{dtype}" + (" (the article's dtype)" if dtype == "fp16" else " (plan's default dtype)"), 3),
                   Para(f"`memplan plan {' '.join(PLAN_ARGV)} --dtype {dtype}` (library call): {verdict_line}, "
                        "ranked by the estimated step time of a 4Mi-token global batch:"),
                   _plan_table(result)]
    space = result.space
    blocks.append(Para(
        f"Budgets: device total ≤ 24 GiB per GPU; host RAM {gb(space.host_ram_bytes_per_node)} and NVMe "
        f"{gb(space.nvme_bytes_per_node)} per node (DGX A100 640GB). {plan_summary(result)} Step times come from "
        "docs/performance-model.md (50% of dense peak; order-of-magnitude)."))
    return blocks


def section_d(evidence: Evidence) -> list[Block]:
    row = evidence.row
    env = row.get("env", {})
    rows = tuple((f"{d.layers}", gib(d.measured_bytes), gib(d.predicted_bytes),
                  f"{100 * (d.predicted_bytes - d.measured_bytes) / d.measured_bytes:+.1f}%")
                 for d in evidence.depths)
    rows += (("per-layer slope", gib(evidence.measured_slope_bytes), gib(evidence.predicted_slope_bytes),
              f"{100 * (evidence.predicted_slope_bytes - evidence.measured_slope_bytes) / evidence.measured_slope_bytes:+.2f}%"),
             (f"{evidence.full_layers} (extrapolated)", gib(evidence.measured_full_bytes),
              gib(evidence.predicted_full_bytes),
              f"{100 * (evidence.predicted_full_bytes - evidence.measured_full_bytes) / evidence.measured_full_bytes:+.2f}%"))
    k = evidence.depths[0].layers
    job = job_of_row(row)
    est = estimate(job)
    return [
        Heading("(d) The evidence: a reduced-depth emulated verify on an H200", 2),
        Para(f"Verify report `{row['name']}` ([{VERIFY_ROW}](verify/{VERIFY_ROW.name}), a verbatim copy of its row "
             f"in `{VERIFY_SOURCE}`): the 176b preset at {', '.join(str(d.layers) for d in evidence.depths)} "
             "layers, full width, ZeRO-3, fp16, optimizer offloaded to cpu (DeepSpeedCPUAdam), the seed's "
             f"DeepSpeed ZeRO knobs, seq {job.training.seq_len} per rank, {job.layout.world} emulated ranks "
             f"(rank 0 measured through torch's fake process group), {row.get('steps')} optimizer steps of "
             f"{job.training.grad_accum} micro-steps, sdpa attention, no checkpointing."),
        Para("**Not with Ulysses**: DeepSpeed's Ulysses path for transformers fails on GPT-2, so the run used "
             "sp 1 at the per-rank token count that sp 8 gives at 32K, 32768 / 8 = 4096 tokens. Apart from "
             "attention's all-to-all buffers, a rank's activations are the same tensors."),
        Para(f"Environment: {env.get('gpu')}, driver {env.get('driver')}, CUDA {env.get('cuda')}, torch "
             f"{env.get('torch')}, DeepSpeed {env.get('deepspeed')}, transformers {env.get('transformers')}, "
             f"Python {env.get('python')}. Predicted: memplan {__version__} today, rank 0 (as memplan.accuracy "
             "compares emulated rows)."),
        Table(("layers", "measured peak allocated", "predicted", "error"), rows, align_right=(1, 2, 3)),
        Para(f"Extrapolation, stated: P(L) = P({k}) + (L − {k}) · (P({2 * k}) − P({k})) / {k}; at L = "
             f"{evidence.full_layers}: {evidence.measured_full_bytes:,} bytes = {gib(evidence.measured_full_bytes)}"
             f" measured-and-extrapolated, against memplan's {gib(evidence.predicted_full_bytes)} for the same job "
             f"at full depth. The seed's variant at 32K with sp 8 is predicted at "
             f"{gib(estimate(seed_job()).peak_allocated_bytes)} peak allocated: the article's 23.7 GB is "
             f"{evidence.measured_full_bytes / (23.7e9):.0f}× below what this measurement implies."),
        Figure("Step timeline of the verified job at full depth: predicted moments, measured (extrapolated) "
               "phase peaks dashed", f"{STEM}/evidence-timeline", plots.timeline_plot(est, measured_of(row))),
    ]


def seed_page(out: str) -> tuple[str, str, list[Block]]:
    """(stem, title, blocks) of the seed report."""
    from ..plan.hardware import resolve_hardware

    check = run_check()
    sp8 = estimate_on_a100(seed_job())
    sp8_full = estimate_on_a100(seed_job(checkpointing="full"))
    evidence = load_evidence()
    host_ram = resolve_hardware("a100-80g")[0].host_ram_bytes_per_node
    plans = {dtype: run_plan(dtype) for dtype in ("fp16", "bf16")}
    title = "The seed's verdict: a 176B model at 32K tokens on 8×A100-80GB under 24 GB per GPU?"
    summary = Bullets((
        "**No.** The launch as written does not start (DeepSpeed and Megatron-DeepSpeed refuse it; section (a)).",
        (f"Its nearest valid variant needs {gib(sp8.device_total_bytes)} per GPU "
        f"({gib(sp8_full.device_total_bytes)} with full checkpointing), not 24 GB, and "
        f"{gb(sp8.host_bytes_per_node)} of pinned host RAM per node for the offloaded optimizer."),
        ("A reduced-depth run on an H200, extrapolated to 96 layers, measures "
        f"{gib(evidence.measured_full_bytes)} at 4096 tokens per rank (section (d)); memplan predicts it within "
        f"{100 * abs(evidence.predicted_full_bytes - evidence.measured_full_bytes) / evidence.measured_full_bytes:.2f}%."),
        plan_summary(plans["fp16"][0]),
    ))
    blocks: list[Block] = [Heading(title, 1), Para("Regenerate from the repository root with:"), Code(COMMAND),
                           Para(f"memplan {__version__}; sizes in GiB (2^30 bytes) and GB (10^9 bytes, the article's "
                                f"unit); 24 GB is read as 24 GiB = {24 * GiB:,} bytes."), summary]
    blocks += section_a(check, sp8, sp8_full) + section_b(sp8, sp8_full, evidence, host_ram)
    from .megatron import section_megatron

    return STEM, title, blocks + section_c(plans) + section_d(evidence) + section_megatron(sp8.job)
