"""transformers' TrainingArguments as data: the fields that change memory or the DeepSpeed config.

``TrainingArgs`` keeps transformers 5.17.0's defaults (training_args.py, the ``TrainingArguments`` dataclass;
fields.json lists every field with its default, read from the installed package by gen_fields.py, and a test
compares the two). ``training_args_from_dict`` reads the JSON ``TrainingArguments.to_json_string()`` writes
(``--training-args FILE``): every key must be a TrainingArguments field, as HfArgumentParser.parse_dict
requires ("Some keys are not used by the HfArgumentParser"); the fields memplan does not model are accepted
and ignored. Nothing here imports transformers.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..errors import InputError

#: the largest count taken (as memplan.options.MAX_FLAG_INT: far beyond any real job)
MAX_COUNT = 2**40


@lru_cache(maxsize=1)
def fields_table() -> dict:
    """fields.json: every TrainingArguments init field (kind, default), OptimizerNames and SchedulerType values."""
    return json.loads(Path(__file__).with_name("fields.json").read_text())


def transformers_version() -> str:
    """The transformers release fields.json was read from."""
    return fields_table()["transformers_version"]


class TrainingArgs(BaseModel):
    """The TrainingArguments fields that decide memory or the DeepSpeed config (transformers 5.17 defaults)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    per_device_train_batch_size: int = Field(8, gt=0, le=MAX_COUNT, description="the DataLoader's batch size")
    gradient_accumulation_steps: int = Field(1, gt=0, le=MAX_COUNT)
    num_train_epochs: float = Field(3.0, ge=0)
    max_steps: int = Field(-1, le=MAX_COUNT, description="> 0 overrides num_train_epochs")
    learning_rate: float = Field(5e-5, ge=0)
    lr_scheduler_type: str = "linear"
    warmup_steps: float = Field(0, ge=0, description="an int >= 1 (steps) or a ratio in [0, 1) of the total steps")
    optim: str = Field("adamw_torch_fused", description="OptimizerNames; adamw_torch_fused is the default from "
                       "torch 2.8 on (training_args.py default_optim)")
    optim_args: str | None = Field(None, description="comma-separated key=value (trainer_optimizer._parse_optim_args)")
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    bf16: bool = False
    fp16: bool = False
    bf16_full_eval: bool = False
    fp16_full_eval: bool = False
    gradient_checkpointing: bool = False
    gradient_checkpointing_kwargs: dict[str, Any] | None = Field(
        None, description="every_n_layers and offload are popped by Trainer.train (transformers 5.17); the rest "
        "goes to torch.utils.checkpoint.checkpoint")
    torch_empty_cache_steps: int | None = Field(None, gt=0, le=MAX_COUNT)
    auto_find_batch_size: bool = False
    dataloader_pin_memory: bool = True
    save_on_each_node: bool = False
    deepspeed: str | dict[str, Any] | None = Field(None, description="a DeepSpeed JSON path or dict")

    @model_validator(mode="after")
    def _check(self) -> TrainingArgs:
        table = fields_table()
        if self.fp16 and self.bf16:
            raise ValueError("At most one of fp16 and bf16 can be True, but not both (TrainingArguments._validate_args)")
        if self.optim not in table["optim_names"]:
            raise ValueError(f"optim {self.optim!r} is not an OptimizerNames value; allowed: "
                             + ", ".join(table["optim_names"]))
        if self.lr_scheduler_type not in table["scheduler_types"]:
            raise ValueError(f"lr_scheduler_type {self.lr_scheduler_type!r} is not a SchedulerType value; allowed: "
                             + ", ".join(table["scheduler_types"]))
        if self.warmup_steps >= 1 and self.warmup_steps != int(self.warmup_steps):
            raise ValueError(f"warmup_steps {self.warmup_steps} is neither a ratio in [0, 1) nor a whole number "
                             "of steps (get_warmup_steps truncates it)")
        return self

    @property
    def mixed_precision(self) -> str:
        """TrainingArguments.mixed_precision: fp16, bf16, or "no" (ACCELERATE_MIXED_PRECISION is not modelled)."""
        return "fp16" if self.fp16 else "bf16" if self.bf16 else "no"

    def warmup_steps_for(self, num_training_steps: int) -> int:
        """TrainingArguments.get_warmup_steps: int(warmup_steps) if >= 1, else ceil(total · ratio)."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        return math.ceil(num_training_steps * self.warmup_steps)

    def checkpoint_kwargs(self) -> tuple[dict[str, Any], int, bool]:
        """(kwargs for torch.utils.checkpoint, every_n_layers, offload) as Trainer.train passes them to
        gradient_checkpointing_enable: every_n_layers (1) and offload (False) are popped; an empty rest is None,
        for which gradient_checkpointing_enable uses {"use_reentrant": False} (modeling_utils.py)."""
        kwargs = dict(self.gradient_checkpointing_kwargs or {})
        every = kwargs.pop("every_n_layers", 1)
        offload = kwargs.pop("offload", False)
        return (kwargs or {"use_reentrant": False}), every, offload


#: the TrainingArgs fields (the rest of TrainingArguments is read and ignored)
MODELED = tuple(TrainingArgs.model_fields)


def convert_str_dict(value: dict) -> dict:
    """training_args._convert_str_dict: "true"/"false" → bool, digit strings → int, "1.5" → float, nested."""
    out = {}
    for key, item in value.items():
        if isinstance(item, dict):
            item = convert_str_dict(item)
        elif isinstance(item, str):
            if item.lower() in ("true", "false"):
                item = item.lower() == "true"
            elif item.isdigit():
                item = int(item)
            elif item.replace(".", "", 1).isdigit():
                item = float(item)
        out[key] = item
    return out


def dict_field(value: Any, where: str) -> Any:
    """A dict field given as a string: TrainingArguments.__post_init__ json-loads strings starting with "{"
    (and _convert_str_dict's them); other strings are kept (deepspeed: a path)."""
    if isinstance(value, str) and value.startswith("{"):
        try:
            loaded = json.loads(value)
        except json.JSONDecodeError as err:
            raise InputError(where, f"is not valid JSON ({err.msg} at col {err.colno}); allowed: a JSON object")
        if not isinstance(loaded, dict):
            raise InputError(where, "must be a JSON object")
        return convert_str_dict(loaded)
    return value


def _checked_kwargs(value: Any, where: str) -> None:
    """gradient_checkpointing_kwargs: Trainer.train does dict(...) of it and pops every_n_layers / offload."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise InputError(where, f"{str(value)[:40]!r} is not a dict; allowed: a JSON object such as "
                         "{\"use_reentrant\": false}")
    every = value.get("every_n_layers", 1)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise InputError(f"{where}.every_n_layers", f"{every!r} must be a positive integer")
    for key in ("offload", "use_reentrant"):
        if key in value and not isinstance(value[key], bool):
            raise InputError(f"{where}.{key}", f"{value[key]!r} must be true or false")


def build_args(values: dict[str, Any], label) -> TrainingArgs:
    """TrainingArgs from modelled field values; a bad value is an InputError naming ``label(field)``."""
    for name in ("gradient_checkpointing_kwargs", "deepspeed"):
        if name in values:
            values = {**values, name: dict_field(values[name], label(name))}
    _checked_kwargs(values.get("gradient_checkpointing_kwargs"), label("gradient_checkpointing_kwargs"))
    try:
        return TrainingArgs(**values)
    except ValidationError as err:
        first = err.errors()[0]
        loc = [p for p in first.get("loc", ()) if isinstance(p, str)]
        message = first.get("msg", "invalid value").removeprefix("Value error, ")
        got = first.get("input")
        if loc and got is not None and not isinstance(got, (dict, list)):
            message = f"{message} (got {got!r})"
        field = loc[0] if loc else _subject(message)
        raise InputError(label(field), message) from None


def _subject(message: str) -> str:
    """The field a model-level validator message is about."""
    for name in ("optim", "lr_scheduler_type", "warmup_steps"):
        if message.startswith(name + " "):
            return name
    return "bf16" if "fp16 and bf16" in message else "input"


def training_args_from_dict(raw: Any, where: str = "--training-args") -> TrainingArgs:
    """TrainingArgs from what TrainingArguments.to_json_string() writes; unknown keys are an InputError."""
    if not isinstance(raw, dict):
        raise InputError(where, f"must be a JSON object of TrainingArguments fields, got {type(raw).__name__}")
    known = fields_table()["fields"]
    for key in raw:
        if key not in known:
            raise InputError(f"{where} {str(key)[:60]}", f"not a field of transformers {transformers_version()}'s "
                             "TrainingArguments (HfArgumentParser.parse_dict refuses unknown keys); allowed: the "
                             "keys TrainingArguments.to_json_string() writes")
    values = {k: v for k, v in raw.items() if k in MODELED}
    return build_args(values, lambda field: f"{where} {field}")


def load_training_args(path: str, flag: str = "--training-args") -> TrainingArgs:
    """Read a TrainingArguments JSON file (``flag`` names it in errors)."""
    from ..options import require_regular_file

    require_regular_file(path, flag)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(flag, f"cannot read {path!r} ({getattr(err, 'strerror', None) or 'not UTF-8 text'})") from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        raise InputError(flag, f"{path}: invalid JSON at line {err.lineno} col {err.colno} ({err.msg})") from None
    return training_args_from_dict(raw, flag)


__all__ = ["MODELED", "TrainingArgs", "build_args", "fields_table", "load_training_args", "training_args_from_dict"]
