"""The transformers side of a measurement: the HF config of a ModelSpec, the model, its layers.

`hf_config_dict` runs in the parent (no torch); the rest runs in the worker and imports torch and
transformers inside the functions. Nothing is downloaded and remote code is never trusted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..specs import Job, ModelSpec

#: `--attention` → transformers attn_implementation. "flash" runs sdpa restricted to torch's FlashAttention
#: backend (torch.nn.attention.sdpa_kernel(SDPBackend.FLASH_ATTENTION)): the flash-attn package is not
#: installed on the measuring machine, and torch's flash kernel keeps the same O(seq) memory.
ATTN_IMPLEMENTATION = {"eager": "eager", "sdpa": "sdpa", "flash": "sdpa"}

#: config keys that would make transformers fetch or run code from elsewhere
_UNSAFE_KEYS = ("auto_map", "_name_or_path", "transformers_version", "architectures")


def _preset_file(spec: ModelSpec) -> Path | None:
    """The config.json behind ``spec``: its path, or the preset's models/<name>.json (memplan.presets)."""
    from ..presets import PRESETS_DIR

    as_path = Path(spec.name).expanduser()
    if as_path.is_file():
        return as_path
    candidate = PRESETS_DIR / f"{spec.name}.json"
    return candidate if candidate.is_file() else None


def _synthesized(spec: ModelSpec) -> dict[str, Any]:
    """An HF config for a ModelSpec without a config file (tests' tiny models): Llama-style families only."""
    if spec.family not in ("llama", "mistral", "qwen2", "qwen3"):
        raise ValueError(f"no config.json found for model {spec.name!r} ({spec.family}); pass a config.json path")
    return {
        "model_type": spec.family,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "attention_bias": spec.attention_bias,
        "mlp_bias": spec.mlp_bias,
    }


def hf_config_dict(spec: ModelSpec) -> dict[str, Any]:
    """The HF config.json keys to build ``spec`` with (underscore keys and remote-code keys dropped; a gemma3
    multimodal config gives its text_config as gemma3_text, the model memplan estimates)."""
    from ..hfconfig import transformers_config
    from ..inputs import read_json_object

    path = _preset_file(spec)
    raw = read_json_object(path, "--model", "json", "config.json") if path else _synthesized(spec)
    if raw.get("model_type") == "gemma3":
        raw = transformers_config(raw)
    return {k: v for k, v in raw.items() if not k.startswith("_") and k not in _UNSAFE_KEYS}


def make_config(hf_cfg: dict[str, Any], num_layers: int | None = None):
    """transformers config from the dict (AutoConfig.for_model), use_cache off, depth overridden if asked."""
    import transformers

    config = transformers.AutoConfig.for_model(**hf_cfg)
    if num_layers is not None:
        config.num_hidden_layers = num_layers
    config.use_cache = False
    return config


def torch_dtype(job: Job):
    """The torch dtype of the training dtype."""
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[job.training.dtype]


#: model types whose word embedding is nn.Embedding(vocab, hidden) without padding_idx
_NO_PADDING_IDX = ("gpt2", "gpt_neox", "bloom")


def inits_padding_row(config) -> bool:
    """Whether transformers' weight init indexes the embedding's padding row: PreTrainedModel._init_weights
    (modeling_utils.py) runs ``init.zeros_(module.weight[module.padding_idx])`` for an nn.Embedding built
    with padding_idx=config.pad_token_id (LlamaModel, Gemma2Model, Phi3Model, Olmo2Model, ... all do)."""
    text = config.get_text_config()
    return text.pad_token_id is not None and text.model_type not in _NO_PADDING_IDX


def build_model(config, job: Job, ds_config: dict, device: str):
    """Random-init causal LM built directly on ``device`` (partitioned by deepspeed.zero.Init for ZeRO-3).

    ZeRO-3 and a padding row (Gemma 2/3, Phi-3 and OLMo 2 configs set pad_token_id): inside a plain
    ``deepspeed.zero.Init`` transformers does not know the weights are partitioned, and post_init's
    _init_weights indexes ``weight[padding_idx]`` of a size-0 partition (IndexError, from_config and
    from_pretrained alike). Such models are built the way transformers itself builds under ZeRO-3 when a
    ``HfDeepSpeedConfig`` is alive (what Trainer / accelerate create): PreTrainedModel._from_config enters
    no_init_weights + deepspeed.zero.Init(deepspeed_config()) and then integrations/deepspeed.py
    initialize_weights_zero3 gathers each module's partitions (GatheredParameters, modifier_rank=0) to
    initialise them whole; from_pretrained likewise loads through _load_state_dict_into_zero3_model and
    initialises missing keys under GatheredParameters. Same parameters, dtype and partitioning; the init
    phase gathers one module at a time. Other models keep the plain deepspeed.zero.Init build (what the
    committed measurements ran)."""
    import torch
    import transformers

    kwargs = {"dtype": torch_dtype(job), "attn_implementation": ATTN_IMPLEMENTATION[job.training.attention]}
    if job.training.zero.stage == 3 and inits_padding_row(config):
        from transformers.integrations import HfDeepSpeedConfig

        hf_ds_config = HfDeepSpeedConfig(ds_config)  # transformers keeps a weak reference: keep it alive
        model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
        model._memplan_hf_ds_config = hf_ds_config
    elif job.training.zero.stage == 3:
        import deepspeed
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        # the model class imported outside zero.Init: importing its module (masking_utils → torch._dynamo) under
        # zero.Init's patched tensor constructors fails ("Signature mismatch ... tensor_pynew", seen on the CPU)
        MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]

        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
        bound_partitions(model)
    else:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    model.train()  # from_config leaves the module in training mode; say so (dropout masks count)
    t = job.training
    if t.checkpointing == "full":
        kwargs = {"gradient_checkpointing_kwargs": {"use_reentrant": t.checkpoint_reentrant}}
        if t.checkpoint_every_n_layers != 1 or t.checkpoint_offload:  # transformers 5.17's own options
            kwargs.update(every_n_layers=t.checkpoint_every_n_layers, offload=t.checkpoint_offload)
        model.gradient_checkpointing_enable(**kwargs)
    freeze(model, job)
    if t.lora is not None:
        model = add_lora(model, job)
    return model


# The bound on a partition's values: above any initialiser's reach in these random-init models (nn.Embedding's
# reset_parameters draws N(0, 1); transformers' _init_weights N(0, initializer_range ≤ 0.02), ones, zeros).
PARTITION_BOUND = 8.0


def bound_partitions(model) -> None:
    """Finite values in every ZeRO-3 partition, in place (no allocation: the ledger is unchanged).

    Parameters a module makes with ``torch.empty`` and leaves to PreTrainedModel._init_weights (the MoE experts'
    gate_up_proj and down_proj of DeepseekV3NaiveMoe, Qwen3-MoE, Mixtral) keep uninitialised memory under a plain
    ``deepspeed.zero.Init``: post_init runs on the size-0 partitioned tensors, a no-op, and zero.Init copied the
    garbage into ``ds_tensor``. Seen on the CPU: an expert partition of 2.8e19 and one of inf on one build in
    three, a non-finite gradient norm and DeepSpeed's overflow check skipping the optimizer step, so no optimizer
    state is ever made. nan_to_num_ and clamp_ rewrite the values and touch no allocator."""
    import torch

    with torch.no_grad():
        for param in model.parameters():
            part = getattr(param, "ds_tensor", None)
            if part is not None and part.is_floating_point() and part.numel():
                part.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0).clamp_(-PARTITION_BOUND, PARTITION_BOUND)


def freeze(model, job: Job) -> None:
    """requires_grad off for the job's frozen groups (memplan.params.frozen_names names them)."""
    if not job.training.freeze:
        return
    from ..params import frozen_names

    names = frozen_names(job.model, job.training.freeze)
    for name, param in model.named_parameters():
        if name in names:
            param.requires_grad_(False)


def add_lora(model, job: Job):
    """peft's get_peft_model with the job's LoraConfig, after checkpointing is enabled (as TRL and the
    Trainer's users do). peft freezes the base and adds lora_A / lora_B (and DoRA's magnitude) per target."""
    from peft import LoraConfig, get_peft_model

    lora = job.training.lora
    targets = "all-linear" if "all-linear" in lora.targets else list(lora.targets)
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=targets, lora_dropout=lora.dropout,
                        bias=lora.bias, modules_to_save=list(lora.modules_to_save) or None,
                        use_rslora=lora.use_rslora, use_dora=lora.use_dora, task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def decoder_layers(model) -> list:
    """The decoder layers: model.layers (Llama family), transformer.h (GPT-2, BLOOM), gpt_neox.layers; under
    peft, the same paths inside base_model.model."""
    for path in ("model.layers", "transformer.h", "gpt_neox.layers", "base_model.model.model.layers",
                 "base_model.model.transformer.h", "base_model.model.gpt_neox.layers"):
        obj = model
        for attr in path.split("."):
            obj = getattr(obj, attr, None)
        if obj is not None:
            return list(obj)
    return []


def final_modules(model) -> list[tuple[str, Any]]:
    """(label, module) of the final norm and lm_head, where found."""
    out = []
    paths = (("final norm", "model.norm"), ("final norm", "transformer.ln_f"),
             ("final norm", "gpt_neox.final_layer_norm"), ("lm_head", "lm_head"), ("lm_head", "embed_out"))
    if hasattr(model, "base_model") and hasattr(model.base_model, "model"):  # peft
        paths = tuple((label, "base_model.model." + path) for label, path in paths)
    for label, path in paths:
        obj = model
        for attr in path.split("."):
            obj = getattr(obj, attr, None)
        if obj is not None:
            out.append((label, obj))
    return out


def meta_param_count(hf_cfg: dict[str, Any]) -> int:
    """Parameters of the full-depth model built on the meta device (tied weights counted once)."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(make_config(hf_cfg))
    return sum(p.numel() for p in model.parameters())


def analytic_param_count(spec: ModelSpec) -> int | None:
    """memplan.params.count_params(spec), or None while that module is missing."""
    try:
        from .. import params
    except ImportError:
        return None
    return params.count_params(spec).total_params
