"""The user's own configuration (`--ds-config`, `--launch-file`): where it ranks, or why it does not fit.

The Job is built the way `memplan estimate` builds it (memplan.options: --ds-config values over DeepSpeed's
defaults), with the layout flags of a Megatron-DeepSpeed launch line on top (read by memplan.check.launch, with
its bounds). Nothing from the seed's scenario fills a gap the files leave: without --ds-config the specs' own
defaults stand (sp 1, not the seed's 8).
Its rank is by tokens per second, since its global batch may differ from the plan's.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import InputError
from .render import candidate_dict
from .search import PlanResult, default_peak_fn, make_candidate

#: Megatron-DeepSpeed pretrain_gpt.py flags (megatron/arguments.py) → the Job field they set
LAUNCH_FIELDS = {
    "--tensor-model-parallel-size": "tp",
    "--pipeline-model-parallel-size": "pp",
    "--ds-sequence-parallel-size": "sp",
    "--micro-batch-size": "micro_batch",
    "--seq-length": "seq",
}
#: memplan's flag for each field, as job_from_args names it in an error
_FLAG_OF = {"tp": "--tp", "pp": "--pp", "sp": "--sp", "micro_batch": "--micro-batch", "seq": "--seq"}


#: Megatron-DeepSpeed's flash-attention flags (megatron/arguments.py _add_training_args)
_FLASH_FLAGS = ("--use-flash-attn-v2", "--use-flash-attn", "--use-flash-attn-v1", "--use-flash-attn-triton",
                "--use-flash-attn-builder")


def launch_values(path: str) -> dict[str, Any]:
    """The Job fields a launch file sets (LAUNCH_FIELDS), each an integer in bounds (memplan.check.launch:
    the same reader and bounds as `memplan check`); a flag the line does not give is simply absent. A
    Megatron-DeepSpeed line also sets model_impl "megatron", its attention and checkpointing, and "megatron"
    (its MegatronSpec, memplan.megatron.launch)."""
    from ..check.launch import parse_launch, read_launch_file, script_int
    from ..check.rules_job import is_megatron

    launch = parse_launch(read_launch_file(path, "--launch-file"), "--launch-file")
    values: dict[str, Any] = {field: script_int(launch, flag) for flag, field in LAUNCH_FIELDS.items()}
    if launch.has("--no-pipeline-parallel"):
        values["pp"] = 1  # Megatron-DeepSpeed builds a plain module (validate_args asserts pp == 1 then)
    values = {k: v for k, v in values.items() if v is not None}
    if is_megatron(launch):
        from ..megatron.launch import megatron_spec_from_launch

        granularity = launch.script_value("--recompute-granularity")
        full = launch.has("--checkpoint-activations") or granularity == "full"
        selective = launch.has("--recompute-activations") or granularity == "selective"
        values.update(model_impl="megatron",
                      attention="flash" if any(launch.has(f) for f in _FLASH_FLAGS) else "eager",
                      checkpointing="full" if full else ("selective" if selective else "none"),
                      megatron=megatron_spec_from_launch(launch))
    return values


def read_user_files(args: argparse.Namespace) -> dict[str, Any]:
    """Read and check the user's files before anything else: a malformed or refused --ds-config or
    --launch-file is an InputError (exit 2). Returns the launch line's values (launch_values)."""
    if args.ds_config:
        from ..dsconfig import ds_settings, load_ds_config

        cfg = load_ds_config(args.ds_config, flag="--ds-config")
        try:
            ds_settings(cfg)  # values DeepSpeed refuses: exit 2 too
        except InputError as err:
            raise InputError(f"--ds-config {err.field}", err.message) from None
    return launch_values(args.launch_file) if args.launch_file else {}


def user_job(args: argparse.Namespace, seq_len: int, world: int, gpus_per_node: int,
             values: dict[str, Any] | None = None):
    """The Job the user's files describe: --ds-config's values (DeepSpeed's defaults for the rest), the launch
    line's layout on top, the plan's model, world and (unless the line says) sequence length. Nothing from the
    seed's scenario fills a gap: without --ds-config the specs' defaults stand (memplan.options, seed=False)."""
    from ..options import job_from_args

    values = dict(values or {})
    megatron = values.pop("megatron", None)
    fields = argparse.Namespace(model=args.model, seq=values.pop("seq", seq_len), gpus=world,
                                gpus_per_node=gpus_per_node, ds_config=args.ds_config, **values)
    job = job_from_args(fields, seed=False)
    if megatron is None:
        return job
    from ..specs import Job

    training = job.training.model_dump()
    training["megatron"] = megatron.model_dump()
    return Job.model_validate({"model": job.model.model_dump(), "training": training,
                               "layout": job.layout.model_dump()})  # validated: megatron's own checks apply


def _from_launch(err: InputError, values: dict[str, Any]) -> InputError:
    """An error about a field the launch line set, named by the launch line's flag."""
    for flag, field in LAUNCH_FIELDS.items():
        if field in values and err.field == _FLAG_OF[field]:
            return InputError(f"--launch-file {flag}", err.message)
    return err


def user_verdict(args: argparse.Namespace, result: PlanResult,
                 values: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
    """(the --json object, the lines for the table) for the user's configuration (``values``: what
    read_user_files returned, read again when not given)."""
    space = result.space
    values = read_user_files(args) if values is None else values
    try:
        job = user_job(args, space.seq_len, space.world, space.gpus_per_node, values)
    except InputError as err:
        err = _from_launch(err, values)
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
