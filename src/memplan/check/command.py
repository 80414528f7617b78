"""Check a DeepSpeed config and launch line before launch: what would stop it, what would silently differ.

Reports findings (error: DeepSpeed or Megatron-DeepSpeed refuses it at launch; warning: silently ignored or
not what it looks like; info), grouped by severity, then the memory verdict for the job as launched (or, when
the launch is refused, for the nearest layout that runs, labelled as such). Exit 1 when any error is found,
0 otherwise, 2 for unreadable input. --json prints {"findings": [...], "estimate": {...} or null}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import get_args

from pydantic import ValidationError

from ..bounds import count_type, rank_count
from ..dsconfig import apply_to_job_fields, load_ds_config
from ..errors import InputError
from ..specs import Job, Layout, Loop, ModelSpec, TrainingSpec, ZeroSpec
from . import rules_ds, rules_hf, rules_job
from .findings import Finding, error, info, sort_findings
from .launch import Launch, parse_launch, read_launch_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `memplan check` (issue 4)."""
    parser.add_argument("--ds-config", metavar="PATH", required=True, help="the DeepSpeed JSON to check")
    g = parser.add_mutually_exclusive_group()
    g.add_argument("--launch", metavar="COMMAND", help="the launch line (deepspeed / torchrun / accelerate launch)")
    g.add_argument("--launch-file", metavar="FILE", help="a shell file holding the launch line")
    parser.add_argument("--model", metavar="NAME|PATH", help="model preset or config.json")
    parser.add_argument("--gpus", type=rank_count, metavar="N", help="world size (default: from the launch line)")
    parser.add_argument("--nodes", type=rank_count, metavar="N", help="nodes (gpus per node = gpus / nodes)")
    parser.add_argument("--seq", type=count_type(), metavar="N", help="tokens per sequence (default: --seq-length)")
    parser.add_argument("--gpu", metavar="NAME|SIZE", help="a100-80g, h100-80g, ... or a size")
    parser.add_argument("--target", metavar="SIZE", help="per-GPU budget, e.g. 24GiB")
    parser.add_argument("--loop", choices=get_args(Loop),
                        help="the training loop; hf-trainer: transformers' Trainer fills the config's \"auto\" "
                             "(default: hf-trainer when --training-args or Trainer flags are given)")
    parser.add_argument("--training-args", metavar="FILE",
                        help="TrainingArguments JSON (to_json_string()); the launch line's Trainer flags win")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _read_model(name: str | None) -> tuple[ModelSpec | None, dict | None]:
    """The --model spec, and (a config.json path) the file's keys as transformers reads them (memplan.inputs)."""
    if not name:
        return None, None
    from ..inputs import read_json_object
    from ..options import model_from_arg
    from ..presets import list_presets

    model = model_from_arg(name, "--model")
    if name.strip() in list_presets():
        return model, None
    return model, read_json_object(Path(name.strip()).expanduser(), "--model", "json", "config.json")


def collect(cfg: dict, launch: Launch | None, model: ModelSpec | None, raw: dict | None,
            gpus: int | None, seq: int | None, loop: str | None = None, training_args=None,
            ds_path: str | None = None) -> tuple[list[Finding], dict]:
    """All findings, and what the job as launched is (for the estimate)."""
    megatron = launch is not None and rules_job.is_megatron(launch)
    trainer, hf_findings = rules_hf.trainer_reading(cfg, launch, model, gpus, megatron, loop, training_args, ds_path)
    if trainer is not None and trainer.fill is not None:
        cfg = trainer.fill.config  # what DeepSpeed receives from the Trainer
    settings, findings = rules_ds.ds_rules(cfg, trainer=trainer is not None)
    findings += hf_findings
    if launch is not None:
        findings += rules_job.launcher_rules(launch)
        if megatron:
            findings += rules_job.megatron_flag_rules(launch)
    lay = rules_job.layout_from(launch, gpus, megatron, settings)
    findings += lay.findings
    stage = (settings.zero_stage or 0) if settings else 0
    findings += rules_job.parallel_rules(lay, stage, megatron, launch)
    seq = seq or (rules_job._int(launch.script_value("--seq-length"), 0) if launch and megatron else 0) or None
    if model is not None:
        findings += rules_job.model_shape_rules(model, lay, seq)
        findings += rules_job.model_config_rules(raw, model, launch, megatron, lay)
        findings += rules_job.zero3_padding_rule(model, stage, megatron)
    batch = None
    if settings is not None:
        more, batch = rules_job.batch_rules(settings, lay, launch, megatron)
        findings += more
        if megatron:
            findings += rules_job.megatron_ds_rules(launch, settings, model)
    return findings, {"settings": settings, "layout": lay, "batch": batch, "seq": seq, "megatron": megatron,
                      "launch": launch, "trainer": trainer}


def _training(ctx: dict, model: ModelSpec) -> TrainingSpec:
    s, launch = ctx["settings"], ctx["launch"]
    fields = apply_to_job_fields(s)
    zero = dict(fields["zero"])
    if zero.get("stage", 0) != 3:
        zero.pop("offload_param", None)  # ignored by DeepSpeed below stage 3 (a warning says so)
    if zero.get("stage", 0) == 0:
        zero.pop("offload_optimizer", None)
    training = dict(fields["training"])
    if ctx["batch"]:
        training.update(micro_batch=ctx["batch"]["micro_batch"], grad_accum=ctx["batch"]["grad_accum"])
    if zero.get("offload_optimizer") in ("cpu", "nvme") and training.get("optimizer", "adamw") == "adamw":
        training["optimizer"] = "cpu_adam"  # what DeepSpeed needs under offload (see the offload finding)
    if ctx.get("trainer") is not None:  # the Trainer's loop, checkpointing and optimizer (memplan.hf.job)
        training.update(ctx["trainer"].fields)
    if ctx["megatron"]:
        if launch.has("--checkpoint-activations") or launch.script_value("--recompute-granularity") == "full":
            training["checkpointing"] = "full"
        elif launch.has("--recompute-activations") or launch.script_value("--recompute-granularity") == "selective":
            training["checkpointing"] = "selective"
        flash = any(launch.has(f) for f in ("--use-flash-attn-v2", "--use-flash-attn", "--use-flash-attn-v1",
                                            "--use-flash-attn-triton", "--use-flash-attn-builder"))
        training["attention"] = "flash" if flash else "eager"
        from ..megatron.launch import megatron_spec_from_launch  # a Megatron-DeepSpeed launch builds Megatron's GPT

        training.update(model_impl="megatron", megatron=megatron_spec_from_launch(launch))
    return TrainingSpec(seq_len=ctx["seq"] or model.max_position_embeddings, zero=ZeroSpec(**zero), **training)


def _variants(lay, model: ModelSpec, training: TrainingSpec):
    """The layout as launched, then the nearest layouts that run, each with a label."""
    tp, pp, sp, world = lay.tp, lay.pp, lay.sp_intended, lay.world or 1
    yield "as launched", {"world": world, "tp": tp, "pp": pp, "sp": sp}
    inner = tp * pp * sp
    if sp > 1 and (tp > 1 or pp > 1):
        if model.num_heads % inner == 0 and training.seq_len % inner == 0 and world % inner == 0:
            yield f"nearest valid variant: tp=1 pp=1 sp={inner} (Ulysses over tp·pp·sp ranks)", {
                "world": world, "tp": 1, "pp": 1, "sp": inner}
        yield f"nearest valid variant: tp=1 pp=1 sp={sp}", {"world": world, "tp": 1, "pp": 1, "sp": sp}
    if pp > 1 and training.zero.stage >= 2:
        yield f"nearest valid variant: pp=1 (ZeRO-{training.zero.stage} refuses pipeline parallelism)", {
            "world": world, "tp": tp, "pp": 1, "sp": sp}


def estimate_for(ctx: dict, model: ModelSpec | None, args) -> tuple[object | None, str, list[Finding]]:
    """(Estimate or None, what it is the estimate of, findings about the estimate)."""
    if model is None or ctx["settings"] is None:
        why = "no --model given" if model is None else "the DeepSpeed config has a value DeepSpeed refuses"
        return None, "", [info("estimate", f"no memory verdict: {why}", "pass --model NAME|PATH")]
    from ..api import estimate

    training = _training(ctx, model)
    per_node = max(1, (ctx["layout"].world or 1) // args.nodes) if args.nodes else 8
    target, gpu_name, gpu_bytes = _budget(args)
    launch = ctx.get("launch")
    # Megatron's --sequence-parallel (with tp): Korthikanti et al. 2022 sequence parallelism
    megatron_sp = bool(ctx["megatron"] and launch is not None and launch.has("--sequence-parallel"))
    for label, layout in _variants(ctx["layout"], model, training):
        layout = {**layout, "tp_sequence_parallel": megatron_sp and layout["tp"] > 1}
        try:
            job = Job(model=model, training=training, layout=Layout(gpus_per_node=per_node, **layout))
        except ValidationError:
            continue
        note = [] if label == "as launched" else [info("estimate", f"the launch as written is refused; the memory "
                                                       f"verdict is for the {label}")]
        return estimate(job, target_bytes=target, gpu_name=gpu_name, gpu_bytes=gpu_bytes), label, note
    return None, "", [error("estimate", "no layout near the launch line is valid for this model", "")]


def _budget(args) -> tuple[int | None, str | None, int | None]:
    target = None
    if args.target is not None:
        from ..cli import _target_bytes

        target = _target_bytes(args.target)
    if args.gpu is not None:
        from ..gpus import resolve_gpu

        gpu = resolve_gpu(args.gpu)
        return target, gpu.name, gpu.memory_bytes
    return target, None, None


def run(args: argparse.Namespace) -> int:
    """Check a DeepSpeed config and launch line; exit 1 on any error finding, 0 otherwise, 2 on bad input."""
    if args.target is not None or args.gpu is not None:  # bad sizes are refused before any file is read
        _budget(args)
    cfg = load_ds_config(args.ds_config, flag="--ds-config")
    if args.launch_file is not None:
        launch = parse_launch(read_launch_file(args.launch_file, "--launch-file"), "--launch-file")
    elif args.launch is not None:  # an empty --launch is refused, as an empty file is
        launch = parse_launch(args.launch, "--launch")
    else:
        launch = None
    model, raw = _read_model(args.model)
    training_args = None
    if getattr(args, "training_args", None):
        from ..hf.args import load_training_args

        training_args = load_training_args(args.training_args)
    findings, ctx = collect(cfg, launch, model, raw, args.gpus, args.seq, getattr(args, "loop", None), training_args,
                            args.ds_config)
    est, label, more = estimate_for(ctx, model, args)
    findings = sort_findings(findings + more)
    if args.json:
        from ..render import estimate_json

        out = {"findings": [f.model_dump() for f in findings], "estimate": estimate_json(est) if est else None,
               "estimate_of": label or None}
        sys.stdout.write(json.dumps(out, indent=2) + "\n")
    else:
        from .render import render_check

        render_check(findings, est, label)
    return 1 if any(f.severity == "error" for f in findings) else 0


__all__ = ["InputError", "add_arguments", "collect", "run"]
