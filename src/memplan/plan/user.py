"""The user's own configuration (`--ds-config`, `--launch-file`): where it ranks, or why it does not fit.

The Job is resolved as every command resolves one (memplan.resolve: the files' values, DeepSpeed's defaults
for what --ds-config leaves out, a Megatron-DeepSpeed line's layout, batch, recompute, attention, optimizer and
Megatron flags read by memplan.check.launch_job), with the plan's model, world and GPUs per node, and the plan's
sequence length unless the line says. Nothing from the article's job fills a gap the files leave. So a row
that `plan --emit` wrote reads back as the same Job. Its rank is by tokens per second, since its global batch
may differ from the plan's.
"""

from __future__ import annotations

from typing import Any

from ..errors import InputError
from .candidate import PlanResult, make_candidate
from .render import candidate_dict
from .search import default_peak_fn


def read_user_files(ds_config: str | None, launch_file: str | None):
    """Read and check the user's files before anything else: a malformed or refused --ds-config or
    --launch-file is an InputError (exit 2). Returns the parsed launch line (None without --launch-file)."""
    launch = None
    if launch_file is not None:
        from ..check.launch import parse_launch, read_launch_file

        launch = parse_launch(read_launch_file(launch_file, "--launch-file"), "--launch-file")
    if ds_config:
        from ..check.rules_job import is_megatron
        from ..dsconfig import ds_settings, load_ds_config

        cfg = load_ds_config(ds_config, flag="--ds-config")
        if launch is not None and is_megatron(launch):  # Megatron passes its own optimizer: the section is not read
            cfg = {k: v for k, v in cfg.items() if k != "optimizer"}
        try:
            ds_settings(cfg)  # values DeepSpeed refuses: exit 2 too
        except InputError as err:
            raise InputError(f"--ds-config {err.field}", err.message) from None
    return launch


def user_job(model: str | None, space, ds_config: str | None, launch):
    """The ResolvedJob the user's files describe on the plan's model, world and (unless the line says) seq."""
    from ..resolve import JobRequest, resolve_job

    seq = None if launch is not None and launch.script_value("--seq-length") is not None else space.seq_len
    return resolve_job(JobRequest(model=model, ds_config=ds_config, launch=launch, gpus=space.world,
                                  gpus_per_node=space.gpus_per_node, seq=seq))


def user_verdict(result: PlanResult, model: str | None, ds_config: str | None, launch
                 ) -> tuple[dict[str, Any], list[str]]:
    """(the --json object, the lines for the table) for the user's configuration."""
    space = result.space
    try:
        resolved = user_job(model, space, ds_config, launch)
    except InputError as err:
        return {"runs": False, "problem": str(err)}, [f"[bold]your configuration[/] does not run: {err}"]
    from ..sources import sources_json

    job = resolved.job
    cand = make_candidate(space, job, default_peak_fn()(job))
    faster = sum(1 for c in result.candidates if c.tokens_per_s > cand.tokens_per_s)
    out = {"runs": True, "fits": cand.fits, "misses": list(cand.misses), "candidate": candidate_dict(cand),
           "rank_by_tokens_per_s": faster + 1 if cand.fits else None, "of": len(result.candidates),
           "sources": sources_json(resolved.sources)}
    t, lay = job.training, job.layout
    what = (f"ZeRO-{t.zero.stage}, tp/pp/sp {lay.tp}/{lay.pp}/{lay.sp}, micro {t.micro_batch}×{t.grad_accum}, "
            f"{t.checkpointing} checkpointing, offload {t.zero.offload_optimizer}/{t.zero.offload_param}, "
            f"{t.model_impl}")
    if cand.fits:
        line = (f"[bold]your configuration[/] ({what}) fits and would rank #{faster + 1} of {len(result.candidates) + 1} "
                f"by tokens/s ({cand.tokens_per_s:,.0f})")
    else:
        line = (f"[bold]your configuration[/] ({what}) does not fit: misses {', '.join(cand.misses)} "
                f"(device total {cand.device_total_bytes / 2**30:.1f} GiB, host {cand.host_bytes_per_node / 2**30:.0f}"
                f" GiB/node, NVMe {cand.nvme_bytes_per_node / 2**30:.0f} GiB/node)")
    return out, [line]


__all__ = ["read_user_files", "user_job", "user_verdict"]
