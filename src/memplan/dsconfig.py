"""Reading a DeepSpeed JSON config the way DeepSpeed 0.19.8 reads it.

``load_ds_config(path)`` parses the file; ``ds_settings(cfg)`` extracts what the config says into a frozen
``DsSettings`` (None = the config does not set it); ``apply_to_job_fields(settings)`` lists the
TrainingSpec / ZeroSpec / Layout fields it sets, so the command line can merge: file first, flags override.

How DeepSpeed reads each part (paths relative to the deepspeed package):

- Sections (zero_optimization, offload_*, fp16, bf16, tensor_parallel) are DeepSpeedConfigModel subclasses
  (runtime/config_utils.py): ``"auto"`` values are dropped before validation, so "auto" means the default.
  Field aliases and field names are both accepted (``populate_by_name=True``).
- A section that is not an object (``"zero_optimization": "auto"``, ``"fp16": "auto"``, ``"optimizer": "auto"``,
  null) is refused: DeepSpeed calls ``DeepSpeedZeroConfig(**value)`` (TypeError) or ``value.keys()`` /
  ``.get`` (AttributeError) on it; so does HfDeepSpeedConfig.find_config_node on the Hugging Face path.
- Top-level scalars (``get_scalar_param``, a dict lookup) are compared as they are: a batch size that is a
  string, "auto" included, fails ``_batch_assertion`` (TypeError). On the Hugging Face Trainer path
  (``hf=True``) "auto" is filled from TrainingArguments first (HfTrainerDeepSpeedConfig.trainer_config_process)
  and counts as not set here; ``fp16.enabled: "auto"`` is dropped (fp16 off) on the plain path.
- Batch sizes: memplan.dsbatch (DeepSpeedConfig._set_batch_related_parameters, _batch_assertion).
- Optimizer: DeepSpeedEngine._configure_basic_optimizer / get_optimizer_configuration (runtime/engine.py).

Integers in sections are read with pydantic's lax int, DeepSpeed's own parse (``"stage": "3"``, ``"500"`` and
5e8 are ints; ``"5e8"`` and 1.5 are not), then bounded (memplan.bounds). Unknown keys are ignored here
(``memplan check`` reports them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from .bounds import MAX_COUNT, MAX_ELEMENTS, MAX_RANKS, check_count
from .dsbatch import batch_problem, derive_batch, resolve_batch  # noqa: F401 - re-exported
from .errors import InputError, shorten
from .specs import Optimizer, TrainDtype

OffloadDevice = Literal["none", "cpu", "nvme"]

#: DtypeEnum (runtime/config.py): every spelling DeepSpeed accepts for a dtype, mapped to memplan's name.
DTYPE_SPELLINGS: dict[str, TrainDtype] = {
    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
}

#: DeepSpeedZeroConfig fields with an alias (runtime/zero/config.py): alias → memplan ZeroSpec field.
ZERO_INT_KEYS: dict[str, tuple[str, ...]] = {
    "reduce_bucket_size": ("reduce_bucket_size",),
    "allgather_bucket_size": ("allgather_bucket_size",),
    "stage3_prefetch_bucket_size": ("stage3_prefetch_bucket_size", "prefetch_bucket_size"),
    "stage3_param_persistence_threshold": ("stage3_param_persistence_threshold", "param_persistence_threshold"),
    "stage3_max_live_parameters": ("stage3_max_live_parameters", "max_live_parameters"),
    "stage3_max_reuse_distance": ("stage3_max_reuse_distance", "max_reuse_distance"),
    "sub_group_size": ("sub_group_size",),
}
#: lower bounds DeepSpeedZeroConfig puts on them (Field(gt=0) for reduce_bucket_size, ge=0 for the rest).
_ZERO_INT_MIN = {"reduce_bucket_size": 1}

#: optimizer.type values memplan models, lower-cased (DEEPSPEED_OPTIMIZERS lower-cases its own names;
#: anything else is looked up as torch.optim.<type>, case-sensitive, so "SGD").
OPTIMIZER_TYPES = ("adam", "adamw", "lion", "SGD")


class DsSettings(BaseModel):
    """What a DeepSpeed config sets, resolved as DeepSpeed 0.19.8 resolves it. None: not set."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    zero_stage: Literal[0, 1, 2, 3] | None = None
    reduce_bucket_size: int | None = None
    allgather_bucket_size: int | None = None
    overlap_comm: bool | None = None
    contiguous_gradients: bool | None = None
    stage3_prefetch_bucket_size: int | None = None
    stage3_param_persistence_threshold: int | None = None
    stage3_max_live_parameters: int | None = None
    stage3_max_reuse_distance: int | None = None
    sub_group_size: int | None = None
    offload_optimizer: OffloadDevice | None = None
    offload_optimizer_pin_memory: bool | None = None
    offload_param: OffloadDevice | None = None
    offload_param_pin_memory: bool | None = None
    dtype: TrainDtype | None = None
    train_batch_size: int | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    optimizer: Optimizer | None = None
    optimizer_type: str | None = None
    grad_accum_dtype: TrainDtype | None = None
    sequence_parallel_size: int | None = None
    sp_comm_dtype: TrainDtype | None = None
    autotp_size: int | None = None
    partition_activations: bool | None = None
    cpu_checkpointing: bool | None = None
    contiguous_memory_optimization: bool | None = None
    number_checkpoints: int | None = None
    gradient_clipping: float | None = None
    fp16_loss_scale: float | None = None
    fp16_initial_scale_power: int | None = None
    fp16_loss_scale_window: int | None = None
    auto_keys: tuple[str, ...] = ()


#: batch keys the Hugging Face Trainer fills when they are "auto" (trainer_config_process)
HF_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

#: pydantic's lax int: how DeepSpeedConfigModel sections parse an int field
_LAX_INT = TypeAdapter(int)


def load_ds_config(path: str | Path, *, hf: bool = False, flag: str = "--ds-config") -> dict:
    """Read a DeepSpeed config file as the job will read it (memplan.inputs): DeepSpeedConfig's hjson with
    duplicate keys refused, or (``hf``) HfDeepSpeedConfig's json.load. Malformed → InputError naming ``flag``."""
    from .inputs import read_json_object

    return read_json_object(path, flag, "json" if hf else "deepspeed", "DeepSpeed JSON config")


def as_int(value: Any, path: str, minimum: int = 0, *, maximum: int = MAX_ELEMENTS,
           strings: bool = True) -> int | None:
    """An integer as DeepSpeed reads it, bounded; "auto"/None → None. ``strings``: a section's field (pydantic's
    lax int); else a top-level scalar, compared as it is (a JSON number only). Booleans refused (stricter)."""
    if value is None or value == "auto":
        return None
    if isinstance(value, bool):
        raise InputError(path, f"must be an integer >= {minimum}, not a boolean")
    if isinstance(value, str) and not strings:
        raise InputError(path, f"must be a JSON number, not a string (got {shorten(value)}): DeepSpeedConfig "
                               "compares it as it is (_batch_assertion raises TypeError on a string)")
    try:
        out = _LAX_INT.validate_python(value)
    except ValidationError:
        raise InputError(path, f"must be a whole number >= {minimum} (got {shorten(value)})") from None
    return check_count(out, path, minimum=minimum, maximum=maximum)


def as_bool(value: Any, path: str) -> bool | None:
    """A JSON boolean; "auto"/None → None."""
    if value is None or value == "auto":
        return None
    if not isinstance(value, bool):
        raise InputError(path, f"must be true or false (got {shorten(value)})")
    return value


def as_dtype(value: Any, path: str) -> TrainDtype | None:
    """A dtype in any spelling DeepSpeed's DtypeEnum accepts; "auto"/None → None."""
    if value is None or value == "auto":
        return None
    key = value.lower() if isinstance(value, str) else value
    if key not in DTYPE_SPELLINGS:
        raise InputError(path, f"must be one of fp16, bf16, fp32 (got {shorten(value)})")
    return DTYPE_SPELLINGS[key]


def _section(cfg: dict, key: str, path: str = "") -> dict:
    """A section DeepSpeed reads with ``Config(**value)`` or ``value.get``: missing → {}; present, it must
    be a JSON object ("auto" or null included are refused, as DeepSpeed fails on them)."""
    if key not in cfg:
        return {}
    value = cfg[key]
    if not isinstance(value, dict):
        raise InputError(f"{path}{key}", f"must be a JSON object {{...}} (got {shorten(value)}): DeepSpeed fails "
                                         "on anything else; \"auto\" works only for values inside it")
    return value


def _offload(zero: dict, key: str) -> tuple[OffloadDevice | None, bool | None]:
    """offload_optimizer / offload_param (runtime/zero/offload_config.py, OffloadDeviceEnum)."""
    # inside zero_optimization, "auto" and null are dropped / the default (DeepSpeedConfigModel, Optional field)
    section = {} if zero.get(key) in (None, "auto") else _section(zero, key, "zero_optimization.")
    path = f"zero_optimization.{key}"
    device = section.get("device")
    if device is not None and device != "auto" and device not in ("none", "cpu", "nvme"):
        raise InputError(f"{path}.device", f"must be none, cpu or nvme (got {shorten(device)})")
    if section and device in (None, "auto"):
        device = "none"  # DeepSpeedZeroOffload*Config.device defaults to "none"
    return device, as_bool(section.get("pin_memory"), f"{path}.pin_memory")


def _zero_fields(cfg: dict) -> dict:
    """zero_optimization, as get_zero_config / DeepSpeedZeroConfig read it (runtime/zero/config.py)."""
    raw = cfg.get("zero_optimization")
    if isinstance(raw, bool):  # read_zero_config_deprecated: true → stage 1
        return {"zero_stage": 1 if raw else 0}
    zero = _section(cfg, "zero_optimization")
    out: dict[str, Any] = {}
    stage = zero.get("stage")
    if stage is not None and stage != "auto":  # ZeroStageEnum under pydantic's lax int: "3" is 3
        try:
            parsed = None if isinstance(stage, bool) else _LAX_INT.validate_python(stage)
        except ValidationError:
            parsed = None
        if parsed not in (0, 1, 2, 3):
            raise InputError("zero_optimization.stage", f"must be 0, 1, 2 or 3 (got {shorten(stage)})")
        out["zero_stage"] = parsed
    for field, keys in ZERO_INT_KEYS.items():
        for key in keys:
            if key in zero:
                out[field] = as_int(zero[key], f"zero_optimization.{key}", _ZERO_INT_MIN.get(field, 0))
    for field in ("overlap_comm", "contiguous_gradients"):
        out[field] = as_bool(zero.get(field), f"zero_optimization.{field}")
    out["offload_optimizer"], out["offload_optimizer_pin_memory"] = _offload(zero, "offload_optimizer")
    out["offload_param"], out["offload_param_pin_memory"] = _offload(zero, "offload_param")
    # deprecated booleans (DeepSpeedZeroConfig.cpu_offload / cpu_offload_param → new_param_fn → device cpu)
    if as_bool(zero.get("cpu_offload"), "zero_optimization.cpu_offload") and out["offload_optimizer"] is None:
        out["offload_optimizer"] = "cpu"
    if as_bool(zero.get("cpu_offload_param"), "zero_optimization.cpu_offload_param") and out["offload_param"] is None:
        out["offload_param"] = "cpu"
    return out


def _dtype_field(cfg: dict, hf: bool = False) -> TrainDtype | None:
    """fp16 / bf16 ("bfloat16" is the old key) as get_float16_config / get_bfloat16_config read them. Neither
    enabled: fp32. ``enabled: "auto"``: dropped (off) on the plain path; the Trainer's to fill on the HF path."""
    fp16_section = _section(cfg, "fp16")
    # get_bfloat16_config: "bf16", and the old "bfloat16" when bf16 is missing or null
    bf16_key = "bf16" if cfg.get("bf16") is not None or "bfloat16" not in cfg else "bfloat16"
    bf16_section = {} if bf16_key == "bf16" and cfg.get("bf16") is None else _section(cfg, bf16_key)
    fp16 = as_bool(fp16_section.get("enabled"), "fp16.enabled")
    bf16 = as_bool(bf16_section.get("enabled"), f"{bf16_key}.enabled")
    if fp16 and bf16:
        raise InputError("fp16.enabled", "bf16 and fp16 cannot both be enabled (DeepSpeedConfig._initialize_params)")
    if fp16:
        return "fp16"
    if bf16:
        return "bf16"
    if hf and "auto" in (fp16_section.get("enabled"), bf16_section.get("enabled")):
        return None
    return "fp32"


def optimizer_choice(cfg: dict, offload_optimizer: str | None) -> tuple[str | None, Optimizer | None]:
    """(optimizer.type as written, the optimizer DeepSpeed builds from it), or (None, None) without one.

    DeepSpeedEngine.get_optimizer_configuration: Adam/AdamW → torch.optim.AdamW when params.torch_adam,
    else DeepSpeedCPUAdam when offload_optimizer is cpu/nvme, else FusedAdam. Lion → FusedLion / CPULion.
    """
    section = _section(cfg, "optimizer")
    name = section.get("type")
    if name is None:
        return None, None
    if not isinstance(name, str):
        raise InputError("optimizer.type", f"must be one of {', '.join(OPTIMIZER_TYPES)} (got {shorten(name)})")
    lowered = name.lower()
    params = section.get("params") or {}
    if lowered in ("adam", "adamw"):
        if isinstance(params, dict) and params.get("torch_adam") is True:
            return name, "torch_adamw"
        return name, "cpu_adam" if offload_optimizer in ("cpu", "nvme") else "adamw"
    if lowered == "lion":
        return name, "lion"
    if lowered == "sgd":
        return name, "sgd"
    raise InputError("optimizer.type", f"memplan models {', '.join(OPTIMIZER_TYPES)} (got {shorten(name)})")


def _batch_fields(cfg: dict, hf: bool = False) -> dict:
    for key in HF_BATCH_KEYS:
        if cfg.get(key) == "auto" and not hf:
            raise InputError(key, "\"auto\" is filled in only by the Hugging Face Trainer (--loop hf-trainer); "
                                  "plain deepspeed.initialize keeps the string and DeepSpeedConfig._batch_assertion "
                                  "fails on it (TypeError); allowed: a positive integer")
    return {
        "train_batch_size": as_int(cfg.get("train_batch_size"), "train_batch_size", 1, maximum=MAX_COUNT,
                                   strings=False),
        "micro_batch": as_int(cfg.get("train_micro_batch_size_per_gpu"), "train_micro_batch_size_per_gpu", 1,
                              maximum=MAX_COUNT, strings=False),
        "grad_accum": as_int(cfg.get("gradient_accumulation_steps"), "gradient_accumulation_steps", 1,
                             maximum=MAX_COUNT, strings=False),
    }


def _activation_checkpointing_fields(cfg: dict) -> dict:
    """activation_checkpointing (runtime/activation_checkpointing/config.py): recorded, not applied."""
    ac = _section(cfg, "activation_checkpointing")
    p = "activation_checkpointing."
    return {
        "partition_activations": as_bool(ac.get("partition_activations"), p + "partition_activations"),
        "cpu_checkpointing": as_bool(ac.get("cpu_checkpointing"), p + "cpu_checkpointing"),
        "contiguous_memory_optimization": as_bool(
            ac.get("contiguous_memory_optimization"), p + "contiguous_memory_optimization"),
        "number_checkpoints": as_int(ac.get("number_checkpoints"), p + "number_checkpoints", 1, maximum=MAX_COUNT),
    }


def _fp16_fields(cfg: dict) -> dict:
    fp16 = _section(cfg, "fp16")
    scale = fp16.get("loss_scale")
    if scale is not None and scale != "auto" and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                                   or scale < 0):
        raise InputError("fp16.loss_scale", f"must be a number >= 0, 0 = dynamic (got {shorten(scale)})")
    return {
        "fp16_loss_scale": None if scale in (None, "auto") else float(scale),
        "fp16_initial_scale_power": as_int(fp16.get("initial_scale_power"), "fp16.initial_scale_power",
                                           maximum=1023),  # 2**power must be a finite float
        "fp16_loss_scale_window": as_int(fp16.get("loss_scale_window"), "fp16.loss_scale_window", 1,
                                         maximum=MAX_COUNT),
    }


def _float(value: Any, path: str) -> float | None:
    if value is None or value == "auto":
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise InputError(path, f"must be a number >= 0 (got {shorten(value)})")
    return float(value)


def _auto_keys(cfg: dict, prefix: str = "") -> tuple[str, ...]:
    out: list[str] = []
    for key, value in cfg.items():
        if value == "auto":
            out.append(prefix + str(key))
        elif isinstance(value, dict):
            out.extend(_auto_keys(value, f"{prefix}{key}."))
    return tuple(out)


def ds_settings(cfg: dict, dp: int | None = None, *, hf: bool = False) -> DsSettings:
    """What ``cfg`` sets. With ``dp`` (the data-parallel size DeepSpeed divides by), missing batch
    sizes are derived and the batch identity is checked, as DeepSpeedConfig does. ``hf``: the Hugging Face
    Trainer path, which fills "auto" values from TrainingArguments (module docstring)."""
    fields: dict[str, Any] = {}
    fields.update(_zero_fields(cfg))
    fields["dtype"] = _dtype_field(cfg, hf)
    fields.update(_batch_fields(cfg, hf))
    fields["optimizer_type"], fields["optimizer"] = optimizer_choice(cfg, fields.get("offload_optimizer"))
    fields["grad_accum_dtype"] = as_dtype(_section(cfg, "data_types").get("grad_accum_dtype"),
                                          "data_types.grad_accum_dtype")
    fields["sequence_parallel_size"] = as_int(cfg.get("sequence_parallel_size"), "sequence_parallel_size", 1,
                                              maximum=MAX_RANKS)
    fields["sp_comm_dtype"] = as_dtype(cfg.get("seq_parallel_communication_data_type"),
                                       "seq_parallel_communication_data_type")
    fields["autotp_size"] = as_int(_section(cfg, "tensor_parallel").get("autotp_size"), "tensor_parallel.autotp_size",
                                   maximum=MAX_RANKS)
    fields.update(_activation_checkpointing_fields(cfg))
    fields["gradient_clipping"] = _float(cfg.get("gradient_clipping"), "gradient_clipping")
    fields.update(_fp16_fields(cfg))
    fields["auto_keys"] = _auto_keys(cfg)
    settings = DsSettings(**fields)
    if dp is not None:
        settings = settings.model_copy(update=resolve_batch(settings, dp))
    return settings


_ZERO_SPEC_FIELDS = ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients",
                     "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                     "stage3_max_live_parameters", "stage3_max_reuse_distance", "sub_group_size",
                     "offload_optimizer", "offload_param")


def apply_to_job_fields(settings: DsSettings) -> dict:
    """The spec fields the config sets: {"training": {...}, "zero": {...}, "layout": {...}}.

    Only fields the config sets appear; merge them under the command-line flags.
    """
    s = settings
    zero = {f: getattr(s, f) for f in _ZERO_SPEC_FIELDS if getattr(s, f) is not None}
    if s.zero_stage is not None:
        zero["stage"] = s.zero_stage
    pin = s.offload_optimizer_pin_memory if s.offload_optimizer not in (None, "none") else s.offload_param_pin_memory
    if pin is not None:
        zero["pin_memory"] = pin
    training = {
        "micro_batch": s.micro_batch,
        "grad_accum": s.grad_accum,
        "dtype": s.dtype,
        "optimizer": s.optimizer,
        "grad_accum_dtype": s.grad_accum_dtype,
        "sp_comm_dtype": s.sp_comm_dtype,
    }
    layout = {"sp": s.sequence_parallel_size, "tp": s.autotp_size if s.autotp_size and s.autotp_size > 1 else None}
    return {
        "training": {k: v for k, v in training.items() if v is not None},
        "zero": zero,
        "layout": {k: v for k, v in layout.items() if v is not None},
    }
