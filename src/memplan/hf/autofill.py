"""The "auto" values of a DeepSpeed config, filled exactly as the Trainer + Accelerate fill them.

``fill_auto`` replays, in the order they run, the steps between ``TrainingArguments(deepspeed=...)`` and
``deepspeed.initialize`` (transformers 5.17.0, accelerate 1.15.0, deepspeed 0.19.8):

1. TrainingArguments.__post_init__ → HfTrainerDeepSpeedConfig.trainer_config_process
   (transformers/integrations/deepspeed.py): the batch fields, gradient_clipping, the optimizer's lr / betas /
   eps / weight_decay, the scheduler's warmup_min_lr / warmup_max_lr, fp16 / bf16 from the arguments; a
   value that is not "auto" and differs is a mismatch.
2. DeepSpeedPlugin.__post_init__ (accelerate/utils/dataclasses.py): gradient_accumulation_steps defaults to
   1, a config without zero_optimization is refused, the plugin's own defaults fill "auto" in
   zero_optimization.stage (2), the offload devices ("none") and stage3_gather_16bit_weights_on_model_save
   (False).
3. AcceleratorState → DeepSpeedPlugin.set_mixed_precision: a missing fp16 / bf16 section is added (enabled
   with the Trainer's mixed precision, else False); the other dtype enabled in the file is refused.
4. Trainer.train → deepspeed_init → trainer_config_finalize: reduce_bucket_size = hidden², and under ZeRO-3
   stage3_prefetch_bucket_size = int(0.9·hidden²), stage3_param_persistence_threshold = 10·hidden; the
   scheduler's total_num_steps and warmup_num_steps (get_warmup_steps); the mismatches raise here.
5. deepspeed_optim_sched: an "optimizer" section → DeepSpeed builds it (DummyOptim); none → the Trainer's own
   ``optim`` as a client optimizer and zero_allow_untested_optimizer = true.
6. Accelerator._prepare_deepspeed (accelerate/accelerator.py): the "auto" left are filled from its kwargs
   (gradient_clipping 1.0, the hidden-size keys by accelerate's own rule, which fills the stage3_* keys under
   ZeRO-1/2 too, ...); an "auto" it has no value for raises; a client optimizer under offload_optimizer is
   replaced by DeepSpeedCPUAdam unless zero_force_ds_cpu_optimizer is false (map_pytorch_optim_to_deepspeed).
7. deepspeed.initialize: WarmupLR / WarmupDecayLR / WarmupCosineLR refuse warmup_num_steps <= 0
   (runtime/lr_schedules.py: "warmup_num_steps must be a positive integer").

accelerate also sets steps_per_print to float("inf") (DeepSpeedPlugin.__post_init__, logging only); that
non-JSON value is left out of the filled config.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from .args import TrainingArgs

#: the config keys filled from the model's hidden size
HIDDEN_KEYS = ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
               "zero_optimization.stage3_param_persistence_threshold")
#: DeepSpeed schedulers that refuse warmup_num_steps <= 0 (deepspeed 0.19.8 runtime/lr_schedules.py)
WARMUP_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


@dataclass(frozen=True)
class Problem:
    """What stops the launch: the config key (or argument), why, and the code that raises."""

    key: str
    message: str
    raised_by: str


@dataclass(frozen=True)
class Mismatch:
    """A value of the file that contradicts the arguments (fill_match with must_match)."""

    key: str
    ds_value: Any
    hf_key: str
    hf_value: Any

    @property
    def line(self) -> str:
        """transformers' own line for it."""
        return f"- ds {self.key}={self.ds_value} vs hf {self.hf_key}={self.hf_value}"


@dataclass(frozen=True)
class HiddenSize:
    """The model's hidden size as each reader finds it in the model config (None: that reader finds none and
    raises when an "auto" needs it): transformers' trainer_config_finalize also looks into text_config,
    accelerate's _prepare_deepspeed does not."""

    trainer: int | None
    accelerate: int | None


@dataclass
class AutoFill:
    """The DeepSpeed config deepspeed.initialize receives, and how it came to be."""

    config: dict[str, Any]
    dtype_at_init: str  # HfTrainerDeepSpeedConfig.dtype() after trainer_config_process: zero.Init builds in it
    optimizer_source: str  # "config" (DeepSpeed builds the optimizer section) or "trainer" (args.optim)
    client_optimizer: str | None = None  # what the Trainer hands DeepSpeed, after accelerate's offload mapping
    mismatches: list[Mismatch] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)  # "auto" keys left because an input is unknown
    filled: dict[str, Any] = field(default_factory=dict)  # key → value for every "auto" filled


class _Config:
    """accelerate's HfDeepSpeedConfig lookups (find_config_node, get_value, is_true) on a dict, plus
    HfTrainerDeepSpeedConfig.fill_match."""

    def __init__(self, config: dict, out: AutoFill):
        self.config, self.out = config, out

    def node(self, key: str) -> tuple[dict | None, str]:
        node: Any = self.config
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
            if node is None:
                return None, leaf
        return (node if isinstance(node, dict) else None), leaf

    def get(self, key: str, default=None):
        node, leaf = self.node(key)
        return default if node is None else node.get(leaf, default)

    def is_auto(self, key: str) -> bool:
        return self.get(key) == "auto"

    def is_true(self, key: str) -> bool:
        value = self.get(key)
        return False if value is None else bool(value)

    def fill(self, key: str, value, hf_key: str | None = None, must_match: bool = True) -> None:
        node, leaf = self.node(key)
        if node is None:
            return
        if node.get(leaf) == "auto":
            node[leaf] = value
            self.out.filled[key] = value
            return
        if must_match and node.get(leaf) is not None and node.get(leaf) != value:
            self.out.mismatches.append(Mismatch(key, node.get(leaf), hf_key or key, value))

    def stage(self) -> int | None:
        """set_stage_and_offload: zero_optimization.stage, -1 when absent."""
        return self.get("zero_optimization.stage", -1)


def _trainer_config_process(c: _Config, args: TrainingArgs, world: int | None) -> str:
    """HfTrainerDeepSpeedConfig.trainer_config_process; returns its dtype (bf16, fp16 or fp32)."""
    micro, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
    c.fill("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size")
    c.fill("gradient_accumulation_steps", accum, "gradient_accumulation_steps")
    if world is None:  # the world is not known: train_batch_size stays open
        if c.is_auto("train_batch_size"):
            c.out.unresolved.append("train_batch_size")
    else:
        c.fill("train_batch_size", world * micro * accum, "train_batch_size (calculated)")
    c.fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    c.fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    c.fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2")
    c.fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    c.fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    c.fill("scheduler.params.warmup_min_lr", 0, must_match=False)
    c.fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    if args.save_on_each_node:
        c.config.setdefault("checkpoint", {})["use_node_local_storage"] = True
    c.fill("fp16.enabled", args.fp16 or args.fp16_full_eval, "fp16|fp16_full_eval")
    c.fill("bf16.enabled", args.bf16 or args.bf16_full_eval, "bf16|bf16_full_eval")
    return "bf16" if c.is_true("bf16.enabled") else "fp16" if c.is_true("fp16.enabled") else "fp32"


#: DeepSpeedPlugin attributes with a config key, and their values when nothing sets them (__post_init__:
#: the ACCELERATE_* environment defaults; gradient_accumulation_steps and gradient_clipping stay "auto")
_PLUGIN_DEFAULTS = {
    "zero_optimization.stage": 2,
    "zero_optimization.offload_optimizer.device": "none",
    "zero_optimization.offload_param.device": "none",
    "zero_optimization.offload_param.nvme_path": "none",
    "zero_optimization.offload_optimizer.nvme_path": "none",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": False,
}


def _plugin_post_init(c: _Config) -> bool:
    """DeepSpeedPlugin.__post_init__ with hf_ds_config; False when it refuses the config."""
    if "gradient_accumulation_steps" not in c.config:
        c.config["gradient_accumulation_steps"] = 1
    if "zero_optimization" not in c.config:
        c.out.problems.append(Problem("zero_optimization", "Please specify the ZeRO optimization config in the "
                                      "DeepSpeed config.", "accelerate DeepSpeedPlugin.__post_init__"))
        return False
    for key, value in _PLUGIN_DEFAULTS.items():
        c.fill(key, value, must_match=False)
    return True


def _set_mixed_precision(c: _Config, mixed_precision: str) -> None:
    """DeepSpeedPlugin.set_mixed_precision (accelerate 1.15; no fp8 here)."""
    cfg = c.config
    if mixed_precision == "fp16" and "fp16" not in cfg:
        cfg["fp16"] = {"enabled": True, "auto_cast": True}
    elif mixed_precision == "bf16" and "bf16" not in cfg:
        cfg["bf16"] = {"enabled": True}
    if mixed_precision != "no":
        other = "bf16" if mixed_precision == "fp16" else "fp16"
        section = cfg.get(other, {})
        if isinstance(section, dict) and str(section.get("enabled", "False")).lower() == "true":
            c.out.problems.append(Problem(f"{other}.enabled", f"`--mixed_precision` arg cannot be set to "
                                          f"`{mixed_precision}` when `{other}` is set in the DeepSpeed config file.",
                                          "accelerate DeepSpeedPlugin.set_mixed_precision"))
    for dtype in ("fp16", "bf16"):
        cfg.setdefault(dtype, {"enabled": False})
    c.fill("fp16.enabled", mixed_precision == "fp16", must_match=False)
    c.fill("bf16.enabled", mixed_precision == "bf16", must_match=False)


def _trainer_config_finalize(c: _Config, args: TrainingArgs, hidden: HiddenSize | None, steps: int | None) -> None:
    """HfTrainerDeepSpeedConfig.trainer_config_finalize (its mismatch ValueError is raised by the caller)."""
    auto = [k for k in HIDDEN_KEYS if c.is_auto(k)]
    if auto and hidden is None:
        c.out.unresolved += [k for k in auto if k not in c.out.unresolved]
    elif auto and hidden.trainer is None:
        c.out.problems.append(Problem(auto[0], "The model's config file has neither `hidden_size` nor "
                                      "`hidden_sizes` entry, therefore it's not possible to automatically fill out "
                                      f"the following `auto` entries in the DeepSpeed config file: {auto}.",
                                      "transformers trainer_config_finalize"))
    elif auto:
        h = hidden.trainer
        c.fill("zero_optimization.reduce_bucket_size", h * h, must_match=False)
        if c.stage() == 3:
            c.fill("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * h * h), must_match=False)
            c.fill("zero_optimization.stage3_param_persistence_threshold", 10 * h, must_match=False)
    if steps is None:
        for key in ("scheduler.params.total_num_steps", "scheduler.params.warmup_num_steps"):
            if c.is_auto(key):
                c.out.unresolved.append(key)
        if args.warmup_steps >= 1 or args.warmup_steps == 0:  # the value does not need the step count
            c.fill("scheduler.params.warmup_num_steps", args.warmup_steps_for(0), "warmup_steps")
            c.out.unresolved = [k for k in c.out.unresolved if k != "scheduler.params.warmup_num_steps"]
        return
    c.fill("scheduler.params.total_num_steps", steps, "num_training_steps (calculated)")
    c.fill("scheduler.params.warmup_num_steps", args.warmup_steps_for(steps), "warmup_steps")


def _prepare_deepspeed(c: _Config, args: TrainingArgs, world: int | None, hidden: HiddenSize | None) -> None:
    """Accelerator._prepare_deepspeed's config_kwargs and deepspeed_config_process(must_match=False)."""
    kwargs: dict[str, Any] = {"gradient_clipping": 1.0,
                              "zero_optimization.stage3_gather_16bit_weights_on_model_save": False}
    micro = args.per_device_train_batch_size if c.is_auto("train_micro_batch_size_per_gpu") else \
        c.get("train_micro_batch_size_per_gpu")
    c.fill("gradient_accumulation_steps", args.gradient_accumulation_steps, must_match=False)
    if micro is not None:
        kwargs["train_micro_batch_size_per_gpu"] = micro
        accum = c.get("gradient_accumulation_steps")
        if isinstance(accum, int) and isinstance(micro, int) and world is not None:
            kwargs["train_batch_size"] = micro * accum * world
    auto = [k for k in HIDDEN_KEYS if c.is_auto(k)]
    if auto and hidden is not None and hidden.accelerate is None:
        c.out.problems.append(Problem(auto[0], "Can find neither `model.config.hidden_size` nor "
                                      "`model.config.hidden_sizes`, therefore it's not possible to automatically "
                                      f"fill out the following `auto` entries in the DeepSpeed config file: {auto}.",
                                      "accelerate Accelerator._prepare_deepspeed"))
        return
    if auto and hidden is not None:
        h = hidden.accelerate
        kwargs.update({HIDDEN_KEYS[0]: h * h, HIDDEN_KEYS[1]: int(0.9 * h * h), HIDDEN_KEYS[2]: 10 * h})
    dummy = "optimizer" in c.config  # DummyOptim(params): lr 0.001, weight_decay 0, no `defaults`
    if dummy:
        kwargs.update({"optimizer.params.lr": 0.001, "optimizer.params.weight_decay": 0})
    if "scheduler" in c.config:  # DummyScheduler(optimizer) without a callable: warmup_num_steps max(1, 0)
        kwargs.update({"scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_num_steps": 1,
                       "scheduler.params.warmup_max_lr": 0.001 if dummy else args.learning_rate})
    _process(c, c.config, "", kwargs)


def _process(c: _Config, node: dict, prefix: str, kwargs: dict) -> None:
    """DeepSpeedPlugin.deepspeed_config_process(must_match=False): every leaf "auto" is filled or raises."""
    for key, value in node.items():
        path = prefix + key
        if isinstance(value, dict):
            _process(c, value, path + ".", kwargs)
        elif value == "auto" and path in kwargs:
            node[key] = kwargs[path]
            c.out.filled[path] = kwargs[path]
        elif value == "auto" and path not in c.out.unresolved:
            c.out.problems.append(Problem(path, f"`{path}` not found in kwargs. Please specify `{path}` without "
                                          "`auto` (set to correct value) in the DeepSpeed config file or pass it "
                                          "in kwargs.", "accelerate DeepSpeedPlugin.fill_match"))


#: the Trainer's own optimizers (args.optim, no optimizer section) → what DeepSpeed is handed
TRAINER_OPTIMIZERS = {"adamw_torch": "torch.optim.AdamW", "adamw_torch_fused": "torch.optim.AdamW(fused=True)",
                      "sgd": "torch.optim.SGD"}


def _client_optimizer(c: _Config, args: TrainingArgs) -> str:
    """deepspeed_optim_sched without an optimizer section: trainer.create_optimizer(), then accelerate's
    map_pytorch_optim_to_deepspeed under offload_optimizer (DeepSpeedCPUAdam, adamw_mode for AdamW)."""
    c.config["zero_allow_untested_optimizer"] = True
    name = TRAINER_OPTIMIZERS.get(args.optim, args.optim)
    offloaded = c.get("zero_optimization.offload_optimizer.device", "none") not in ("none", None)
    if offloaded and c.config.get("zero_force_ds_cpu_optimizer", True):
        return "deepspeed.ops.adam.DeepSpeedCPUAdam" + ("(adamw_mode=True)" if "AdamW" in name else
                                                        "(adamw_mode=False)")
    return name


def _warmup_rule(c: _Config) -> None:
    """DeepSpeed's warmup schedulers refuse a non-positive warmup_num_steps at deepspeed.initialize."""
    scheduler = c.config.get("scheduler")
    if not isinstance(scheduler, dict) or scheduler.get("type") not in WARMUP_SCHEDULERS:
        return
    steps = c.get("scheduler.params.warmup_num_steps", 1000)  # WarmupLR's default
    if steps != "auto" and steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps <= 0):
        c.out.problems.append(Problem("scheduler.params.warmup_num_steps", f"warmup_num_steps must be a positive "
                                      f"integer, got {steps}", f"deepspeed {scheduler['type']}.__init__"))


def fill_auto(ds_config: dict, args: TrainingArgs, *, world: int | None, hidden: HiddenSize | None,
              num_training_steps: int | None, mixed_precision_env: str = "no") -> AutoFill:
    """The config as deepspeed.initialize receives it from the Trainer (see the module docstring).

    ``world``: the processes (TrainingArguments.world_size; None: not known); ``hidden``: the model's hidden size as
    transformers and accelerate read it (None: the model is not known, so its "auto" keys stay unresolved);
    ``num_training_steps``: max_steps, or None when it depends on the dataset's length;
    ``mixed_precision_env``: ACCELERATE_MIXED_PRECISION (``accelerate launch --mixed_precision``), which
    TrainingArguments.mixed_precision keeps when neither fp16 nor bf16 is set."""
    out = AutoFill(config=copy.deepcopy(ds_config), dtype_at_init="fp32", optimizer_source="trainer")
    c = _Config(out.config, out)
    out.dtype_at_init = _trainer_config_process(c, args, world)
    if not _plugin_post_init(c):
        return out
    out.config.pop("steps_per_print", None)  # accelerate: float("inf"), logging only (module docstring)
    mixed = args.mixed_precision if args.mixed_precision != "no" else mixed_precision_env
    _set_mixed_precision(c, mixed if mixed in ("fp16", "bf16") else "no")
    _trainer_config_finalize(c, args, hidden, num_training_steps)
    if "optimizer" in out.config:
        out.optimizer_source = "config"
    else:
        out.client_optimizer = _client_optimizer(c, args)
    if not out.mismatches:
        _prepare_deepspeed(c, args, world, hidden)
        _warmup_rule(c)
    return out


__all__ = ["HIDDEN_KEYS", "TRAINER_OPTIMIZERS", "AutoFill", "HiddenSize", "Mismatch", "Problem", "fill_auto"]
