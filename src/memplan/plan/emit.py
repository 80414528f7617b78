"""`--emit N`: a ready DeepSpeed JSON and the launch flags for row N of a plan.

Writes three files into a directory: ds_config.json (memplan.dsconfig_emit.to_ds_config of the row's Job),
launch.sh (the deepspeed launcher with Megatron-DeepSpeed pretrain_gpt.py-style flags for the layout), and
candidate.json (the row as `plan --json` prints it). The Job is validated in full before anything is written,
and the three files appear together or not at all (memplan.outputs.write_files).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from ..errors import InputError
from ..outputs import check_folder, write_files
from ..specs import Job, Layout, TrainingSpec, ZeroSpec
from .search import Candidate
from .space import PlanSpace


def candidate_job(space: PlanSpace, c: Candidate) -> Job:
    """The validated Job a candidate stands for (the search built it without validation)."""
    zero = ZeroSpec(stage=c.zero, offload_optimizer=c.offload_optimizer, offload_param=c.offload_param)
    training = TrainingSpec(
        seq_len=space.seq_len, micro_batch=c.micro_batch, grad_accum=c.grad_accum, dtype=space.dtype,
        checkpointing=c.checkpointing, attention=c.attention,
        optimizer="cpu_adam" if c.offload_optimizer != "none" else "adamw", zero=zero)
    layout = Layout(world=space.world, gpus_per_node=space.gpus_per_node, tp=c.tp, pp=c.pp, sp=c.sp)
    return Job(model=space.model, training=training, layout=layout)


def launch_flags(space: PlanSpace, c: Candidate) -> list[str]:
    """Megatron-DeepSpeed pretrain_gpt.py arguments for the row (megatron/arguments.py names)."""
    m = space.model
    flags = [
        "--tensor-model-parallel-size", str(c.tp), "--pipeline-model-parallel-size", str(c.pp),
        "--ds-sequence-parallel-size", str(c.sp), "--num-layers", str(m.num_layers),
        "--hidden-size", str(m.hidden_size), "--num-attention-heads", str(m.num_heads),
        "--seq-length", str(space.seq_len), "--max-position-embeddings", str(max(space.seq_len,
                                                                               m.max_position_embeddings)),
        "--micro-batch-size", str(c.micro_batch), "--global-batch-size", str(space.global_batch),
        "--zero-stage", str(c.zero), f"--{space.dtype}" if space.dtype != "fp32" else "",
    ]
    if c.pp == 1:
        flags.append("--no-pipeline-parallel")  # Megatron-DeepSpeed: plain module, needed for ZeRO-2/3
    if c.checkpointing == "full":
        flags += ["--checkpoint-activations"]
    elif c.checkpointing == "selective":
        flags += ["--recompute-granularity", "selective"]
    if c.attention == "flash":
        flags.append("--use-flash-attn-v2")
    return [f for f in flags if f]


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
    return f"#!/bin/sh\n# written by memplan plan --emit; add your data and tokenizer flags\n{body}\n"


def emit(space: PlanSpace, rows: tuple[Candidate, ...], row: int, directory: str, candidate_json: dict) -> Path:
    """Write ds_config.json, launch.sh and candidate.json for ``rows[row - 1]`` into ``directory``."""
    from ..dsconfig_emit import to_ds_config

    if not rows:
        raise InputError("--emit", "no configuration fits, so there is no row to emit")
    if not 1 <= row <= len(rows):
        raise InputError("--emit", f"row {row} does not exist; allowed: 1..{len(rows)}")
    c = rows[row - 1]
    config = to_ds_config(candidate_job(space, c))
    out = check_folder(directory, "--emit-dir")
    write_files({out / "ds_config.json": json.dumps(config, indent=2) + "\n", out / "launch.sh": launch_line(space, c),
                 out / "candidate.json": json.dumps(candidate_json, indent=2) + "\n"}, "--emit-dir")
    return out
