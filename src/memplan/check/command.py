"""Check a DeepSpeed config and launch line before launch: what would stop it, what would silently differ.

Reports findings (error: DeepSpeed or Megatron-DeepSpeed refuses it at launch; warning: silently ignored or
not what it looks like; info), grouped by severity, then the memory verdict for the job as launched (or, when
the launch is refused, for the nearest layout that runs, labelled as such), with host RAM and NVMe per node
against the node (--host-ram, --nvme; default: the GPU's usual node), and where each value of the job came
from. Exit 1 when any error is found, 0 otherwise, 2 for unreadable input. --json prints {"findings": [...],
"estimate": {...} or null, "estimate_of", "node", "sources"}.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from ..budget import BudgetRequest
from ..errors import InputError
from ..specs import ModelSpec
from . import rules_ds, rules_hf, rules_job, rules_megatron
from .findings import Finding, sort_findings
from .launch import Launch, parse_launch, read_launch_file
from .verdict import estimate_for

#: check's job flags (memplan.options): the files describe the rest
CHECK_FLAGS = ("--ds-config", "--model", "--gpus", "--nodes", "--seq", "--loop", "--training-args")
_HELPS = {
    "--ds-config": "the DeepSpeed JSON to check",
    "--gpus": "world size (default: from the launch line)",
    "--seq": "tokens per sequence (default: --seq-length, else min(4096, max_position_embeddings))",
    "--loop": "the training loop; hf-trainer: transformers' Trainer fills the config's \"auto\" (default: "
              "hf-trainer when --training-args or Trainer flags are given)",
    "--training-args": "TrainingArguments JSON (to_json_string()); the launch line's Trainer flags win",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `memplan check`: the files, the job flags they cannot say, the budgets."""
    from ..options import add_budget_arguments, add_job_arguments, add_launch_arguments

    add_job_arguments(parser, CHECK_FLAGS, required=("--ds-config",), helps=_HELPS)
    add_launch_arguments(parser)
    add_budget_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


class CheckRequest(BaseModel):
    """What `memplan check` is given: the files (paths; the launch line parsed), the job flags, the budgets."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    ds_config: str
    launch: Launch | None = None
    model: str | None = None
    gpus: int | None = None
    nodes: int | None = None
    seq: int | None = None
    loop: str | None = None
    training_args: str | None = None
    #: the adapter flags (--lora-*, --peft-config, --freeze), as estimate takes them; a TRL line's --use_peft
    #: says the same (check/launch_job.py trl_lora), and these win over it
    lora_rank: int | None = None
    lora_targets: str | None = None
    lora_dropout: float | None = None
    peft_config: str | None = None
    freeze: str | None = None
    budget: BudgetRequest = BudgetRequest()


@dataclass(frozen=True)
class CheckResult:
    """The findings (errors first), the memory verdict and where each value of its job came from."""

    findings: tuple[Finding, ...]
    estimate: object | None
    estimate_of: str
    sources: tuple = ()
    budget: object = None  # memplan.budget.Budget

    @property
    def errors(self) -> int:
        return sum(f.severity == "error" for f in self.findings)


def _read_model(name: str | None) -> tuple[ModelSpec | None, dict | None]:
    """The --model spec, and (a config.json path) the file's keys as transformers reads them (memplan.inputs)."""
    if not name:
        return None, None
    from ..inputs import read_json_object
    from ..presets import list_presets
    from ..resolve import model_from_arg

    model = model_from_arg(name, "--model")
    if name.strip() in list_presets():
        return model, None
    return model, read_json_object(Path(name.strip()).expanduser(), "--model", "json", "config.json")


def collect(cfg: dict, launch: Launch | None, model: ModelSpec | None, raw: dict | None,
            gpus: int | None, seq: int | None, loop: str | None = None, training_args=None,
            ds_path: str | None = None) -> tuple[list[Finding], dict]:
    """All findings, and what the job as launched is (for the verdict)."""
    megatron = launch is not None and rules_job.is_megatron(launch)
    trainer, hf_findings = rules_hf.trainer_reading(cfg, launch, model, gpus, megatron, loop, training_args, ds_path)
    if trainer is not None and trainer.fill is not None:
        cfg = trainer.fill.config  # what DeepSpeed receives from the Trainer
    settings, findings = rules_ds.ds_rules(cfg, trainer=trainer is not None, megatron=megatron)
    findings += hf_findings
    if launch is not None:
        findings += rules_job.launcher_rules(launch)
        if megatron:
            findings += rules_megatron.megatron_flag_rules(launch)
    lay = rules_job.layout_from(launch, gpus, megatron, settings)
    findings += lay.findings
    stage = (settings.zero_stage or 0) if settings else 0
    findings += rules_job.parallel_rules(lay, stage, megatron, launch)
    seq = seq or (rules_job._int(launch.script_value("--seq-length"), 0) if launch and megatron else 0) or None
    if model is not None:
        findings += rules_job.model_shape_rules(model, lay, seq, megatron, launch)
        findings += rules_job.model_config_rules(raw, model, launch, megatron, lay, seq)
        findings += rules_job.zero3_padding_rule(model, stage, megatron)
    batch = None
    if settings is not None:
        more, batch = rules_job.batch_rules(settings, lay, launch, megatron)
        findings += more
        if megatron:
            findings += rules_megatron.megatron_ds_rules(launch, settings, model, cfg)
    return findings, {"settings": settings, "layout": lay, "batch": batch, "seq": seq, "megatron": megatron,
                      "launch": launch, "trainer": trainer}


def check(req: CheckRequest) -> CheckResult:
    """Check the files of ``req``: every finding, then the memory verdict (the library call `run` prints)."""
    from ..budget import resolve_budget
    from ..dsconfig import load_ds_config
    from ..resolve import JobRequest

    budget = resolve_budget(req.budget)  # a bad --gpu is refused before any file is read
    cfg = load_ds_config(req.ds_config, flag="--ds-config")
    model, raw = _read_model(req.model)
    training_args = None
    if req.training_args:
        from ..hf.args import load_training_args

        training_args = load_training_args(req.training_args)
    findings, ctx = collect(cfg, req.launch, model, raw, req.gpus, req.seq, req.loop, training_args, req.ds_config)
    job_req = JobRequest(model=req.model, ds_config=req.ds_config, launch=req.launch, gpus=req.gpus, nodes=req.nodes,
                         seq=req.seq, loop=req.loop, training_args=req.training_args, gpu=req.budget.gpu,
                         lora_rank=req.lora_rank, lora_targets=req.lora_targets, lora_dropout=req.lora_dropout,
                         peft_config=req.peft_config, freeze=req.freeze)
    verdict = estimate_for(ctx, model, job_req, budget)
    return CheckResult(tuple(sort_findings(findings + list(verdict.findings))), verdict.estimate, verdict.label,
                       verdict.sources, budget)


def request_from_args(args: argparse.Namespace) -> CheckRequest:
    """The CheckRequest of the parsed flags; the launch line is read and parsed here (refused: exit 2)."""
    from ..options import budget_request_of

    if args.launch_file is not None:
        launch = parse_launch(read_launch_file(args.launch_file, "--launch-file"), "--launch-file")
    elif args.launch is not None:  # an empty --launch is refused, as an empty file is
        launch = parse_launch(args.launch, "--launch")
    else:
        launch = None
    return CheckRequest(ds_config=args.ds_config, launch=launch, model=args.model, gpus=args.gpus, nodes=args.nodes,
                        seq=args.seq, loop=args.loop, training_args=args.training_args,
                        lora_rank=args.lora_rank, lora_targets=args.lora_targets, lora_dropout=args.lora_dropout,
                        peft_config=args.peft_config, freeze=args.freeze, budget=budget_request_of(args))


def result_json(result: CheckResult) -> dict:
    """The --json object."""
    from ..budget import node_checks, node_json
    from ..render import estimate_json
    from ..sources import sources_json

    est = result.estimate
    node = node_json(node_checks(est.host_bytes_per_node, est.nvme_bytes_per_node, result.budget), result.budget) \
        if est is not None else None
    return {"findings": [f.model_dump() for f in result.findings], "estimate": estimate_json(est) if est else None,
            "estimate_of": result.estimate_of or None, "node": node, "sources": sources_json(result.sources)}


def run(args: argparse.Namespace) -> int:
    """Check a DeepSpeed config and launch line; exit 1 on any error finding, 0 otherwise, 2 on bad input."""
    from ..budget import resolve_budget
    from ..options import budget_request_of

    resolve_budget(budget_request_of(args))  # bad sizes and GPUs are refused before any file is read
    result = check(request_from_args(args))
    if args.json:
        sys.stdout.write(json.dumps(result_json(result), indent=2) + "\n")
    else:
        from .render import render_check

        render_check(result)
    return 1 if result.errors else 0


__all__ = ["CheckRequest", "CheckResult", "InputError", "add_arguments", "check", "collect", "request_from_args",
           "result_json", "run"]
