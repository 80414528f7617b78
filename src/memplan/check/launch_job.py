"""The Job fields a launch line sets, as its launcher and (for Megatron-DeepSpeed) pretrain_gpt.py read them.

Every command that reads a launch line (check, plan's --launch-file) goes through ``launch_fields``; the
values carry the flag they came from, so that sources and errors name it. Megatron-DeepSpeed facts
(microsoft/Megatron-DeepSpeed f4157bea):

- layout: --tensor-model-parallel-size, --pipeline-model-parallel-size (1 with --no-pipeline-parallel:
  validate_args asserts it), --ds-sequence-parallel-size; --sequence-parallel only with tp > 1 (validate_args
  sets args.sequence_parallel = False at tp 1);
- batch: --micro-batch-size per rank; megatron/training.py train() calls
  ``model[0].set_train_batch_size(dp · micro · get_num_microbatches())`` every iteration, so DeepSpeed's
  gradient accumulation is Megatron's global batch / (micro · dp) whatever the JSON says (the global batch is
  --global-batch-size, else micro · dp: validate_args);
- optimizer: setup_model_and_optimizer always passes get_megatron_optimizer's optimizer to
  deepspeed.initialize, so the JSON's "optimizer" is never built: DeepSpeedCPUAdam with --cpu-optimizer,
  apex FusedAdam (AdamW: weight decay decoupled) by default, FusedSGD with --optimizer sgd;
- recompute: --checkpoint-activations / --recompute-granularity full → full; --recompute-activations /
  --recompute-granularity selective → selective; flash: any --use-flash-attn* flag (else CoreAttention, the
  unfused softmax path memplan calls eager).
"""

from __future__ import annotations

from typing import Any

from ..errors import InputError
from .launch import Launch, launch_world, launcher_int, script_int

#: Megatron-DeepSpeed's flash-attention flags (megatron/arguments.py _add_training_args)
FLASH_FLAGS = ("--use-flash-attn-v2", "--use-flash-attn", "--use-flash-attn-v1", "--use-flash-attn-triton",
               "--use-flash-attn-builder")


def per_node(launch: Launch) -> int | None:
    """GPUs per node the launcher starts: deepspeed --num_gpus (> 0), torchrun --nproc-per-node (a number),
    accelerate --num_processes / --num_machines."""
    o = launch.launcher_options
    if launch.launcher == "deepspeed":
        gpus = launcher_int(launch, "--num_gpus")
        return gpus if gpus and gpus > 0 else None
    if launch.launcher == "torchrun":
        text = o.get("--nproc-per-node") or o.get("--nproc_per_node")
        return int(text) if text and text.strip().isdigit() and int(text) > 0 else None
    if launch.launcher == "accelerate":
        total, machines = launcher_int(launch, "--num_processes"), launcher_int(launch, "--num_machines")
        return total // machines if total and machines and total % machines == 0 else None
    return None


def checkpointing_of(launch: Launch) -> str:
    granularity = launch.script_value("--recompute-granularity")
    if launch.has("--checkpoint-activations") or granularity == "full":
        return "full"
    if launch.has("--recompute-activations") or granularity == "selective":
        return "selective"
    return "none"


def megatron_optimizer(launch: Launch) -> str:
    """The optimizer get_megatron_optimizer builds (memplan's name)."""
    if launch.has("--cpu-optimizer"):
        return "cpu_adam"
    return "sgd" if launch.script_value("--optimizer") == "sgd" else "adamw"


#: TRL's ModelConfig (trl/trainer/model_config.py, read by TrlParser from the script's flags; get_peft_config turns
#: it into peft's LoraConfig): --use_peft, --lora_r (16), --lora_dropout (0.05), --lora_target_modules (nargs "+";
#: peft's default for the model type when absent), --lora_modules_to_save, --use_rslora, --use_dora
TRL_LORA_DEFAULTS = {"rank": 16, "dropout": 0.05}
#: every ModelConfig adapter flag: read here, or (alpha, task type) read and without effect on memory
TRL_PEFT_FLAGS = ("--use_peft", "--lora_r", "--lora_dropout", "--lora_target_modules", "--lora_modules_to_save",
                  "--use_rslora", "--use_dora", "--lora_alpha", "--lora_task_type")
_TRUE, _FALSE = ("yes", "true", "t", "y", "1"), ("no", "false", "f", "n", "0")  # transformers' string_to_bool


def _trl_bool(launch: Launch, flag: str) -> bool:
    value = launch.script_value(flag)
    if value is None:
        return False
    if value == "" or value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise InputError(f"{launch.source} {flag}", f"{value!r} is not a boolean; allowed: true or false (or the flag alone)")


def trl_lora(launch: Launch) -> dict[str, Any] | None:
    """The adapter a TRL script's --use_peft line trains (None without --use_peft), as LoraSpec fields."""
    if not _trl_bool(launch, "--use_peft"):
        return None
    rank = script_int(launch, "--lora_r")
    dropout = launch.script_value("--lora_dropout")
    lora: dict[str, Any] = {"rank": TRL_LORA_DEFAULTS["rank"] if rank is None else rank,
                            "targets": launch.script_list("--lora_target_modules") or ("default",),
                            "dropout": TRL_LORA_DEFAULTS["dropout"]}
    if dropout is not None:
        try:
            lora["dropout"] = float(dropout)
        except ValueError:
            raise InputError(f"{launch.source} --lora_dropout", f"{dropout!r} is not a number; allowed: a "
                             "probability in [0, 1)") from None
    save = launch.script_list("--lora_modules_to_save")
    if save:
        lora["modules_to_save"] = save
    lora["use_rslora"], lora["use_dora"] = _trl_bool(launch, "--use_rslora"), _trl_bool(launch, "--use_dora")
    return lora


def launch_fields(launch: Launch, megatron: bool) -> dict[str, tuple[Any, str]]:
    """Job field → (value, the flag it came from) for what the line says. ``global_batch`` (Megatron's) is not a
    Job field: the resolver turns it into grad_accum once dp is known."""
    out: dict[str, tuple[Any, str]] = {}
    world = launch_world(launch)
    if world is not None:
        out["world"] = (world, "--num_gpus" if launch.launcher == "deepspeed" else "launcher")
    node = per_node(launch)
    if node is not None:
        out["gpus_per_node"] = (node, "--num_gpus" if launch.launcher == "deepspeed" else "launcher")
    if not megatron:
        lora = trl_lora(launch)
        if lora is not None:
            out["lora"] = (lora, "--use_peft")
        return out
    for flag, field in (("--tensor-model-parallel-size", "tp"), ("--pipeline-model-parallel-size", "pp"),
                        ("--ds-sequence-parallel-size", "sp"), ("--micro-batch-size", "micro_batch"),
                        ("--seq-length", "seq_len"), ("--global-batch-size", "global_batch")):
        value = script_int(launch, flag)
        if value is not None:
            out[field] = (value, flag)
    if launch.has("--no-pipeline-parallel"):
        out["pp"] = (1, "--no-pipeline-parallel")
    if launch.has("--sequence-parallel") and out.get("tp", (1,))[0] > 1:
        out["tp_sequence_parallel"] = (True, "--sequence-parallel")
    from ..megatron.launch import megatron_spec_from_launch

    out["model_impl"] = ("megatron", launch.script or "pretrain_gpt.py")
    out["megatron"] = (megatron_spec_from_launch(launch), "megatron flags")
    out["checkpointing"] = (checkpointing_of(launch), "--checkpoint-activations / --recompute-granularity")
    out["attention"] = ("flash" if any(launch.has(f) for f in FLASH_FLAGS) else "eager", "--use-flash-attn-v2")
    out["optimizer"] = (megatron_optimizer(launch), "--cpu-optimizer / --optimizer")
    return out


__all__ = ["FLASH_FLAGS", "TRL_PEFT_FLAGS", "checkpointing_of", "launch_fields", "megatron_optimizer", "per_node", "trl_lora"]
