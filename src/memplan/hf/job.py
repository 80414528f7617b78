"""The Trainer's part of a job: TrainingArguments, a DeepSpeed JSON, the model and the world → job fields.

``trainer_job`` fills the config's "auto" (memplan.hf.autofill) and lists the TrainingSpec fields the Trainer
decides: the loop, gradient checkpointing and its kwargs (Trainer.train pops every_n_layers and offload from
gradient_checkpointing_kwargs and passes the rest to gradient_checkpointing_enable), and the optimizer that
results (the config's optimizer section, which DeepSpeed builds, or the Trainer's own ``optim``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import InputError
from ..specs import ModelSpec
from .args import TrainingArgs, build_args
from .autofill import AutoFill, HiddenSize, Problem, fill_auto

#: what the Trainer hands DeepSpeed (autofill.TRAINER_OPTIMIZERS, after accelerate's offload mapping) →
#: memplan's optimizer
CLIENT_OPTIMIZERS = {"torch.optim.AdamW": "torch_adamw", "torch.optim.AdamW(fused=True)": "torch_adamw_fused",
                     "torch.optim.SGD": "sgd", "deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=True)": "cpu_adam",
                     "deepspeed.ops.adam.DeepSpeedCPUAdam(adamw_mode=False)": "cpu_adam"}
#: memplan's --optimizer → TrainingArguments.optim (the Trainer's own optimizers memplan models)
OPTIM_OF_FLAG = {"torch_adamw": "adamw_torch", "torch_adamw_fused": "adamw_torch_fused", "sgd": "sgd"}


def hidden_of_config(cfg: dict) -> HiddenSize:
    """The hidden size of a model config (config.json keys): transformers' trainer_config_finalize takes
    config.hidden_size, else max(config.hidden_sizes), else the same two of config.text_config; accelerate's
    Accelerator._prepare_deepspeed takes only the first two."""
    def top(c: Any) -> int | None:
        if not isinstance(c, dict):
            return None
        if isinstance(c.get("hidden_size"), int):
            return c["hidden_size"]
        sizes = c.get("hidden_sizes")
        return max(sizes) if isinstance(sizes, list) and sizes and all(isinstance(x, int) for x in sizes) else None

    mine = top(cfg)
    return HiddenSize(trainer=mine if mine is not None else top(cfg.get("text_config")), accelerate=mine)


def hidden_for(model: ModelSpec | None) -> HiddenSize | None:
    """The model's hidden size for "auto" (None: no model given). A config with hidden_size under another
    name (GPT-2's n_embd, an attribute_map alias) is read as memplan reads it."""
    if model is None:
        return None
    try:
        from ..verify.hfbuild import hf_config_dict

        raw = hf_config_dict(model)
    except (OSError, ValueError):
        raw = {}
    if "hidden_size" not in raw and ("hidden_sizes" in raw or "text_config" in raw):
        return hidden_of_config(raw)
    return HiddenSize(model.hidden_size, model.hidden_size)


def with_job_flags(args: TrainingArgs, flags: dict[str, Any]) -> TrainingArgs:
    """memplan's job flags written into the TrainingArguments they stand for (the flags win, as a user editing
    the arguments would): --micro-batch, --grad-accum, --dtype, --checkpointing, --optimizer."""
    values = args.model_dump()
    label = {"per_device_train_batch_size": "--micro-batch", "gradient_accumulation_steps": "--grad-accum",
             "bf16": "--dtype", "fp16": "--dtype", "gradient_checkpointing": "--checkpointing", "optim": "--optimizer"}
    if flags.get("micro_batch") is not None:
        values["per_device_train_batch_size"] = flags["micro_batch"]
    if flags.get("grad_accum") is not None:
        values["gradient_accumulation_steps"] = flags["grad_accum"]
    if flags.get("dtype") is not None:
        values.update(bf16=flags["dtype"] == "bf16", fp16=flags["dtype"] == "fp16")
    checkpointing = flags.get("checkpointing")
    if checkpointing == "selective":
        raise InputError("--checkpointing", "the Trainer checkpoints whole layers only (gradient_checkpointing); "
                         "allowed with --loop hf-trainer: none, full")
    if checkpointing is not None:
        values["gradient_checkpointing"] = checkpointing == "full"
    optimizer = flags.get("optimizer")
    if optimizer is not None:
        if optimizer not in OPTIM_OF_FLAG:
            raise InputError("--optimizer", f"{optimizer} is DeepSpeed's: under the Trainer it comes from the "
                             "--ds-config optimizer section; allowed with --loop hf-trainer: "
                             + ", ".join(OPTIM_OF_FLAG) + " (the Trainer's own optim)")
        values["optim"] = OPTIM_OF_FLAG[optimizer]
    return build_args(values, lambda f: label.get(f, f"--training-args {f}"))


@dataclass
class TrainerJob:
    """What the Trainer makes of the inputs."""

    args: TrainingArgs
    ds_config: dict | None  # the DeepSpeed JSON as given ("auto" and all)
    fill: AutoFill | None  # None: no DeepSpeed config (the Trainer without --deepspeed)
    fields: dict[str, Any] = field(default_factory=dict)  # TrainingSpec fields the Trainer decides
    problems: list[Problem] = field(default_factory=list)  # what stops the launch
    notes: list[str] = field(default_factory=list)


def _sgd_momentum(args: TrainingArgs) -> float:
    """momentum from optim_args (trainer_optimizer._get_sgd: torch.optim.SGD, momentum 0 unless given)."""
    for item in (args.optim_args or "").replace(" ", "").split(","):
        key, _, value = item.partition("=")
        if key == "momentum":
            try:
                return float(value)
            except ValueError:
                return 0.0
    return 0.0


def _optimizer(args: TrainingArgs, fill: AutoFill | None, problems: list[Problem]) -> str | None:
    """memplan's optimizer for the Trainer's own (None: the config's optimizer section decides)."""
    if fill is not None and fill.optimizer_source == "config":
        return None
    from .autofill import TRAINER_OPTIMIZERS

    client = fill.client_optimizer if fill is not None else TRAINER_OPTIMIZERS.get(args.optim, args.optim)
    name = CLIENT_OPTIMIZERS.get(client)
    if name == "sgd" and not _sgd_momentum(args):
        problems.append(Problem("optim_args", "the Trainer's sgd is torch.optim.SGD without momentum (no state); "
                                "memplan models momentum SGD: pass optim_args momentum=0.9", "memplan"))
        return None
    if name is None:
        problems.append(Problem("optim", f"memplan models the Trainer's optimizers {', '.join(OPTIM_OF_FLAG.values())}"
                                f" (or DeepSpeedCPUAdam under optimizer offload), not {args.optim}",
                                "transformers Trainer.create_optimizer"))
    return name


def _fields(args: TrainingArgs, fill: AutoFill | None, problems: list[Problem]) -> dict[str, Any]:
    out: dict[str, Any] = {"loop": "hf-trainer", "checkpointing": "full" if args.gradient_checkpointing else "none"}
    if args.gradient_checkpointing:
        kwargs, every, offload = args.checkpoint_kwargs()
        # torch.utils.checkpoint.checkpoint: use_reentrant None → True (with a warning), torch 2.x
        out.update(checkpoint_reentrant=bool(kwargs.get("use_reentrant", True)), checkpoint_every_n_layers=every,
                   checkpoint_offload=bool(offload))
    optimizer = _optimizer(args, fill, problems)
    if optimizer is not None:
        out["optimizer"] = optimizer
    if fill is None:  # no DeepSpeed config: the arguments alone
        out.update(micro_batch=args.per_device_train_batch_size, grad_accum=args.gradient_accumulation_steps,
                   dtype={"bf16": "bf16", "fp16": "fp16"}.get(args.mixed_precision, "fp32"))
    return out


def _notes(args: TrainingArgs, fill: AutoFill | None) -> list[str]:
    out = []
    if args.dataloader_pin_memory:
        out.append("dataloader_pin_memory: each batch is copied through pinned host memory (DataLoader pin_memory)")
    if args.torch_empty_cache_steps:
        out.append(f"torch_empty_cache_steps {args.torch_empty_cache_steps}: training_step empties the allocator's "
                   "cache every that many steps (reserved memory drops back to allocated)")
    if args.auto_find_batch_size:
        out.append("auto_find_batch_size: after an OOM accelerate's find_executable_batch_size halves the batch and "
                   "retries; the figure is for the first attempt")
    if fill is not None and fill.unresolved:
        out.append("left unresolved (their input is unknown): " + ", ".join(fill.unresolved))
    return out


def trainer_job(ds_config: dict | None, args: TrainingArgs, *, model: ModelSpec | None, world: int | None,
                num_training_steps: int | None = None, mixed_precision_env: str = "no") -> TrainerJob:
    """The Trainer's part of the job. ``num_training_steps``: None → args.max_steps when > 0 (else unknown)."""
    steps = num_training_steps if num_training_steps is not None else (args.max_steps if args.max_steps > 0 else None)
    fill = None
    if ds_config is not None:
        fill = fill_auto(ds_config, args, world=world, hidden=hidden_for(model), num_training_steps=steps,
                         mixed_precision_env=mixed_precision_env)
    problems = [] if fill is None else [mismatch_problem(m) for m in fill.mismatches] + list(fill.problems)
    fields = _fields(args, fill, problems)
    return TrainerJob(args=args, ds_config=ds_config, fill=fill, fields=fields, problems=problems,
                      notes=_notes(args, fill))


def mismatch_problem(m) -> Problem:
    """A mismatch as the problem it is: transformers raises at Trainer.train (trainer_config_finalize)."""
    return Problem(m.key, f"{m.ds_value} contradicts TrainingArguments {m.hf_key} = {m.hf_value}: "
                   f"trainer_config_finalize raises 'Please correct the following DeepSpeed config values that "
                   f"mismatch TrainingArguments values: {m.line}'; allowed: \"auto\" or {m.hf_value}",
                   "transformers trainer_config_finalize")


#: problems that stop the launch but leave the memory question answered (estimate goes on; check reports them)
NOT_MEMORY = ("scheduler.params.warmup_num_steps",)


#: problem subjects that are TrainingArguments fields (every other subject is a DeepSpeed config key)
ARGS_KEYS = ("optim", "optim_args")


def problem_label(p: Problem, args_label: str, ds_label: str = "--ds-config") -> str:
    """The name a user knows for a problem's subject: a TrainingArguments field, or a DeepSpeed config key."""
    return f"{args_label} {p.key}" if p.key in ARGS_KEYS else f"{ds_label} {p.key}"


def raise_first(job: TrainerJob, args_label: str) -> None:
    """The first problem that leaves the job's memory undefined, as an InputError."""
    for p in job.problems:
        if p.key not in NOT_MEMORY:
            raise InputError(problem_label(p, args_label), p.message)


def verify_task(job: TrainerJob | None, args_label: str, loop: str) -> dict | None:
    """What memplan verify's worker needs to run the real Trainer (None: not the Trainer path): the arguments,
    the DeepSpeed JSON as given (the Trainer fills it itself) and memplan's filled config, to compare. A job the
    Trainer would refuse is refused here, before any GPU time is spent."""
    if job is None and loop != "hf-trainer":
        return None
    if job is None or job.fill is None:
        raise InputError("--ds-config", "verify runs transformers' Trainer with --deepspeed: give the DeepSpeed "
                         "JSON (for example examples/hf-trainer/ds_config_zero3.json)")
    for p in job.problems:
        raise InputError(problem_label(p, args_label), f"{p.message} ({p.raised_by}); the Trainer would stop there")
    return {"training_args": job.args.model_dump(mode="json"), "deepspeed": job.ds_config, "ds_config": job.fill.config}


__all__ = ["TrainerJob", "hidden_for", "hidden_of_config", "problem_label", "raise_first", "trainer_job",
           "verify_task", "with_job_flags"]
