"""The user's own configuration (`--ds-config`, `--launch-file`): where it ranks, or why it does not fit.

The Job is built the way `memplan estimate` builds it (memplan.options: --ds-config values over the seed's
defaults), with the layout flags of a Megatron-DeepSpeed launch line on top (parsed by memplan.check.launch).
Its rank is by tokens per second, since its global batch may differ from the plan's.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import InputError
from .render import candidate_dict
from .search import PlanResult, default_peak_fn, make_candidate

#: Megatron-DeepSpeed pretrain_gpt.py flags (megatron/arguments.py) → memplan job flags
LAUNCH_FLAGS = {
    "--tensor-model-parallel-size": "--tp",
    "--pipeline-model-parallel-size": "--pp",
    "--ds-sequence-parallel-size": "--sp",
    "--micro-batch-size": "--micro-batch",
    "--seq-length": "--seq",
}


def _launch_argv(path: str) -> tuple[list[str], Any]:
    """The job flags of a launch line, and its MegatronSpec when it is a Megatron-DeepSpeed line (which
    implies --model-impl megatron) or None."""
    from ..check.launch import parse_launch, read_launch_file
    from ..check.rules_job import is_megatron

    launch = parse_launch(read_launch_file(path))
    argv: list[str] = []
    for flag, ours in LAUNCH_FLAGS.items():
        value = launch.script_value(flag)
        if value:
            argv += [ours, value]
    if not is_megatron(launch):
        return argv, None
    from ..megatron.launch import megatron_spec_from_launch

    flash = any(launch.has(f) for f in ("--use-flash-attn-v2", "--use-flash-attn", "--use-flash-attn-v1",
                                        "--use-flash-attn-triton", "--use-flash-attn-builder"))
    full = launch.has("--checkpoint-activations") or launch.script_value("--recompute-granularity") == "full"
    selective = launch.has("--recompute-activations") or launch.script_value("--recompute-granularity") == "selective"
    argv += ["--model-impl", "megatron", "--attention", "flash" if flash else "eager",
             "--checkpointing", "full" if full else ("selective" if selective else "none")]
    return argv, megatron_spec_from_launch(launch)


def user_job(args: argparse.Namespace, seq_len: int, world: int, gpus_per_node: int):
    """The Job the user's files describe; unreadable files raise InputError (exit 2), as does a bad Job."""
    from ..options import add_job_arguments, job_from_args

    argv = ["--model", args.model, "--seq", str(seq_len), "--gpus", str(world), "--gpus-per-node", str(gpus_per_node)]
    if args.ds_config:
        from ..dsconfig import load_ds_config

        load_ds_config(args.ds_config)  # unreadable or malformed: exit 2 before anything else
        argv += ["--ds-config", args.ds_config]
    megatron = None
    if args.launch_file:
        more, megatron = _launch_argv(args.launch_file)
        argv += more
    parser = argparse.ArgumentParser(add_help=False)
    add_job_arguments(parser)
    job = job_from_args(parser.parse_args(argv))
    if megatron is None:
        return job
    from ..specs import Job

    training = job.training.model_dump()
    training["megatron"] = megatron.model_dump()
    return Job.model_validate({"model": job.model.model_dump(), "training": training,
                               "layout": job.layout.model_dump()})


def user_verdict(args: argparse.Namespace, result: PlanResult) -> tuple[dict[str, Any], list[str]]:
    """(the --json object, the lines for the table) for the user's configuration."""
    space = result.space
    try:
        job = user_job(args, space.seq_len, space.world, space.gpus_per_node)
    except InputError as err:
        if err.field in ("ds-config", "--ds-config", "--launch-file", "--launch"):
            raise
        return {"runs": False, "problem": str(err)}, [f"[bold]your configuration[/] does not run: {err}"]
    cand = make_candidate(space, job, default_peak_fn()(job))
    faster = sum(1 for c in result.candidates if c.tokens_per_s > cand.tokens_per_s)
    out = {"runs": True, "fits": cand.fits, "misses": list(cand.misses), "candidate": candidate_dict(cand),
           "rank_by_tokens_per_s": faster + 1 if cand.fits else None, "of": len(result.candidates)}
    t, lay = job.training, job.layout
    what = (f"ZeRO-{t.zero.stage}, tp/pp/sp {lay.tp}/{lay.pp}/{lay.sp}, micro {t.micro_batch}×{t.grad_accum}, "
            f"{t.checkpointing} checkpointing, offload {t.zero.offload_optimizer}/{t.zero.offload_param}")
    if cand.fits:
        line = (f"[bold]your configuration[/] ({what}) fits and would rank #{faster + 1} of {len(result.candidates) + 1} "
                f"by tokens/s ({cand.tokens_per_s:,.0f})")
    else:
        line = (f"[bold]your configuration[/] ({what}) does not fit: misses {', '.join(cand.misses)} "
                f"(device total {cand.device_total_bytes / 2**30:.1f} GiB, host {cand.host_bytes_per_node / 1e9:.0f}"
                f" GB/node, NVMe {cand.nvme_bytes_per_node / 1e9:.0f} GB/node)")
    return out, [line]
