"""Rules for a transformers Trainer launch (``--loop hf-trainer``, ``--training-args``, or a line with Trainer flags).

The Trainer fills the DeepSpeed config's "auto" before DeepSpeed sees it (memplan.hf.autofill replays
transformers 5.17 / accelerate 1.15); what stops that launch is reported here, and the filled config is what
the DeepSpeed rules then read. Without the Trainer, "auto" reaches DeepSpeed as a string (rules_ds.auto_rules).
"""

from __future__ import annotations

from pathlib import Path

from ..hf.args import TrainingArgs
from ..hf.flags import has_trainer_flags, read_flags
from ..hf.job import TrainerJob, problem_label, trainer_job
from ..specs import ModelSpec
from .findings import Finding, error, info
from .launch import Launch, launch_world

#: what to do about each launch-stopper the Trainer path raises, by config key (default: write the value)
_FIXES = {
    "scheduler.params.warmup_num_steps": "pass --warmup_steps N (N >= 1, or a ratio in (0, 1)) to the Trainer, or "
                                         "write a positive warmup_num_steps; the docs' zero2/zero3 templates hit "
                                         "this with the Trainer's default warmup_steps 0",
    "zero_optimization": "add a zero_optimization section (even {\"stage\": 0})",
    "optim": "use adamw_torch or adamw_torch_fused, or an optimizer section in the DeepSpeed config",
    "optim_args": "pass --optim_args momentum=0.9",
}


def is_trainer_launch(launch: Launch | None, megatron: bool, loop: str | None, training_args) -> bool:
    """The Trainer path: --loop hf-trainer, or (no --loop) --training-args or a line with Trainer flags."""
    if loop is not None:
        return loop == "hf-trainer"
    return training_args is not None or (launch is not None and not megatron and has_trainer_flags(launch.script_args))


def trainer_reading(cfg: dict, launch: Launch | None, model: ModelSpec | None, gpus: int | None, megatron: bool,
                    loop: str | None, training_args: TrainingArgs | None,
                    ds_path: str | None = None) -> tuple[TrainerJob | None, list[Finding]]:
    """The Trainer's reading of the launch (None when it is not a Trainer launch) and its findings.

    A Trainer flag with a bad value (--per_device_train_batch_size 0) is an InputError naming the flag."""
    if not is_trainer_launch(launch, megatron, loop, training_args):
        out = []
        if launch is not None and loop is not None and has_trainer_flags(launch.script_args):
            out.append(info("--loop", f"the line has Trainer flags, but --loop {loop} says the script is not the "
                            "Trainer: they are not read", "pass --loop hf-trainer if it is"))
        return None, out
    findings: list[Finding] = []
    args = training_args
    if launch is not None:
        reading = read_flags(launch.script_args, base=training_args)
        args = reading.args
        from .launch_job import trl_lora

        lora = trl_lora(launch)
        findings += _flag_findings(reading, ds_path, lora)
        findings += _peft_findings(lora, model)
    world = gpus or (launch_world(launch) if launch is not None else None)
    mixed = (launch.launcher_options.get("--mixed_precision") or "no") if launch is not None and \
        launch.launcher == "accelerate" else "no"  # accelerate launch sets ACCELERATE_MIXED_PRECISION
    job = trainer_job(cfg, args or TrainingArgs(), model=model, world=world, mixed_precision_env=mixed)
    findings += job_findings(job, "--training-args" if training_args is not None and launch is None else
                             "TrainingArguments")
    if world is None:
        findings.append(info("train_batch_size", "the world size is not known (no --gpus, and the launch line does "
                             "not say): the Trainer's train_batch_size = world × per_device_train_batch_size × "
                             "gradient_accumulation_steps is left open", "pass --gpus N"))
    return job, findings



def _peft_findings(lora: dict | None, model: ModelSpec | None) -> list[Finding]:
    """What peft refuses in TRL's adapter flags (``lora``: launch_job.trl_lora's reading): a target module the
    model does not have (LoraModel _create_and_replace raises "Target modules ... not found in the base model")."""
    from ..params import linear_modules
    from ..peftconfig import check_adapter_options, resolve_targets

    if lora is None or model is None:
        return []
    try:
        resolve_targets(model.family, tuple(lora["targets"]), linear_modules(model))
    except ValueError as err:
        return [error("--lora_target_modules", f"peft refuses it: {err}",
                      "name linear modules of the model, or all-linear, or leave the flag out for peft's default")]
    try:
        check_adapter_options(model.family, tuple(lora["targets"]), float(lora.get("dropout", 0.0)))
    except ValueError as err:
        return [error("--lora_dropout", f"peft refuses it: {err}", "pass --lora_dropout 0")]
    return []


def _flag_findings(reading, ds_path: str | None, lora: dict | None = None) -> list[Finding]:
    from .launch_job import TRL_PEFT_FLAGS

    out = []
    script_own = [f for f in reading.not_trainer if lora is None or f not in TRL_PEFT_FLAGS]
    if lora is not None:
        targets = ", ".join(lora["targets"]).replace("default", "peft's default for the model type")
        out.append(info("--use_peft", f"TRL's ModelConfig: a LoRA adapter of rank {lora['rank']} on {targets}, dropout "
                        f"{lora['dropout']:g} (trl get_peft_config → peft LoraConfig); the estimate trains it on a "
                        "frozen base", ""))
    if script_own:
        out.append(info(", ".join(script_own), "not TrainingArguments flags (the script's own arguments): "
                        "memplan did not use them", ""))
    if reading.not_memory:
        out.append(info(", ".join(reading.not_memory), "TrainingArguments flags that do not change memory or the "
                        "DeepSpeed config: read, not used", ""))
    out += [info("launch", note, "spell the flag out") for note in reading.notes]
    if reading.deepspeed and ds_path and Path(reading.deepspeed).name != Path(ds_path).name:
        out.append(info("--deepspeed", f"the line passes --deepspeed {reading.deepspeed}, but --ds-config is "
                        f"{ds_path}: memplan checks --ds-config", "check the file the line passes"))
    return out


def job_findings(job: TrainerJob, args_label: str) -> list[Finding]:
    """What stops the Trainer's launch (errors), what it filled and what else it decides (info)."""
    out = []
    for p in job.problems:
        subject = problem_label(p, args_label, "")
        out.append(error(subject.strip(), f"{p.message} ({p.raised_by})",
                         _FIXES.get(p.key, "write \"auto\" or the value the arguments give")))
    if job.fill is not None and job.fill.filled:
        shown = ", ".join(f"{k}={v}" for k, v in job.fill.filled.items())
        out.append(info("auto", f"filled as the Trainer fills it (transformers trainer_config_process / "
                        f"trainer_config_finalize, accelerate _prepare_deepspeed): {shown}", ""))
    if job.fill is not None and job.fill.client_optimizer:
        out.append(info("optimizer", f"no optimizer section: the Trainer's optim {job.args.optim} is handed to "
                        f"DeepSpeed as {job.fill.client_optimizer} (zero_allow_untested_optimizer set)", ""))
    out += [info("TrainingArguments", note, "") for note in job.notes]
    return out


__all__ = ["is_trainer_launch", "job_findings", "trainer_reading"]
