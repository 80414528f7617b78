"""The DeepSpeed config a Job stands for: `to_ds_config(job) -> dict` (pure, no torch).

`memplan verify` trains with exactly this dict, so it is the written-out meaning of a Job. Every field of
ZeroSpec is written explicitly (even where it equals DeepSpeed 0.19.8's default) so that a measured row
never depends on a default that may drift between DeepSpeed versions.

Optimizer mapping (DeepSpeed 0.19.8 runtime/engine.py, DeepSpeedEngine._configure_basic_optimizer and
get_optimizer_configuration):

- adamw       → {"type": "AdamW"}: deepspeed.ops.adam.FusedAdam(adam_w_mode=True), a JIT-built op.
- torch_adamw → {"type": "AdamW", "params": {"torch_adam": true}}: torch.optim.AdamW (foreach default).
- cpu_adam    → {"type": "AdamW"} with offload_optimizer: DeepSpeedCPUAdam (engine picks it whenever the
  optimizer is offloaded; fp32 states).
- sgd         → {"type": "SGD", "params": {"lr", "momentum": 0.9}}: not a DeepSpeed optimizer name, so the
  engine falls back to getattr(torch.optim, "SGD"); one fp32 momentum buffer per parameter. ZeRO needs
  "zero_allow_untested_optimizer": true for it.
- lion        → {"type": "Lion"}: deepspeed.ops.lion.FusedLion (DeepSpeedCPULion when offloaded).
"""

from __future__ import annotations

from typing import Any

from .errors import InputError
from .optimizers import optimizer_problem
from .specs import Job, ZeroSpec

#: learning rate of every emitted optimizer; memory does not depend on it
LEARNING_RATE = 1e-5
#: SGD momentum: non-zero so that SGD keeps one state per parameter (torch.optim.SGD momentum_buffer)
SGD_MOMENTUM = 0.9
#: fp16 dynamic loss scale starts at 2**16 (DeepSpeed's own default initial_scale_power is 16 too)
FP16_INITIAL_SCALE_POWER = 16
#: where nvme offload swaps to on the measuring machine
NVME_PATH = "/tmp/memplan_nvme"
#: DeepSpeed prints every steps_per_print steps; effectively never
STEPS_PER_PRINT = 10**9
#: gradient clipping on, as in a real recipe (it adds the grad-norm scratch DeepSpeed allocates)
GRADIENT_CLIPPING = 1.0


def _offload(device: str, pin_memory: bool) -> dict[str, Any]:
    """One offload_* section; nvme needs a swap path (DeepSpeedZeroOffload*Config.nvme_path)."""
    out: dict[str, Any] = {"device": device, "pin_memory": pin_memory}
    if device == "nvme":
        out["nvme_path"] = NVME_PATH
    return out


def zero_section(zero: ZeroSpec) -> dict[str, Any]:
    """zero_optimization with every ZeroSpec field written out; overlap_comm resolved as DeepSpeed does."""
    return {
        "stage": zero.stage,
        "reduce_bucket_size": zero.reduce_bucket_size,
        "allgather_bucket_size": zero.allgather_bucket_size,
        "overlap_comm": zero.overlap,
        "contiguous_gradients": zero.contiguous_gradients,
        "stage3_prefetch_bucket_size": zero.stage3_prefetch_bucket_size,
        "stage3_param_persistence_threshold": zero.stage3_param_persistence_threshold,
        "stage3_max_live_parameters": zero.stage3_max_live_parameters,
        "stage3_max_reuse_distance": zero.stage3_max_reuse_distance,
        "sub_group_size": zero.sub_group_size,
        "offload_optimizer": _offload(zero.offload_optimizer, zero.pin_memory),
        "offload_param": _offload(zero.offload_param, zero.pin_memory),
    }


def optimizer_section(job: Job) -> dict[str, Any]:
    """The "optimizer" section for the job's optimizer (see the module docstring for the mapping)."""
    t = job.training
    name = t.optimizer
    problem = optimizer_problem(name, t.zero.offload_optimizer)  # memplan.optimizers: the one rule
    if problem:
        raise InputError("optimizer", problem)
    if name == "torch_adamw" and t.zero.offload_optimizer != "none":
        raise InputError(
            "optimizer", "torch_adamw cannot be offloaded (DeepSpeed forces DeepSpeedCPUAdam); use adamw or cpu_adam"
        )
    if name in ("adamw", "cpu_adam"):
        return {"type": "AdamW", "params": {"lr": LEARNING_RATE}}
    if name == "torch_adamw":
        return {"type": "AdamW", "params": {"lr": LEARNING_RATE, "torch_adam": True}}
    if name == "sgd":
        return {"type": "SGD", "params": {"lr": LEARNING_RATE, "momentum": SGD_MOMENTUM}}
    if name == "lion":
        return {"type": "Lion", "params": {"lr": LEARNING_RATE}}
    raise InputError("optimizer", f"unknown optimizer {name!r}; use adamw, torch_adamw, cpu_adam, sgd or lion")


def to_ds_config(job: Job) -> dict[str, Any]:
    """The DeepSpeed config dict `memplan verify` trains ``job`` with (a fresh dict per call)."""
    t, lay = job.training, job.layout
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.micro_batch * t.grad_accum * lay.dp,
        "bf16": {"enabled": t.dtype == "bf16"},
        "fp16": {"enabled": t.dtype == "fp16"},
        "zero_optimization": zero_section(t.zero),
        "optimizer": optimizer_section(job),
        "gradient_clipping": GRADIENT_CLIPPING,
        "steps_per_print": STEPS_PER_PRINT,
        "wall_clock_breakdown": False,
        "memory_breakdown": False,
    }
    if t.dtype == "fp16":
        cfg["fp16"].update(loss_scale=0, initial_scale_power=FP16_INITIAL_SCALE_POWER)
    if t.optimizer == "sgd" and t.zero.stage > 0:
        cfg["zero_allow_untested_optimizer"] = True
    if lay.sp > 1:
        cfg["sequence_parallel_size"] = lay.sp
        cfg["seq_parallel_communication_data_type"] = t.sp_comm_dtype
    if lay.tp > 1:
        # DeepSpeed 0.19.8 training AutoTP (runtime/tensor_parallel/config.py TPTrainingConfig.autotp_size).
        # deepspeed.initialize parses the config before AutoTP builds its (dp, tp) mesh, with no mpu: the batch
        # check (runtime/config.py DeepSpeedConfig._batch_assertion) then counts every rank as data parallel,
        # so train_batch_size must be micro · accum · world / sp, not · dp
        cfg["tensor_parallel"] = {"autotp_size": lay.tp}
        cfg["train_batch_size"] = t.micro_batch * t.grad_accum * lay.dp * lay.tp
    if t.grad_accum_dtype is not None:
        cfg["data_types"] = {"grad_accum_dtype": t.grad_accum_dtype}
    return cfg
