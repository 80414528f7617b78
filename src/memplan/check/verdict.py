"""The memory verdict of `memplan check`: the job as launched (resolved once, memplan.resolve), or when the launch
is refused, the nearest job that runs, labelled as such; then the per-node host RAM and NVMe against the node.

The nearest variants fix only what the launch's errors are about, in this order: Ulysses over tp·pp·sp ranks
(parallel_state refuses sp with tp/pp), --no-pipeline-parallel (DeepSpeed's PipelineEngine refuses ZeRO-2/3 and
a grid that leaves out the sp ranks), pp 1 (ZeRO-2/3 with pp). What DeepSpeed ignores (offload_param below
ZeRO-3, offload_optimizer at stage 0: rules_ds.value_rules warns) is left out of the job, as DeepSpeed does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import InputError
from ..specs import ModelSpec
from .findings import Finding, error, info, warning


@dataclass(frozen=True)
class Verdict:
    """The estimate (None when none could be made), what it is the estimate of, findings about it, and where
    each value of its job came from."""

    estimate: object | None
    label: str
    findings: tuple[Finding, ...]
    sources: tuple = ()


def _ignored(settings) -> dict:
    """What DeepSpeed ignores in the config, as field changes (offload_param below ZeRO-3, offload at stage 0)."""
    stage = (settings.zero_stage or 0) if settings else 0
    zero = {}
    if stage != 3 and settings is not None and settings.offload_param not in (None, "none"):
        zero["offload_param"] = "none"  # stage_1_and_2.py never reads offload_param
    if stage == 0 and settings is not None and settings.offload_optimizer not in (None, "none"):
        zero["offload_optimizer"] = "none"  # no ZeRO optimizer is built at stage 0
    return {"zero": zero} if zero else {}


def variants(ctx: dict, model: ModelSpec) -> Iterator[tuple[str, dict]]:
    """(label, field changes): the job as launched, then the nearest jobs that run."""
    lay, launch, settings = ctx["layout"], ctx["launch"], ctx["settings"]
    tp, pp, sp, world = lay.tp, lay.pp, lay.sp_intended, lay.world or 1
    base = {**_ignored(settings), **({"sp": sp} if sp != lay.sp else {})}
    stage = (settings.zero_stage or 0) if settings else 0
    pipe = bool(ctx["megatron"] and launch is not None and launch.has("--deepspeed")
                and not launch.has("--no-pipeline-parallel"))
    inner = tp * pp * sp
    refused = (sp > 1 and (tp > 1 or pp > 1)) or (pp > 1 and stage >= 2) or (pipe and (stage >= 2 or sp > 1))
    if not refused:
        yield "as launched", base
    layouts = []
    if sp > 1 and (tp > 1 or pp > 1):
        if model.num_heads % inner == 0 and world % inner == 0:
            layouts.append((f"tp=1 pp=1 sp={inner} (Ulysses over tp·pp·sp ranks)", {"tp": 1, "pp": 1, "sp": inner}))
        layouts.append((f"tp=1 pp=1 sp={sp}", {"tp": 1, "pp": 1, "sp": sp}))
    if pp > 1 and stage >= 2:
        layouts.append((f"pp=1 (ZeRO-{stage} refuses pipeline parallelism)", {"pp": 1}))
    if not layouts:
        layouts.append(("", {}))
    for what, change in layouts:
        if pipe and (stage >= 2 or change.get("sp", sp) > 1):
            change = {**change, "pp": 1, "pipeline_engine": False}
            what = f"{what} with --no-pipeline-parallel" if what else "--no-pipeline-parallel (GPTModel, no PipelineEngine)"
        if what:
            yield f"nearest valid variant: {what}", {**base, **change}


def estimate_for(ctx: dict, model: ModelSpec | None, req, budget) -> Verdict:
    """The verdict for the checked job (``req``: the memplan.resolve.JobRequest of the check's inputs)."""
    if model is None or ctx["settings"] is None:
        why = "no --model given" if model is None else "the DeepSpeed config has a value DeepSpeed refuses"
        return Verdict(None, "", (info("estimate", f"no memory verdict: {why}", "pass --model NAME|PATH"),))
    from ..api import estimate
    from ..jobbuild import build_job
    from ..resolve import resolved_fields
    from ..sources import job_sources

    for label, change in variants(ctx, model):
        try:
            fields, source, origin = resolved_fields(req, model, None, ctx.get("trainer"), variant=change,
                                                     settings=ctx["settings"])
            job = build_job(model, fields, source, origin)
        except InputError:
            continue
        notes = () if label == "as launched" else (info("estimate", f"the launch as written is refused; the memory "
                                                        f"verdict is for the {label}"),)
        est = estimate(job, target_bytes=budget.target_bytes, gpu_name=budget.gpu_name, gpu_bytes=budget.gpu_bytes)
        return Verdict(est, label, notes + tuple(node_findings(est, budget)), job_sources(job, req, source, origin))
    return Verdict(None, "", (error("estimate", "no layout near the launch line is valid for this model", ""),))


def node_findings(est, budget) -> list[Finding]:
    """A finding per node budget the job exceeds: ZeRO-Offload pins its host buffers at initialize, so a node
    without the memory cannot start it (or swaps and stalls)."""
    from ..budget import node_checks
    from ..nodes import fmt_vendor_bytes
    from ..units import fmt_gib

    out = []
    for c in node_checks(est.host_bytes_per_node, est.nvme_bytes_per_node, budget):
        if not c.fits:
            flag = "--host-ram" if c.what == "host RAM" else "--nvme"
            out.append(warning(flag, f"the job needs {fmt_gib(c.need_bytes)} of {c.what} per node (pinned host buffers "
                               f"of the offloaded optimizer / parameters); the node has {fmt_gib(c.have_bytes)} "
                               f"({fmt_vendor_bytes(c.have_bytes)}, {c.origin.split(' (')[0]})",
                               "offload less, spread the job over more nodes, or use a node with more memory"))
    return out


__all__ = ["Verdict", "estimate_for", "node_findings", "variants"]
