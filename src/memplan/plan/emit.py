"""`--emit N`: a ready DeepSpeed JSON and the Megatron-DeepSpeed launch line for row N of a megatron plan.

Writes three files into a directory: ds_config.json (memplan.dsconfig_emit.to_ds_config of the row's Job, less
what Megatron-DeepSpeed supplies itself: the optimizer, which get_megatron_optimizer passes as a client
optimizer, and AutoTP / sequence_parallel_size, which its mpu replaces), launch.sh (the deepspeed launcher with
pretrain_gpt.py flags: the model as check.megatron_model describes it, the layout, the batch, ZeRO, dtype,
recompute and flash), and candidate.json (the row as `plan --json` prints it). Read back by
`memplan check --ds-config ds_config.json --launch-file launch.sh --model M` or by `memplan plan --ds-config ...
--launch-file ...`, the files give the row's Job again (tests/test_plan_roundtrip.py). The Job is validated in
full before anything is written, and the three files appear together or not at all.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from ..errors import InputError
from ..outputs import check_folder, write_files
from ..specs import Job
from .candidate import Candidate
from .space import PlanSpace


def emit_problem(req) -> None:
    """Refuse --emit for a plan whose rows no launch line memplan writes can describe (InputError)."""
    if req.job.model_impl != "megatron":
        raise InputError("--emit", "writes a Megatron-DeepSpeed launch line (pretrain_gpt.py), whose job is "
                                   "Megatron's GPT, not the transformers job this plan ranks; allowed: --emit with "
                                   "--model-impl megatron")


def candidate_job(space: PlanSpace, c: Candidate) -> Job:
    """The validated Job a candidate stands for (the search built it without validation)."""
    return Job.model_validate(c.job.model_dump())


def ds_config(job: Job) -> dict:
    """The DeepSpeed JSON of a Megatron-DeepSpeed job (see the module docstring for what is left out)."""
    from ..dsconfig_emit import to_ds_config

    cfg = to_ds_config(job)
    for key in ("optimizer", "tensor_parallel", "sequence_parallel_size"):
        cfg.pop(key, None)
    t = job.training
    cfg["train_batch_size"] = t.micro_batch * t.grad_accum * job.layout.dp
    return cfg


def launch_flags(space: PlanSpace, c: Candidate) -> list[str]:
    """pretrain_gpt.py's arguments for the row (megatron/arguments.py names)."""
    from ..check.megatron_model import model_flags, run_flags

    job = c.job
    t = job.training
    flags = ["--tensor-model-parallel-size", str(c.tp), "--pipeline-model-parallel-size", str(c.pp),
             "--ds-sequence-parallel-size", str(c.sp), *model_flags(space.model, space.seq_len),
             "--seq-length", str(space.seq_len), "--micro-batch-size", str(c.micro_batch),
             "--global-batch-size", str(space.global_batch), "--zero-stage", str(c.zero), *run_flags(space.model)]
    if t.dtype != "fp32":
        flags.append(f"--{t.dtype}")
    if c.pp == 1:
        flags.append("--no-pipeline-parallel")  # GPTModel, not GPTModelPipe: DeepSpeed's PipelineEngine refuses ZeRO-2/3
    if t.optimizer == "cpu_adam":
        flags.append("--cpu-optimizer")  # get_megatron_optimizer builds DeepSpeedCPUAdam
    if c.checkpointing == "full":
        flags.append("--checkpoint-activations")
    elif c.checkpointing == "selective":
        flags += ["--recompute-granularity", "selective"]
    if c.attention == "flash":
        flags.append("--use-flash-attn-v2")
    return flags


def launch_line(space: PlanSpace, c: Candidate) -> str:
    """The deepspeed launcher line for the row (one script argument per line)."""
    nodes = -(-space.world // space.gpus_per_node)
    per_node = min(space.world, space.gpus_per_node)
    flags = launch_flags(space, c)
    pairs, i = [], 0
    while i < len(flags):
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            pairs.append(f"{flags[i]} {shlex.quote(flags[i + 1])}")
            i += 2
        else:
            pairs.append(flags[i])
            i += 1
    head = f"deepspeed --num_nodes {nodes} --num_gpus {per_node} pretrain_gpt.py"
    body = " \\\n  ".join([head, *pairs, "--deepspeed", "--deepspeed_config ds_config.json"])
    return (f"#!/bin/sh\n# written by memplan plan --emit; add your data and tokenizer flags (a tokenizer of "
            f"{space.model.vocab_size} tokens)\n{body}\n")


def emit(space: PlanSpace, rows: tuple[Candidate, ...], row: int, directory: str, candidate_json: dict) -> Path:
    """Write ds_config.json, launch.sh and candidate.json for ``rows[row - 1]`` into ``directory``."""
    if not rows:
        raise InputError("--emit", "no configuration fits, so there is no row to emit")
    if not 1 <= row <= len(rows):
        raise InputError("--emit", f"row {row} does not exist; allowed: 1..{len(rows)}")
    c = rows[row - 1]
    config = ds_config(candidate_job(space, c))
    out = check_folder(directory, "--emit-dir")
    write_files({out / "ds_config.json": json.dumps(config, indent=2) + "\n", out / "launch.sh": launch_line(space, c),
                 out / "candidate.json": json.dumps(candidate_json, indent=2) + "\n"}, "--emit-dir")
    return out


__all__ = ["candidate_job", "ds_config", "emit", "emit_problem", "launch_flags", "launch_line"]
