"""The Hugging Face Trainer's reading of a job request (--loop hf-trainer with a --ds-config, or --training-args).

The arguments come from the file (or transformers' defaults) with the job flags written in; the DeepSpeed config
from --ds-config (or the arguments' ``deepspeed``); "auto" is filled for the model and the world size as the
Trainer fills it (memplan.hf.job).
"""

from __future__ import annotations

from .errors import InputError
from .jobbuild import relabel
from .resolve import ARTICLE_GPUS, JobRequest, _explicit, default_gpu, is_article


def default_world(req: JobRequest) -> int:
    """--gpus, else the article's 8, else one node of the GPU's usual size."""
    from .nodes import DEFAULT_GPUS_PER_NODE, node_of

    if req.gpus is not None:
        return req.gpus
    if is_article(req.model):
        return ARTICLE_GPUS
    gpu, _ = default_gpu(req)
    node = node_of(gpu.name if gpu is not None else None)
    return node.gpus if node else DEFAULT_GPUS_PER_NODE


def trainer_job_of(req: JobRequest, model, num_training_steps: int | None = None):
    """memplan.hf.job.TrainerJob for the request, or None when the job does not run under the Trainer."""
    if req.training_args is not None and req.loop not in (None, "hf-trainer"):
        raise InputError("--training-args", f"describes transformers' Trainer; it needs --loop hf-trainer (given: "
                         f"--loop {req.loop})")
    if req.loop != "hf-trainer" and req.training_args is None:
        return None
    from .hf import job as hfjob
    from .hf.args import TrainingArgs, load_training_args

    targs = hfjob.with_job_flags(load_training_args(req.training_args) if req.training_args else TrainingArgs(),
                                 _explicit(req))
    ds_config = _trainer_ds_config(req, targs)
    if ds_config is None and req.training_args is None:
        return None  # --loop hf-trainer alone: only the loop changes (the Trainer's arguments were not given)
    job = hfjob.trainer_job(ds_config, targs, model=model, world=default_world(req),
                            num_training_steps=num_training_steps)
    hfjob.raise_first(job, "--training-args" if req.training_args else "TrainingArguments")
    return job


def _trainer_ds_config(req: JobRequest, targs) -> dict | None:
    """The DeepSpeed JSON the Trainer gets: --ds-config, else TrainingArguments.deepspeed (a dict or a path)."""
    from . import dsconfig
    from .inputs import MAX_INPUT_BYTES, check_regular

    path, flag = req.ds_config, "--ds-config"
    if path is None and isinstance(targs.deepspeed, dict):
        return targs.deepspeed
    if path is None and isinstance(targs.deepspeed, str):
        path, flag = targs.deepspeed, "--training-args deepspeed"
    if path is None:
        return None
    check_regular(path, flag, "JSON file", MAX_INPUT_BYTES)
    try:
        return dsconfig.load_ds_config(path)
    except InputError as err:
        raise relabel(err, flag) from None


__all__ = ["default_world", "trainer_job_of"]
