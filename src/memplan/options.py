"""The job flags shared by estimate, verify, check and plan, and how they become a `Job`.

`add_job_arguments(parser)` adds the flags of issue 2; `job_from_args(args)` resolves them:

1. start from the defaults: the seed's scenario (below) without ``--ds-config``; with ``--ds-config``, the
   file's values, and DeepSpeed's own defaults for what the file leaves out;
2. explicit flags override both (every flag's argparse default is None, so "given" is knowable);
3. validate once with the frozen specs; a failure is an InputError naming the flag (or the ds-config key).

The seed's scenario (../shared/seed: 176b_config.json, ds_config_ulysses.json, the article's text): the 176B
GPT-style model, seq 32768, micro-batch 1, 8 GPUs on one node, ZeRO-3 with the optimizer offloaded to CPU,
fp16, Ulysses sp 8 (the model config's ``sequence_parallel_size``), and the ds config's ZeRO knobs. So bare
``memplan estimate`` estimates the seed's scenario.

Imports stay light (argparse and the specs); presets and the ds-config reader are imported when used.
"""

from __future__ import annotations

import argparse
from typing import Any

from .bounds import MAX_COUNT, count_type, rank_count
from .errors import InputError, shorten
from .inputs import MAX_INPUT_BYTES, check_regular

#: the seed's model preset and sequence length (176b_config.json, the article's 32K tokens)
DEFAULT_MODEL = "176b"
DEFAULT_SEQ = 32768
#: the seed's launch: 8 GPUs, one node (launch.sh: --num_nodes 1 --num_gpus 8)
DEFAULT_GPUS = 8
DEFAULT_GPUS_PER_NODE = 8

#: Job fields of the seed's scenario, used when no --ds-config is given. From ds_config_ulysses.json
#: (zero_optimization, fp16, train_micro_batch_size_per_gpu) and 176b_config.json (sequence_parallel_size).
SEED_FIELDS: dict[str, Any] = {
    "micro_batch": 1,
    "grad_accum": 1,
    "dtype": "fp16",
    "sp": 8,
    "zero": {
        "stage": 3,
        "contiguous_gradients": True,
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_max_reuse_distance": 1_000_000_000,
        "stage3_prefetch_bucket_size": 500_000_000,
        "stage3_param_persistence_threshold": 1_000_000,
        "reduce_bucket_size": 100_000_000,
        "sub_group_size": 1_000_000_000,
        "offload_optimizer": "cpu",
        "pin_memory": True,
    },
}

#: where each Job field comes from on the command line (pydantic locations and validator subjects)
FLAG_OF_FIELD: dict[str, str] = {
    "seq_len": "--seq", "seq": "--seq", "micro_batch": "--micro-batch", "grad_accum": "--grad-accum",
    "world": "--gpus", "gpus": "--gpus", "gpus_per_node": "--gpus-per-node", "tp": "--tp", "pp": "--pp",
    "sp": "--sp", "tp_sequence_parallel": "--tp-sequence-parallel", "stage": "--zero", "zero": "--zero", "offload_optimizer": "--offload-optimizer",
    "offload_param": "--offload-param", "dtype": "--dtype", "checkpointing": "--checkpointing",
    "attention": "--attention", "optimizer": "--optimizer", "model": "--model", "loop": "--loop",
    "model_impl": "--model-impl", "lora": "--lora-rank", "rank": "--lora-rank", "targets": "--lora-targets",
    "freeze": "--freeze", "allocator": "--alloc-conf", "max_split_size_mb": "--alloc-conf",
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

#: the largest count a flag takes (2**40 tokens or steps is far beyond any real job; keeps byte arithmetic in
#: the estimator exact in float64 where it divides); ranks are bounded lower (memplan.bounds.MAX_RANKS)
MAX_FLAG_INT = MAX_COUNT

_LAYOUT_FIELDS = ("world", "gpus_per_node", "tp", "pp", "sp", "tp_sequence_parallel")
_CHOICES = {
    "zero": (0, 1, 2, 3),
    "offload": ("none", "cpu", "nvme"),
    "dtype": ("bf16", "fp16", "fp32"),
    "checkpointing": ("none", "selective", "full"),
    "attention": ("flash", "sdpa", "eager"),
    "optimizer": ("adamw", "torch_adamw", "torch_adamw_fused", "cpu_adam", "sgd", "lion"),
    "loop": ("outputs", "loss", "hf-trainer"),
    "model_impl": ("transformers", "megatron"),
}


def _unit_float(text: str) -> float:
    """argparse type: a number in [0, 1)."""
    try:
        value = float(str(text).strip()) if len(str(text)) <= 40 else None
    except ValueError:
        value = None
    if value is None:
        raise argparse.ArgumentTypeError(f"{shorten(text)} is not a number; allowed: 0 <= p < 1") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{value} is out of range; allowed: 0 <= p < 1")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer in 1..MAX_FLAG_INT, ASCII digits only (memplan.bounds.count: the one rule)."""
    return _positive(text)


_positive = count_type(maximum=MAX_FLAG_INT)


def _zero_stage(text: str) -> int:
    """argparse type for --zero: 0, 1, 2 or 3."""
    if str(text).strip() not in ("0", "1", "2", "3"):
        raise argparse.ArgumentTypeError(f"{shorten(text)} is not a ZeRO stage; allowed: 0, 1, 2, 3")
    return int(text)


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the job flags of issue 2 (defaults None: job_from_args fills the seed's scenario)."""
    g = parser.add_argument_group("job (defaults: the seed's scenario; see memplan.options)")
    g.add_argument("--model", metavar="NAME|PATH", help=f"model preset or config.json path (default {DEFAULT_MODEL})")
    g.add_argument("--seq", type=positive_int, metavar="N", help=f"tokens per sequence (default {DEFAULT_SEQ})")
    g.add_argument("--micro-batch", type=positive_int, metavar="N", help="sequences per rank per micro-step (1)")
    g.add_argument("--grad-accum", type=positive_int, metavar="N", help="micro-steps per optimizer step (1)")
    g.add_argument("--gpus", type=rank_count, metavar="N", help=f"world size, all ranks (default {DEFAULT_GPUS})")
    g.add_argument("--gpus-per-node", type=rank_count, metavar="N", help=f"(default {DEFAULT_GPUS_PER_NODE})")
    g.add_argument("--tp", type=rank_count, metavar="N", help="tensor-parallel size (1)")
    g.add_argument("--pp", type=rank_count, metavar="N", help="pipeline-parallel size (1)")
    g.add_argument("--tp-sequence-parallel", action="store_const", const=True, default=None,
                   help="Megatron-style sequence parallelism with --tp (modelled, not measured)")
    g.add_argument("--sp", type=rank_count, metavar="N", help="Ulysses sequence-parallel size (seed: 8)")
    g.add_argument("--zero", type=_zero_stage, metavar="0|1|2|3", help="ZeRO stage (seed: 3)")
    g.add_argument("--offload-optimizer", choices=_CHOICES["offload"], help="(seed: cpu)")
    g.add_argument("--offload-param", choices=_CHOICES["offload"], help="needs ZeRO-3 (seed: none)")
    g.add_argument("--dtype", choices=_CHOICES["dtype"], help="training dtype (seed: fp16)")
    g.add_argument("--checkpointing", choices=_CHOICES["checkpointing"], help="activation checkpointing (none)")
    g.add_argument("--attention", choices=_CHOICES["attention"], help="attention implementation (sdpa)")
    g.add_argument(
        "--optimizer", choices=_CHOICES["optimizer"],
        help="(adamw; becomes cpu_adam under optimizer offload, as DeepSpeed uses DeepSpeedCPUAdam there)",
    )
    g.add_argument("--ds-config", metavar="PATH", help="DeepSpeed JSON; its values replace the seed's, flags win")
    g.add_argument("--loop", choices=_CHOICES["loop"],
                   help="training loop: outputs (DeepSpeed's tutorial loop keeps the model output; default), loss "
                        "(only the loss survives the forward), hf-trainer (transformers' Trainer)")
    g.add_argument("--training-args", metavar="FILE",
                   help="transformers TrainingArguments as to_json_string() writes them; implies --loop hf-trainer "
                        "(the Trainer fills the --ds-config's \"auto\" from them, see memplan.hf)")
    g.add_argument("--alloc-conf", metavar="CONF",
                   help="PYTORCH_CUDA_ALLOC_CONF, e.g. expandable_segments:True (default: torch's defaults)")
    g.add_argument("--model-impl", choices=_CHOICES["model_impl"],
                   help="code that builds the model: transformers (default) or megatron (Megatron's GPT)")
    add_adapter_arguments(parser)


def add_adapter_arguments(parser: argparse.ArgumentParser) -> None:
    """LoRA / PEFT and frozen-parameter flags (part of the job flags)."""
    g = parser.add_argument_group("fine-tuning (default: full training)")
    g.add_argument("--lora-rank", type=positive_int, metavar="R", help="LoRA rank r (adapters on a frozen base)")
    g.add_argument("--lora-targets", metavar="LIST",
                   help="adapted modules, comma-separated (q_proj,v_proj) or all-linear (default: peft's for the family)")
    g.add_argument("--lora-dropout", type=_unit_float, metavar="P", help="dropout on the adapters' input (0)")
    g.add_argument("--peft-config", metavar="PATH", help="adapter_config.json as peft writes it (instead of --lora-*)")
    g.add_argument("--freeze", metavar="LIST",
                   help="frozen parameter groups without adapters: embeddings, lm_head, norms, layers:N")


def _explicit_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The flags given on the command line, as Job field names (zero knobs nested under 'zero')."""
    flat = {
        "seq_len": getattr(args, "seq", None), "micro_batch": getattr(args, "micro_batch", None),
        "grad_accum": getattr(args, "grad_accum", None), "world": getattr(args, "gpus", None),
        "gpus_per_node": getattr(args, "gpus_per_node", None), "tp": getattr(args, "tp", None),
        "pp": getattr(args, "pp", None), "sp": getattr(args, "sp", None), "dtype": getattr(args, "dtype", None),
        "checkpointing": getattr(args, "checkpointing", None), "attention": getattr(args, "attention", None),
        "optimizer": getattr(args, "optimizer", None),
        "tp_sequence_parallel": getattr(args, "tp_sequence_parallel", None),
        "loop": getattr(args, "loop", None), "model_impl": getattr(args, "model_impl", None),
    }
    out = {k: v for k, v in flat.items() if v is not None}
    zero = {
        "stage": getattr(args, "zero", None), "offload_optimizer": getattr(args, "offload_optimizer", None),
        "offload_param": getattr(args, "offload_param", None),
    }
    zero = {k: v for k, v in zero.items() if v is not None}
    if zero:
        out["zero"] = zero
    return out


def _normalize_ds_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """ADAPTER for memplan.dsconfig.apply_to_job_fields: accept its dict flat or nested under
    'training' / 'layout', with ZeRO knobs under 'zero'; return flat Job fields with 'zero' nested."""
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if key in ("training", "layout") and isinstance(value, dict):
            out.update(_normalize_ds_fields(value))
        elif key == "zero" and isinstance(value, dict):
            out.setdefault("zero", {}).update(value)
        elif key == "zero" and value is not None:
            out.setdefault("zero", {})["stage"] = value
        elif value is not None:
            out[key] = value
    return out


#: the largest input file read (memplan.inputs' cap for every input file)
MAX_INPUT_FILE_BYTES = MAX_INPUT_BYTES


def require_regular_file(path: str, flag: str) -> None:
    """Refuse what could hang or flood a read: FIFOs, devices (/dev/zero, /dev/stdin), directories, huge files
    (memplan.inputs.check_regular: ``os.stat``, which does not block on a FIFO, before any open)."""
    check_regular(path, flag, "JSON file", MAX_INPUT_FILE_BYTES)


def hf_path(args: argparse.Namespace) -> bool:
    """Whether the job runs under the Hugging Face Trainer (--loop hf-trainer, or --training-args given): then
    its DeepSpeed JSON is read as HfDeepSpeedConfig reads it and "auto" values are the Trainer's to fill."""
    return getattr(args, "loop", None) == "hf-trainer" or getattr(args, "training_args", None) is not None


def _ds_settings(path: str, hf: bool = False):
    """H3's reading of a DeepSpeed JSON (memplan.dsconfig); errors are InputErrors naming --ds-config."""
    try:
        from . import dsconfig
    except ImportError:
        raise InputError("--ds-config", "reading DeepSpeed configs is not available in this build") from None
    try:
        return dsconfig.ds_settings(dsconfig.load_ds_config(path, hf=hf), hf=hf)
    except InputError as err:
        raise _relabel(err, "--ds-config") from None


def _auto_batch(settings) -> bool:
    from .dsconfig import HF_BATCH_KEYS

    return any(k in settings.auto_keys for k in HF_BATCH_KEYS)


def _ds_batch(settings, fields: dict[str, Any], source: dict[str, str]) -> None:
    """Micro-batch and accumulation as DeepSpeed derives them from train_batch_size and dp
    (DeepSpeedConfig._set_batch_related_parameters), unless both flags were given."""
    if source.get("micro_batch") == "flag" and source.get("grad_accum") == "flag":
        return
    inner = fields.get("tp", 1) * fields.get("pp", 1) * fields.get("sp", 1)
    if fields["world"] % inner:
        return  # the layout error is reported by build_job, naming --gpus
    from .dsconfig import resolve_batch

    # AutoTP: deepspeed.initialize parses the config before AutoTP's mesh exists (deepspeed/__init__.py), so
    # DeepSpeedConfig counts every rank as data-parallel: train_batch_size = micro × accum × world
    autotp = (getattr(settings, "autotp_size", None) or 1) > 1
    try:
        batch = resolve_batch(settings, fields["world"] if autotp else fields["world"] // inner)
    except InputError as err:
        raise _relabel(err, "--ds-config") from None
    for key in ("micro_batch", "grad_accum"):
        if source.get(key) != "flag":
            fields[key], source[key] = batch[key], "ds"


def _relabel(err: InputError, flag: str) -> InputError:
    """Prefix an InputError's field with the flag that supplied the input (unless it already names it)."""
    if err.field.startswith(flag):
        return err
    if err.field in ("model", "ds_config", "ds-config", "input", ""):
        return InputError(flag, err.message)
    return InputError(f"{flag} {err.field.removeprefix('model.')}", err.message)


def _load_model(name_or_path: str, flag: str = "--model"):
    """The ModelSpec for --model (H1's presets; imported here so estimate stays light): a preset name, or a
    config.json read through memplan.inputs; every error names ``flag``."""
    try:
        from .presets import load_model
    except ImportError:
        raise InputError(flag, "model presets are not available in this build") from None
    try:
        return load_model(name_or_path)
    except InputError as err:
        raise _relabel(err, flag) from None


def model_from_arg(name_or_path: str, flag: str = "--model"):
    """The ModelSpec a --model value names (see _load_model), for every command that takes --model."""
    return _load_model(name_or_path, flag)


def resolved_fields(args: argparse.Namespace, seed: bool = True) -> tuple[dict[str, Any], dict[str, str]]:
    """Job fields after defaults, --ds-config and flags, and where each came from ('flag', 'ds', 'default',
    'trainer'). Under --loop hf-trainer (or --training-args) the --ds-config's "auto" is filled as the
    Trainer fills it (memplan.hf); elsewhere "auto" means DeepSpeed's default.

    ``seed=False``: without --ds-config the seed's scenario fills nothing (the specs' own defaults stand), for
    a configuration read from the user's files (plan's --launch-file), whose gaps the article must not fill.
    """
    ds_path = getattr(args, "ds_config", None)
    trainer = trainer_job_of(args)
    if trainer is not None and trainer.fill is not None:
        settings = _settings_of(trainer.fill.config)
    else:
        settings = _ds_settings(ds_path, hf_path(args)) if ds_path else None
    if settings is not None:
        from .dsconfig import apply_to_job_fields

        base, base_src = _normalize_ds_fields(apply_to_job_fields(settings)), "ds"
    else:
        base, base_src = _normalize_ds_fields(SEED_FIELDS if seed else {}), "default"
    fields: dict[str, Any] = {"seq_len": DEFAULT_SEQ, "world": DEFAULT_GPUS, "gpus_per_node": DEFAULT_GPUS_PER_NODE}
    source = {k: "default" for k in fields}
    _merge(fields, source, base, base_src)
    _merge(fields, source, _explicit_fields(args), "flag")
    if trainer is not None:
        _merge(fields, source, trainer.fields, "trainer")
    if settings is not None and not (trainer is None and hf_path(args) and _auto_batch(settings)):
        _ds_batch(settings, fields, source)  # (on the HF path, "auto" batch sizes come from TrainingArguments)
    _resolve_optimizer(fields, source)
    _adapter_fields(args, fields, source)
    alloc = getattr(args, "alloc_conf", None)
    if alloc is not None:
        fields["allocator"], source["allocator"] = parse_alloc_conf(alloc, "--alloc-conf"), "flag"
    return fields, source


def trainer_job_of(args: argparse.Namespace, num_training_steps: int | None = None):
    """memplan.hf.job.TrainerJob for --loop hf-trainer with a --ds-config, or --training-args (None otherwise):
    the arguments from the file (or transformers' defaults) with the job flags written in, the DeepSpeed config
    from --ds-config (or the arguments' deepspeed), "auto" filled for the model and --gpus."""
    loop, path = getattr(args, "loop", None), getattr(args, "training_args", None)
    if path is not None and loop not in (None, "hf-trainer"):
        raise InputError("--training-args", f"describes transformers' Trainer; it needs --loop hf-trainer (given: "
                         f"--loop {loop})")
    if loop != "hf-trainer" and path is None:
        return None
    from .hf import job as hfjob
    from .hf.args import TrainingArgs, load_training_args

    targs = hfjob.with_job_flags(load_training_args(path) if path else TrainingArgs(), _explicit_fields(args))
    ds_config = _trainer_ds_config(args, targs)
    if ds_config is None and path is None:
        return None  # --loop hf-trainer alone: only the loop changes (the Trainer's arguments were not given)
    model = _load_model(getattr(args, "model", None) or DEFAULT_MODEL)
    job = hfjob.trainer_job(ds_config, targs, model=model,
                            world=getattr(args, "gpus", None) or DEFAULT_GPUS, num_training_steps=num_training_steps)
    hfjob.raise_first(job, "--training-args" if path else "TrainingArguments")
    return job


def _trainer_ds_config(args: argparse.Namespace, targs) -> dict | None:
    """The DeepSpeed JSON the Trainer gets: --ds-config, else TrainingArguments.deepspeed (a dict or a path)."""
    from . import dsconfig

    path, flag = getattr(args, "ds_config", None), "--ds-config"
    if path is None and isinstance(targs.deepspeed, dict):
        return targs.deepspeed
    if path is None and isinstance(targs.deepspeed, str):
        path, flag = targs.deepspeed, "--training-args deepspeed"
    if path is None:
        return None
    require_regular_file(path, flag)
    try:
        return dsconfig.load_ds_config(path)
    except InputError as err:
        raise _relabel(err, flag) from None


def _settings_of(cfg: dict):
    """memplan.dsconfig's reading of a filled config (errors name --ds-config)."""
    from . import dsconfig

    try:
        return dsconfig.ds_settings(cfg)
    except InputError as err:
        raise _relabel(err, "--ds-config") from None


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


def _adapter_fields(args: argparse.Namespace, fields: dict[str, Any], source: dict[str, str]) -> None:
    """--lora-* / --peft-config and --freeze → the training fields lora and freeze."""
    rank, targets, dropout = (getattr(args, k, None) for k in ("lora_rank", "lora_targets", "lora_dropout"))
    peft_path = getattr(args, "peft_config", None)
    if peft_path is not None:
        if rank is not None or targets is not None or dropout is not None:
            raise InputError("--peft-config", "give either --peft-config or --lora-rank/--lora-targets/--lora-dropout")
        from .peftconfig import load_peft_config

        fields["lora"], source["lora"] = load_peft_config(peft_path, "--peft-config"), "file"
    elif rank is not None:
        fields["lora"] = {"rank": rank, "targets": _split_list(targets, "--lora-targets") if targets else
                          ("default",), "dropout": dropout or 0.0}
        source["lora"] = "flag"
    elif targets is not None or dropout is not None:
        raise InputError("--lora-targets" if targets is not None else "--lora-dropout", "needs --lora-rank")
    freeze = getattr(args, "freeze", None)
    if freeze is not None:
        fields["freeze"], source["freeze"] = _split_list(freeze, "--freeze"), "flag"


def _split_list(text: str, flag: str) -> tuple[str, ...]:
    """A comma-separated list of names (each a short identifier-like word)."""
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    if not items or len(text) > 2000:
        raise InputError(flag, "needs a comma-separated list of names")
    for item in items:
        if len(item) > 100 or not all(c.isalnum() or c in "_.-:*" for c in item):
            raise InputError(flag, f"{shorten(item, 40)} is not a module or group name")
    return items


def _merge(fields: dict[str, Any], source: dict[str, str], new: dict[str, Any], label: str) -> None:
    """Lay ``new`` over ``fields`` (ZeRO knobs merge key by key), recording where each value came from."""
    for key, value in new.items():
        if key == "zero":
            fields.setdefault("zero", {}).update(value)
            source.update({k: label for k in value})
        else:
            fields[key] = value
            source[key] = label


def _resolve_optimizer(fields: dict[str, Any], source: dict[str, str]) -> None:
    """adamw under optimizer offload is DeepSpeedCPUAdam (engine.get_optimizer_configuration); cpu_adam needs it."""
    offloaded = fields.get("zero", {}).get("offload_optimizer", "none") in ("cpu", "nvme")
    optimizer = fields.get("optimizer", "adamw")
    if offloaded and optimizer == "adamw":
        fields["optimizer"] = "cpu_adam"
    elif optimizer == "cpu_adam" and not offloaded:
        raise _field_error("optimizer", "cpu_adam needs --offload-optimizer cpu or nvme (DeepSpeedCPUAdam runs "
                           "on the host); allowed without offload: adamw, torch_adamw, sgd, lion", source, fields)


def _label(field: str, source: dict[str, str]) -> str:
    """The name a user knows for a Job field: its flag, or its ds-config key when the file supplied it."""
    if source.get(field) == "ds" and field in DS_KEY_OF_FIELD:
        return f"--ds-config {DS_KEY_OF_FIELD[field]}"
    if field in FLAG_OF_FIELD:
        return FLAG_OF_FIELD[field]
    if source.get(field) == "ds":
        return f"--ds-config zero_optimization.{field}"
    return field


def _field_error(field: str, message: str, source: dict[str, str], fields: dict[str, Any]) -> InputError:
    """An InputError for ``field``; a divisibility error names the flag the user gave among its operands."""
    operands = {"world": ("world", "sp", "tp", "pp"), "seq_len": ("seq_len", "sp")}.get(field, ())
    given = [f for f in operands if source.get(f) == "flag" and (f in ("world", "seq_len") or fields.get(f, 1) > 1)]
    if given:
        field = given[0]
    hint = ""
    if field in ("sp", "world") and source.get("sp") == "default" and source.get("world") != "default":
        hint = " (--sp defaults to the seed's 8; pass --sp)"
    return InputError(_label(field, source), message + hint)


#: validator messages of specs.py (no pydantic location) → the Job field they are about
_SUBJECTS = (
    ("gpus (", "world"), ("seq (", "seq_len"), ("offload_param needs", "offload_param"),
    ("offload_optimizer needs", "offload_optimizer"), ("ZeRO stage", "stage"), ("Ulysses sp", "sp"),
    ("num_layers", "pp"), ("tp_sequence_parallel", "tp_sequence_parallel"), ("attention flash", "attention"),
)


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


def build_job(model, fields: dict[str, Any], source: dict[str, str]):
    """Validate the resolved fields into a frozen Job; a failure names the flag (or ds-config key)."""
    from pydantic import ValidationError

    from .specs import Job, TrainingSpec

    layout = {k: fields[k] for k in _LAYOUT_FIELDS if k in fields}
    training = {k: v for k, v in fields.items() if k in TrainingSpec.model_fields}
    if training.get("lora"):
        training["lora"] = _resolved_lora(model, training["lora"], source)
    try:
        return Job(model=model, training=training, layout=layout)
    except ValidationError as err:
        first = err.errors()[0]
        message = first.get("msg", "invalid value").removeprefix("Value error, ").replace("\n", " ")
        got = first.get("input")
        if first.get("loc") and got is not None and not isinstance(got, (dict, list)):
            message = f"{message} (got {shorten(got)})"
        raise _field_error(_subject(tuple(first.get("loc", ())), message), message, source, fields) from None


def _resolved_lora(model, lora: dict[str, Any], source: dict[str, str]) -> dict[str, Any]:
    """LoRA targets resolved for the model: peft's family default for "default"; a target the model lacks is
    refused as peft refuses it."""
    from .params import linear_modules
    from .peftconfig import DEFAULT, DEFAULT_TARGETS, resolve_targets

    flag = "--peft-config target_modules" if source.get("lora") == "file" else "--lora-targets"
    try:
        resolve_targets(model.family, tuple(lora["targets"]), linear_modules(model))
    except ValueError as err:
        raise InputError(flag, str(err)) from None
    if tuple(lora["targets"]) == (DEFAULT,):
        lora = {**lora, "targets": DEFAULT_TARGETS[model.family]}
    return lora


def job_from_args(args: argparse.Namespace, seed: bool = True):
    """The validated Job the flags describe (see the module docstring for the order of precedence; ``seed``:
    see resolved_fields)."""
    fields, source = resolved_fields(args, seed)
    model = _load_model(getattr(args, "model", None) or DEFAULT_MODEL)
    return build_job(model, fields, source)


def explicit_flags(args: argparse.Namespace) -> list[str]:
    """The job flags given on the command line (for reports that say what was assumed)."""
    given = _explicit_fields(args)
    names = [n for n in given if n != "zero"] + list(given.get("zero", {}))
    extra = [f for f, dest in (("--model", "model"), ("--ds-config", "ds_config"), ("--training-args", "training_args"))
             if getattr(args, dest, None)]
    return extra + [FLAG_OF_FIELD.get(n, n) for n in names]


__all__ = ["SEED_FIELDS", "add_job_arguments", "build_job", "job_from_args", "positive_int", "resolved_fields"]
