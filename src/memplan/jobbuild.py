"""Resolved job fields → one validated Job, and errors that name the flag or file key the user wrote.

memplan.resolve collects the fields and where each came from; ``build_job`` validates them once with the
frozen specs. A failure becomes an InputError naming the flag (``--sp``), the DeepSpeed key
(``--ds-config zero_optimization.stage``) or the launch flag (``--launch-file --tensor-model-parallel-size``)
that supplied the value, with the specs' arithmetic kept.
"""

from __future__ import annotations

from typing import Any

from .errors import InputError, shorten

#: where each Job field comes from on memplan's command line (pydantic locations and validator subjects)
FLAG_OF_FIELD: dict[str, str] = {
    "seq_len": "--seq", "seq": "--seq", "micro_batch": "--micro-batch", "grad_accum": "--grad-accum",
    "world": "--gpus", "gpus": "--gpus", "gpus_per_node": "--gpus-per-node", "tp": "--tp", "pp": "--pp",
    "sp": "--sp", "tp_sequence_parallel": "--tp-sequence-parallel", "stage": "--zero", "zero": "--zero",
    "offload_optimizer": "--offload-optimizer", "offload_param": "--offload-param", "dtype": "--dtype",
    "checkpointing": "--checkpointing", "attention": "--attention", "optimizer": "--optimizer", "model": "--model",
    "loop": "--loop", "model_impl": "--model-impl", "layer_backward_hooks": "--layer-backward-hooks",
    "lora": "--lora-rank", "rank": "--lora-rank",
    "targets": "--lora-targets", "freeze": "--freeze", "allocator": "--alloc-conf", "max_split_size_mb": "--alloc-conf",
    "roundup_power2_divisions": "--alloc-conf", "garbage_collection_threshold": "--alloc-conf",
}

#: the DeepSpeed config key a Job field is read from, to name it when the file supplied a bad value
DS_KEY_OF_FIELD: dict[str, str] = {
    "micro_batch": "train_micro_batch_size_per_gpu", "grad_accum": "gradient_accumulation_steps",
    "dtype": "fp16/bf16", "sp": "sequence_parallel_size", "optimizer": "optimizer.type",
    "zero": "zero_optimization.stage", "stage": "zero_optimization.stage",
    "offload_optimizer": "zero_optimization.offload_optimizer.device",
    "offload_param": "zero_optimization.offload_param.device",
}

LAYOUT_FIELDS = ("world", "gpus_per_node", "tp", "pp", "sp", "tp_sequence_parallel")

#: validator messages of specs.py (no pydantic location) → the Job field they are about
_SUBJECTS = (
    ("gpus (", "world"), ("seq (", "seq_len"), ("offload_param needs", "offload_param"),
    ("offload_optimizer needs", "offload_optimizer"), ("ZeRO stage", "stage"), ("Ulysses sp", "sp"),
    ("num_layers", "pp"), ("tp_sequence_parallel", "tp_sequence_parallel"), ("attention flash", "attention"), ("attention eager", "attention"),
    ("layer_backward_hooks", "layer_backward_hooks"),
)


def relabel(err: InputError, flag: str) -> InputError:
    """Prefix an InputError's field with the flag that supplied the input (unless it already names it)."""
    if err.field.startswith(flag):
        return err
    if err.field in ("model", "ds_config", "ds-config", "input", ""):
        return InputError(flag, err.message)
    return InputError(f"{flag} {err.field.removeprefix('model.')}", err.message)


def label(field: str, source: dict[str, str], origin: dict[str, str] | None = None) -> str:
    """The name a user knows for a Job field: its flag, its ds-config key or launch flag when a file supplied it."""
    where = source.get(field)
    if where == "ds" and field in DS_KEY_OF_FIELD:
        return f"--ds-config {DS_KEY_OF_FIELD[field]}"
    if where == "launch" and origin and field in origin:
        return origin[field]
    if field in FLAG_OF_FIELD:
        return FLAG_OF_FIELD[field]
    if where == "ds":
        return f"--ds-config zero_optimization.{field}"
    return field


def field_error(field: str, message: str, source: dict[str, str], fields: dict[str, Any],
                origin: dict[str, str] | None = None) -> InputError:
    """An InputError for ``field``; a divisibility error names the value the user gave among its operands."""
    operands = {"world": ("world", "sp", "tp", "pp"), "seq_len": ("seq_len", "sp")}.get(field, ())
    given = [f for f in operands if source.get(f) in ("flag", "launch")
             and (f in ("world", "seq_len") or fields.get(f, 1) > 1)]
    if given:
        field = given[0]
    hint = ""
    if field in ("sp", "world") and source.get("sp") == "article" and source.get("world") not in ("article", None):
        hint = " (--sp defaults to the article's 8; pass --sp)"
    return InputError(label(field, source, origin), message + hint)


def _subject(loc: tuple, message: str) -> str:
    """The Job field a pydantic error is about: its location, else the validator message's subject."""
    names = [p for p in loc if isinstance(p, str) and p not in ("training", "layout", "zero", "model")]
    if names:
        return names[-1]
    for prefix, field in _SUBJECTS:
        if message.startswith(prefix):
            return field
    if message.startswith(("num_attention_heads", "num_key_value_heads")):
        return "sp" if "sp" in message else "tp"
    return "model" if "model" in loc else "input"


def build_job(model, fields: dict[str, Any], source: dict[str, str], origin: dict[str, str] | None = None):
    """Validate the resolved fields into a frozen Job; a failure names the flag (or file key)."""
    from pydantic import ValidationError

    from .specs import Job, TrainingSpec

    layout = {k: fields[k] for k in LAYOUT_FIELDS if k in fields}
    training = {k: v for k, v in fields.items() if k in TrainingSpec.model_fields}
    if training.get("lora"):
        training["lora"] = resolved_lora(model, training["lora"], source, origin or {})
    try:
        return Job(model=model, training=training, layout=layout)
    except ValidationError as err:
        first = err.errors()[0]
        message = first.get("msg", "invalid value").removeprefix("Value error, ").replace("\n", " ")
        got = first.get("input")
        if first.get("loc") and got is not None and not isinstance(got, (dict, list)):
            message = f"{message} (got {shorten(got)})"
        raise field_error(_subject(tuple(first.get("loc", ())), message), message, source, fields, origin) from None


def resolved_lora(model, lora: dict[str, Any], source: dict[str, str], origin: dict[str, str]) -> dict[str, Any]:
    """LoRA targets resolved for the model: peft's family default for "default"; a target the model lacks is
    refused as peft refuses it."""
    from .params import linear_modules
    from .peftconfig import DEFAULT, DEFAULT_TARGETS, resolve_targets

    flag = {"file": "--peft-config target_modules",
            "launch": f"{origin.get('lora', '--launch').split()[0]} --lora_target_modules"}.get(source.get("lora"),
                                                                                           "--lora-targets")
    try:
        resolve_targets(model.family, tuple(lora["targets"]), linear_modules(model))
    except ValueError as err:
        raise InputError(flag, str(err)) from None
    if tuple(lora["targets"]) == (DEFAULT,):
        lora = {**lora, "targets": DEFAULT_TARGETS[model.family]}
    return lora


#: PYTORCH_CUDA_ALLOC_CONF keys memplan models (c10/cuda/CUDAAllocatorConfig.cpp parseArgs); torch's other
#: keys (pinned_*, backend) do not change device memory of the caching allocator
_ALLOC_KEYS = ("expandable_segments", "max_split_size_mb", "roundup_power2_divisions",
               "garbage_collection_threshold")


def parse_alloc_conf(text: str, flag: str) -> dict[str, Any]:
    """``key:value,key:value`` as torch's CUDAAllocatorConfig parses it → AllocatorSpec fields."""
    out: dict[str, Any] = {}
    allowed = "allowed: comma-separated key:value with keys " + ", ".join(_ALLOC_KEYS)
    if len(text) > 1000:
        raise InputError(flag, f"{len(text)} characters is too long; {allowed}")
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, sep, value = item.partition(":")
        key, value = key.strip(), value.strip()
        if not sep or key not in _ALLOC_KEYS:
            raise InputError(flag, f"{shorten(item, 40)} is not a key torch takes here; {allowed}")
        if key == "expandable_segments":
            if value not in ("True", "False"):
                raise InputError(flag, f"expandable_segments:{value[:20]} must be True or False")
            out[key] = value == "True"
        elif key == "garbage_collection_threshold":
            try:
                out[key] = float(value)
            except ValueError:
                raise InputError(flag, f"{key}:{value[:20]} must be a number in (0, 1)") from None
        else:
            if not value.isdigit() or len(value) > 12:
                raise InputError(flag, f"{key}:{value[:20]} must be a positive integer")
            out[key] = int(value)
    return out


def split_list(text: str, flag: str) -> tuple[str, ...]:
    """A comma-separated list of names (each a short identifier-like word)."""
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    if not items or len(text) > 2000:
        raise InputError(flag, "needs a comma-separated list of names")
    for item in items:
        if len(item) > 100 or not all(c.isalnum() or c in "_.-:*" for c in item):
            raise InputError(flag, f"{shorten(item, 40)} is not a module or group name")
    return items


__all__ = ["DS_KEY_OF_FIELD", "FLAG_OF_FIELD", "LAYOUT_FIELDS", "build_job", "field_error", "label",
           "parse_alloc_conf", "relabel", "split_list"]
