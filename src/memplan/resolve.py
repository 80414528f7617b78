"""A job resolved once, for every command: defaults, files, flags → one Job and each value's source.

``resolve_job(JobRequest) -> ResolvedJob``. The order (later wins):

1. defaults. The article's job (no --model, or --model 176b: its model) keeps the article's settings
   (examples/seed-176b: seq 32768, 8 GPUs on one node of A100-80GB, ZeRO-3 with the optimizer offloaded to
   CPU, fp16, Ulysses sp 8 and the ds config's bucket knobs) unless a file describes the job. Any other model
   gets neutral defaults: DeepSpeed 0.19.8's own default for every ZeRO knob (runtime/zero/config.py; stage
   0), bf16 (fp16 on a GPU without bf16), DeepSpeed's fused AdamW, seq min(4096, max_position_embeddings),
   one node of the GPU's usual size (memplan.nodes);
2. --ds-config (DeepSpeed's defaults for what it leaves out), then a launch line's values (memplan.check.
   launch_job: Megatron-DeepSpeed's layout, batch, recompute and optimizer), then TrainingArguments
   (--training-args, --loop hf-trainer: the Trainer fills "auto");
3. explicit flags;
4. what DeepSpeed / Megatron derive: micro-batch and accumulation from train_batch_size and dp
   (DeepSpeedConfig._set_batch_related_parameters), Megatron's accumulation from its global batch, the
   optimizer under offload (memplan.optimizers).

Every value keeps its source (``Source``: article, deepspeed, memplan, file, flag, derived), which each
command prints with its output. Validation happens once (memplan.jobbuild.build_job).
"""

from __future__ import annotations

from typing import Any

from .errors import InputError
from .jobbuild import build_job, field_error, parse_alloc_conf, relabel, split_list
from .jobrequest import (
    ARTICLE,
    ARTICLE_FIELDS,
    ARTICLE_GPU,
    ARTICLE_GPUS,
    ARTICLE_MODEL,
    ARTICLE_SEQ,
    NEUTRAL_SEQ,
    JobRequest,
    ResolvedJob,
    Source,
    SourceKind,
    is_article,
)

#: the request types live in memplan.jobrequest; commands import them from here too
__all__ = ["ARTICLE", "ARTICLE_FIELDS", "ARTICLE_GPU", "ARTICLE_GPUS", "ARTICLE_MODEL", "ARTICLE_SEQ", "NEUTRAL_SEQ",
           "JobRequest", "ResolvedJob", "Source", "SourceKind", "is_article", "model_from_arg", "resolve_adapters",
           "resolve_facts", "resolve_job", "resolved_fields"]

def _explicit(req: JobRequest) -> dict[str, Any]:
    """The flags given, as Job field names (ZeRO knobs nested under 'zero')."""
    flat = {"seq_len": req.seq, "micro_batch": req.micro_batch, "grad_accum": req.grad_accum, "world": req.gpus,
            "gpus_per_node": req.gpus_per_node, "tp": req.tp, "pp": req.pp, "sp": req.sp, "dtype": req.dtype,
            "checkpointing": req.checkpointing, "attention": req.attention, "optimizer": req.optimizer,
            "tp_sequence_parallel": req.tp_sequence_parallel, "loop": req.loop, "model_impl": req.model_impl,
            "layer_backward_hooks": req.layer_backward_hooks}
    out = {k: v for k, v in flat.items() if v is not None}
    zero = {"stage": req.zero, "offload_optimizer": req.offload_optimizer, "offload_param": req.offload_param}
    zero = {k: v for k, v in zero.items() if v is not None}
    if zero:
        out["zero"] = zero
    return out


def _normalize_ds(fields: dict[str, Any]) -> dict[str, Any]:
    """memplan.dsconfig.apply_to_job_fields' dict (nested under training / layout / zero) as flat Job fields."""
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if key in ("training", "layout") and isinstance(value, dict):
            out.update(_normalize_ds(value))
        elif key == "zero" and isinstance(value, dict):
            out.setdefault("zero", {}).update(value)
        elif value is not None:
            out[key] = value
    return out


class _Fields:
    """Job fields being resolved, with each value's source label and origin (a flag, key or rule)."""

    def __init__(self):
        self.values: dict[str, Any] = {}
        self.source: dict[str, str] = {}
        self.origin: dict[str, str] = {}

    def merge(self, new: dict[str, Any], label: str, origin: str | dict[str, str] = "") -> None:
        for key, value in new.items():
            keys = value if key == "zero" else {key: value}
            if key == "zero":
                self.values.setdefault("zero", {}).update(value)
            else:
                self.values[key] = value
            for k in keys:
                self.source[k] = label
                self.origin[k] = origin.get(k, "") if isinstance(origin, dict) else origin

    def error(self, field: str, message: str) -> InputError:
        return field_error(field, message, self.source, self.values, self.origin)


def _load_model(name_or_path: str, flag: str = "--model"):
    """The ModelSpec for --model (memplan.presets; imported here so estimate stays light); errors name ``flag``."""
    from .presets import load_model

    try:
        return load_model(name_or_path)
    except InputError as err:
        raise relabel(err, flag) from None


def model_from_arg(name_or_path: str, flag: str = "--model"):
    """The ModelSpec a --model value names, for every command that takes --model."""
    return _load_model(name_or_path, flag)


def default_gpu(req: JobRequest):
    """(GpuSpec or None, its source): --gpu, else the article's A100-80GB for the article's job."""
    from .gpus import resolve_gpu

    if req.gpu is not None:
        return resolve_gpu(req.gpu), "flag"
    if is_article(req.model) and req.ds_config is None and req.launch is None:
        return resolve_gpu(ARTICLE_GPU), "article"
    return None, ""


def _ds_settings(path: str, hf: bool, client_optimizer: bool = False):
    """memplan.dsconfig's reading of --ds-config; ``client_optimizer``: the script hands DeepSpeed its own
    optimizer (Megatron-DeepSpeed), so the JSON's optimizer section is never built and is not read."""
    from . import dsconfig

    try:
        cfg = dsconfig.load_ds_config(path, hf=hf)
        if client_optimizer:
            cfg = {k: v for k, v in cfg.items() if k != "optimizer"}
        return dsconfig.ds_settings(cfg, hf=hf)
    except InputError as err:
        raise relabel(err, "--ds-config") from None


def _settings_of(cfg: dict):
    from . import dsconfig

    try:
        return dsconfig.ds_settings(cfg)
    except InputError as err:
        raise relabel(err, "--ds-config") from None


def _megatron(req: JobRequest) -> bool:
    from .check.rules_job import is_megatron

    return req.launch is not None and is_megatron(req.launch)


def hf_path(req: JobRequest) -> bool:
    """Whether the job runs under the Hugging Face Trainer (--loop hf-trainer, or --training-args given)."""
    return req.loop == "hf-trainer" or req.training_args is not None


def _defaults(f: _Fields, req: JobRequest, model, gpu, files: bool) -> None:
    from .nodes import DEFAULT_GPUS_PER_NODE, node_of

    if is_article(req.model):
        f.merge({"seq_len": ARTICLE_SEQ, "world": ARTICLE_GPUS, "gpus_per_node": ARTICLE_GPUS}, "article", ARTICLE)
        if not files:
            f.merge(ARTICLE_FIELDS, "article", ARTICLE)
        return
    node = node_of(gpu.name if gpu is not None else None)
    per_node = node.gpus if node else DEFAULT_GPUS_PER_NODE
    where = f"one {node.name}" if node else f"one node of {per_node}, the usual"
    seq = min(NEUTRAL_SEQ, model.max_position_embeddings)
    f.merge({"seq_len": seq}, "memplan", f"min({NEUTRAL_SEQ}, max positions {model.max_position_embeddings})")
    f.merge({"world": per_node, "gpus_per_node": per_node}, "memplan", where)
    bf16 = gpu is None or gpu.bf16
    f.merge({"dtype": "bf16" if bf16 else "fp16"}, "memplan", "" if bf16 else f"{gpu.name} has no bf16")


def _launch_fields(f: _Fields, req: JobRequest, settings) -> int | None:
    """Lay the launch line's values over the fields; returns Megatron's global batch (None when not given)."""
    from .check.launch_job import launch_fields
    from .check.rules_job import is_megatron

    launch = req.launch
    values = launch_fields(launch, is_megatron(launch))
    global_batch = values.pop("global_batch", (None, ""))[0]
    if settings is not None and settings.dtype is not None:
        values.pop("dtype", None)
    f.merge({k: v for k, (v, _) in values.items()}, "launch", {k: f"{launch.source} {o}" for k, (_, o) in values.items()})
    return global_batch


def _megatron_batch(f: _Fields, global_batch: int | None, label: str) -> None:
    """grad_accum as Megatron's training loop sets it (set_train_batch_size every iteration)."""
    v = f.values
    inner = v.get("tp", 1) * v.get("pp", 1) * v.get("sp", 1)
    if v.get("world", 1) % inner:
        return  # the layout error is build_job's
    dp, micro = v["world"] // inner, v.get("micro_batch", 1)
    gbs = global_batch or micro * dp
    if gbs % (micro * dp):
        raise InputError(f"{label} --global-batch-size", f"{gbs} is not a multiple of micro-batch {micro} × dp {dp} "
                         "(megatron/microbatches.py ConstantNumMicroBatches asserts it); allowed: a multiple of "
                         f"{micro * dp}")
    f.merge({"grad_accum": gbs // (micro * dp)}, "derived", f"Megatron's global batch {gbs} / (micro {micro} × dp {dp})")


def _ds_batch(f: _Fields, settings) -> None:
    """Micro-batch and accumulation as DeepSpeed derives them from train_batch_size and dp, unless flags gave both."""
    if f.source.get("micro_batch") == "flag" and f.source.get("grad_accum") == "flag":
        return
    v = f.values
    inner = v.get("tp", 1) * v.get("pp", 1) * v.get("sp", 1)
    if v["world"] % inner:
        return  # the layout error is reported by build_job, naming --gpus
    from .dsconfig import resolve_batch

    # AutoTP: deepspeed.initialize parses the config before AutoTP's mesh exists (deepspeed/__init__.py), so
    # DeepSpeedConfig counts every rank as data-parallel: train_batch_size = micro × accum × world
    autotp = (getattr(settings, "autotp_size", None) or 1) > 1
    try:
        batch = resolve_batch(settings, v["world"] if autotp else v["world"] // inner)
    except InputError as err:
        raise relabel(err, "--ds-config") from None
    for key in ("micro_batch", "grad_accum"):
        if f.source.get(key) != "flag" and batch[key] != v.get(key):
            f.merge({key: batch[key]}, "derived", "DeepSpeed: train_batch_size = micro × accum × dp")


def _optimizer(f: _Fields) -> None:
    """The optimizer DeepSpeed runs (memplan.optimizers: one rule for every command)."""
    from .optimizers import optimizer_problem, optimizer_run

    offload = f.values.get("zero", {}).get("offload_optimizer", "none")
    optimizer = f.values.get("optimizer", "adamw")
    problem = optimizer_problem(optimizer, offload)
    if problem:
        raise f.error("optimizer", problem)
    run = optimizer_run(optimizer, offload)
    if run != optimizer:
        f.merge({"optimizer": run}, "derived", "DeepSpeedCPUAdam under optimizer offload")


def _adapters(f: _Fields, req: JobRequest) -> None:
    """--lora-* / --peft-config and --freeze → the training fields lora and freeze."""
    if req.peft_config is not None:
        if req.lora_rank is not None or req.lora_targets is not None or req.lora_dropout is not None:
            raise InputError("--peft-config", "give either --peft-config or --lora-rank/--lora-targets/--lora-dropout")
        from .peftconfig import load_peft_config

        f.merge({"lora": load_peft_config(req.peft_config, "--peft-config")}, "file", "--peft-config")
    elif req.lora_rank is not None:
        targets = split_list(req.lora_targets, "--lora-targets") if req.lora_targets else ("default",)
        f.merge({"lora": {"rank": req.lora_rank, "targets": targets, "dropout": req.lora_dropout or 0.0}}, "flag",
                "--lora-rank")
    elif req.lora_targets is not None or req.lora_dropout is not None:
        raise InputError("--lora-targets" if req.lora_targets is not None else "--lora-dropout", "needs --lora-rank")
    if req.freeze is not None:
        f.merge({"freeze": split_list(req.freeze, "--freeze")}, "flag", "--freeze")


def resolved_fields(req: JobRequest, model=None, gpu=None, trainer=None, variant: dict | None = None,
                    settings=None) -> tuple[dict[str, Any], dict[str, str], dict[str, str]]:
    """(Job fields, source label per field, origin per field) after defaults, files, flags and derivations.
    ``variant``: field changes laid over the files and flags before the derivations (memplan.check.verdict's
    nearest valid variants; ``pipeline_engine`` is the Megatron spec's). ``settings``: the --ds-config as a
    caller already read it (memplan check's reading, which leaves out an optimizer memplan does not model)."""
    model = model if model is not None else _load_model(req.model or ARTICLE_MODEL)
    if settings is not None:
        pass
    elif trainer is not None and trainer.fill is not None:
        settings = _settings_of(trainer.fill.config)
    else:
        settings = _ds_settings(req.ds_config, hf_path(req), _megatron(req)) if req.ds_config else None
    f = _Fields()
    _defaults(f, req, model, gpu, files=bool(req.ds_config or req.launch is not None or req.training_args))
    if settings is not None:
        from .dsconfig import apply_to_job_fields

        f.merge(_normalize_ds(apply_to_job_fields(settings)), "ds", "--ds-config")
    global_batch = _launch_fields(f, req, settings) if req.launch is not None else None
    f.merge(_explicit(req), "flag")
    if req.nodes is not None and req.gpus_per_node is None:
        f.merge({"gpus_per_node": max(1, f.values["world"] // req.nodes)}, "flag", "--nodes")
    if trainer is not None:
        f.merge(trainer.fields, "trainer", "--training-args" if req.training_args else "TrainingArguments")
    if variant:
        _variant(f, variant)
    if f.values.get("model_impl") == "megatron" and req.launch is not None:
        _megatron_batch(f, global_batch, req.launch.source)
    elif f.values.get("model_impl") == "megatron" and "megatron" not in f.values:
        _megatron_default(f, model)
    elif settings is not None and not (trainer is None and hf_path(req) and _auto_batch(settings)):
        _ds_batch(f, settings)  # (on the HF path, "auto" batch sizes come from TrainingArguments)
    _optimizer(f)
    _adapters(f, req)
    if req.alloc_conf is not None:
        f.merge({"allocator": parse_alloc_conf(req.alloc_conf, "--alloc-conf")}, "flag", "--alloc-conf")
    return f.values, f.source, f.origin


def _megatron_default(f: _Fields, model) -> None:
    """Megatron's GPT without a launch line: the line `memplan plan --emit` writes (memplan.check.megatron_model), i.e.
    --no-pipeline-parallel at pp 1 (DeepSpeed's PipelineEngine refuses ZeRO-2/3 and a grid without the sp ranks)
    and the model's own dropout."""
    from .check.megatron_model import megatron_spec

    f.merge({"megatron": megatron_spec(model, f.values.get("pp", 1))}, "memplan",
            "the launch plan --emit writes: --no-pipeline-parallel at pp 1, the model's dropout")


def _variant(f: _Fields, variant: dict) -> None:
    changes = dict(variant)
    engine = changes.pop("pipeline_engine", None)
    if engine is not None and "megatron" in f.values:
        changes["megatron"] = f.values["megatron"].model_copy(update={"pipeline_engine": engine})
    f.merge(changes, "derived", "check's nearest valid variant, or what DeepSpeed ignores")


def _auto_batch(settings) -> bool:
    from .dsconfig import HF_BATCH_KEYS

    return any(k in settings.auto_keys for k in HF_BATCH_KEYS)


#: the job facts a plan fixes (the rest it searches)
FACTS = ("seq_len", "world", "gpus_per_node", "dtype", "model_impl")


def resolve_facts(req: JobRequest, gpu=None) -> tuple[Any, dict[str, Any], tuple[Source, ...]]:
    """(model, {fact: value}, sources) for `memplan plan`: model, seq, world, GPUs per node, dtype and model
    implementation with resolve_job's defaults (the article's for its model, neutral otherwise) and flags."""
    from .sources import fact_sources

    model = _load_model(req.model or ARTICLE_MODEL)
    f = _Fields()
    _defaults(f, req, model, gpu, files=False)
    f.merge({k: v for k, v in _explicit(req).items() if k in FACTS}, "flag")
    facts = {k: f.values.get(k) for k in FACTS}
    facts["dtype"] = facts["dtype"] or "bf16"
    facts["model_impl"] = facts["model_impl"] or "transformers"
    return model, facts, fact_sources(model, req, facts, f.source, f.origin)


def resolve_adapters(req: JobRequest, model) -> tuple[dict[str, Any] | None, tuple[str, ...]]:
    """The adapter flags of ``req`` (--lora-*, --peft-config, --freeze) resolved for ``model``: LoraSpec fields
    (None: full training) and the frozen groups, which `memplan plan` keeps fixed across its search."""
    from .jobbuild import resolved_lora

    f = _Fields()
    _adapters(f, req)
    lora = f.values.get("lora")
    if lora is not None:
        lora = resolved_lora(model, lora, f.source, f.origin)
    return lora, tuple(f.values.get("freeze", ()))


def resolve_job(req: JobRequest, num_training_steps: int | None = None) -> ResolvedJob:
    """The validated Job ``req`` describes, where each value came from, and the Trainer's reading."""
    from .sources import job_sources
    from .trainerjob import trainer_job_of

    gpu, gpu_label = default_gpu(req)
    model = _load_model(req.model or ARTICLE_MODEL)
    trainer = trainer_job_of(req, model, num_training_steps)
    fields, source, origin = resolved_fields(req, model, gpu, trainer)
    job = build_job(model, fields, source, origin)
    sources = job_sources(job, req, source, origin)
    if gpu is not None:
        sources += (Source(field="gpu", value=gpu.name, source="flag" if gpu_label == "flag" else "article",
                           origin="--gpu" if gpu_label == "flag" else f"{ARTICLE}: 8×A100-80GB"),)
    return ResolvedJob(job=job, sources=sources, gpu=gpu, trainer=trainer)


__all__ = ["ARTICLE_FIELDS", "ARTICLE_GPU", "ARTICLE_MODEL", "ARTICLE_SEQ", "FACTS", "JobRequest", "ResolvedJob",
           "Source", "default_gpu", "hf_path", "is_article", "model_from_arg", "resolve_facts", "resolve_job",
           "resolved_fields"]
