"""LoRA / PEFT inputs: peft's adapter_config.json, its default targets, and which linears an adapter covers.

peft (peft/tuners/lora/config.py LoraConfig; peft/utils/constants.py
TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING; peft/tuners/tuners_utils.py check_target_module_exists and
_maybe_include_all_linear_layers) matches a target name against every module's qualified name: the module is
adapted when its name equals the target or ends with ``"." + target``. ``all-linear`` adapts every nn.Linear /
Conv1D except the output layer (lm_head). Pure: no peft import.
"""

from __future__ import annotations

from typing import Any

from .errors import InputError, shorten

#: peft's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING for the families memplan knows (used when
#: LoraConfig.target_modules is None)
DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    "llama": ("q_proj", "v_proj"), "mistral": ("q_proj", "v_proj"), "mixtral": ("q_proj", "v_proj"),
    "qwen2": ("q_proj", "v_proj"), "qwen3": ("q_proj", "v_proj"), "gpt2": ("c_attn",),
    "gpt_neox": ("query_key_value",), "bloom": ("query_key_value",), "gemma2": ("q_proj", "v_proj"),
    "gemma3_text": ("q_proj", "v_proj"), "phi3": ("qkv_proj",), "olmo2": ("q_proj", "v_proj"),
    "qwen3_moe": ("q_proj", "v_proj"), "deepseek_v3": ("q_proj", "kv_a_proj_with_mqa"),
}
ALL_LINEAR = "all-linear"
#: the targets placeholder the command line uses before the model is known
DEFAULT = "default"

#: adapter_config.json keys that change memory, and those that only name or describe the adapter
_MEMORY_KEYS = ("r", "target_modules", "lora_dropout", "bias", "modules_to_save", "use_rslora", "use_dora",
                "lora_alpha")
_IGNORED_KEYS = ("peft_type", "task_type", "base_model_name_or_path", "revision", "inference_mode",
                 "fan_in_fan_out", "init_lora_weights", "layers_to_transform", "layers_pattern", "rank_pattern",
                 "alpha_pattern", "megatron_config", "megatron_core", "loftq_config", "layer_replication",
                 "runtime_config", "auto_mapping", "exclude_modules", "lora_bias", "eva_config", "corda_config",
                 "trainable_token_indices", "target_parameters", "qalora_group_size", "use_qalora",
                 "lora_ga_config", "arrow_config", "ensure_weight_tying")


def load_peft_config(path: str, flag: str) -> dict[str, Any]:
    """adapter_config.json → LoraSpec fields (InputError naming ``flag`` and the key on bad input)."""
    from .inputs import read_json

    # peft's PeftConfigMixin.from_json_file: json.load of the text (a BOM refused, the last duplicate wins)
    return lora_fields(read_json(path, flag, "json", "adapter_config.json"), flag)


def lora_fields(raw: Any, flag: str) -> dict[str, Any]:
    """The LoraSpec fields of a parsed adapter_config.json."""
    if not isinstance(raw, dict):
        raise InputError(flag, "must be a JSON object as peft's LoraConfig.save_pretrained writes it")
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise InputError(f"{flag} peft_type", f"{shorten(peft_type, 20)} is not modelled; allowed: LORA")
    unknown = [k for k in raw if k not in _MEMORY_KEYS and k not in _IGNORED_KEYS]
    if unknown:
        raise InputError(f"{flag} {shorten(unknown[0], 40)[1:-1]}", "is not a LoraConfig field")
    r = raw.get("r", 8)
    if isinstance(r, bool) or not isinstance(r, int) or not 1 <= r <= 2**16:  # LoraSpec.rank's bound
        raise InputError(f"{flag} r", f"{shorten(r)} must be a positive integer up to 65536")
    targets = raw.get("target_modules")
    if targets is None:
        targets = (DEFAULT,)
    elif isinstance(targets, str):
        if targets.lower() != ALL_LINEAR:
            raise InputError(f"{flag} target_modules", "a regular expression is not modelled; allowed: a list of "
                             "module names or all-linear")
        targets = (ALL_LINEAR,)
    elif isinstance(targets, list) and targets and all(isinstance(t, str) and t for t in targets):
        targets = tuple(targets)
    else:
        raise InputError(f"{flag} target_modules", "must be a non-empty list of module names or all-linear")
    dropout = raw.get("lora_dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise InputError(f"{flag} lora_dropout", f"{shorten(dropout)} must be a number in [0, 1)")
    bias = raw.get("bias", "none")
    if bias not in ("none", "all", "lora_only"):
        raise InputError(f"{flag} bias", f"{shorten(bias, 20)} is not allowed; allowed: none, all, lora_only")
    saved = raw.get("modules_to_save") or ()
    if not isinstance(saved, (list, tuple)) or not all(isinstance(x, str) for x in saved):
        raise InputError(f"{flag} modules_to_save", "must be a list of module names")
    for key in ("use_rslora", "use_dora"):
        if not isinstance(raw.get(key, False), bool):
            raise InputError(f"{flag} {key}", "must be true or false")
    alpha = raw.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise InputError(f"{flag} lora_alpha", f"{shorten(alpha)} must be a positive number")
    return {"rank": r, "alpha": float(alpha), "targets": targets, "dropout": float(dropout), "bias": bias,
            "modules_to_save": tuple(saved), "use_rslora": raw.get("use_rslora", False),
            "use_dora": raw.get("use_dora", False)}


#: model types whose experts transformers 5.17 fuses into 3-D parameters and whose LoRA targets peft rewrites into
#: ``target_parameters`` (peft/utils/transformers_weight_conversion.py _convert_peft_config_moe, keyed through
#: transformers' conversion_mapping._MODEL_TO_CONVERSION_PATTERN: mixtral → "mixtral"; qwen3_moe and deepseek_v3 →
#: "qwen2_moe"): the transformers-4 names of the router and of the experts' projections it maps
#: (_MOE_TARGET_MODULE_MAPPING); "all-linear" maps all of them
MOE_PARAMETER_TARGETS = {"mixtral": ("gate", "w1", "w3", "w2"),
                         "qwen3_moe": ("gate", "gate_proj", "up_proj", "down_proj"),
                         "deepseek_v3": ("gate", "gate_proj", "up_proj", "down_proj")}


def parameter_wrapper_targets(family: str, targets: tuple[str, ...]) -> tuple[str, ...]:
    """The targets peft adapts through lora.ParamWrapper on this family (the router's weight, the fused experts)."""
    names = MOE_PARAMETER_TARGETS.get(family, ())
    if ALL_LINEAR in targets:
        return names
    return tuple(t for t in targets if any(module_matches(t, n) for n in names))


#: the transformers-5 parameters peft wraps for each mapped name (peft's _MOE_TARGET_MODULE_MAPPING values,
#: matched against named_parameters by suffix), in the order the block registers them
_WRAPPED = {"gate": "gate.weight", "w1": "gate_up_proj", "w3": "gate_up_proj", "gate_proj": "gate_up_proj",
            "up_proj": "gate_up_proj", "w2": "down_proj", "down_proj": "down_proj"}


def wrapped_parameters(family: str, targets: tuple[str, ...]) -> frozenset[str]:
    """The parameter suffixes ("gate.weight", "gate_up_proj", "down_proj") peft adapts through lora.ParamWrapper
    on this family for these targets (peft's _convert_peft_config_moe moves each mapped name into
    target_parameters)."""
    return frozenset(_WRAPPED[t.rsplit(".", 1)[-1]] for t in parameter_wrapper_targets(family, targets))


def adapted_linears(family: str, targets: tuple[str, ...], linear_modules: tuple[str, ...]) -> tuple[str, ...]:
    """The linears peft wraps in lora.Linear: resolve_targets' choice less, on the MoE families above, the
    linears whose target _convert_peft_config_moe moved to target_parameters (it removes a mapped name from
    target_modules, so the dense MLPs and shared experts named gate_proj / up_proj / down_proj are not adapted:
    measured by listing get_peft_model's parameters on tiny DeepSeek-V3 and Qwen3-MoE configs)."""
    chosen = resolve_targets(family, targets, linear_modules)
    mapped = MOE_PARAMETER_TARGETS.get(family)
    if not mapped:
        return chosen
    wanted = [t for t in targets if t != ALL_LINEAR and not any(module_matches(t, n) for n in mapped)]
    if ALL_LINEAR in targets:
        return tuple(m for m in chosen if m.rsplit(".", 1)[-1] not in mapped)
    return tuple(m for m in chosen if any(module_matches(m, t) for t in wanted))


def check_adapter_options(family: str, targets: tuple[str, ...], dropout: float) -> None:
    """ValueError for adapter settings peft refuses at get_peft_model: lora.ParamWrapper.__init__ raises
    "lora.ParamWrapper does not work with lora_dropout != 0" (peft/tuners/lora/layer.py), and on the MoE families
    above "all-linear" or an expert projection's name reaches it (measured: benchmarks/accuracy/
    rows-sampled-seed3-h200-1.jsonl s3-011, tinymixtral all-linear with dropout 0.05)."""
    wrapped = parameter_wrapper_targets(family, targets)
    leaves = {t.rsplit(".", 1)[-1] for t in wrapped}
    for pair in (("w1", "w3"), ("gate_proj", "up_proj")):
        if ALL_LINEAR not in targets and len(leaves & set(pair)) == 1:
            have = (leaves & set(pair)).pop()
            other = pair[1] if have == pair[0] else pair[0]
            # _convert_peft_config_moe: "Cannot convert PEFT target(s) … without also targeting … because they
            # are fused into gate_up_proj"
            raise ValueError(f"peft fuses {family}'s {pair[0]} and {pair[1]} into experts.gate_up_proj: target "
                             f"{other} too, or neither")
    if dropout > 0 and wrapped:
        v5 = sorted({_V5_NAMES.get(t.rsplit(".", 1)[-1], t) for t in wrapped})
        raise ValueError(f"peft adapts {family}'s {', '.join(v5)} through lora.ParamWrapper, which refuses "
                         f"lora_dropout != 0 (got {dropout:g}); use 0, or target the attention projections only")


#: the transformers-5 parameter each mapped name becomes (_MOE_TARGET_MODULE_MAPPING's values)
_V5_NAMES = {"gate": "mlp.gate.weight", "w1": "experts.gate_up_proj", "w3": "experts.gate_up_proj",
             "gate_proj": "experts.gate_up_proj", "up_proj": "experts.gate_up_proj", "w2": "experts.down_proj",
             "down_proj": "experts.down_proj"}


def module_matches(module: str, target: str) -> bool:
    """peft's check_target_module_exists for a plain name: equal, or the module's name ends with '.target'."""
    return module == target or module.endswith("." + target)


def resolve_targets(family: str, targets: tuple[str, ...], linear_modules: tuple[str, ...]) -> tuple[str, ...]:
    """The qualified names of the linears the adapter covers, in model order; ValueError naming a target the
    model lacks (peft raises "Target modules … not found in the base model")."""
    if targets == (DEFAULT,):
        if family not in DEFAULT_TARGETS:
            raise ValueError(f"peft has no default LoRA targets for {family}; pass --lora-targets")
        targets = DEFAULT_TARGETS[family]
    if ALL_LINEAR in targets:
        return tuple(m for m in linear_modules if not m.endswith(("lm_head", "embed_out")))
    chosen = tuple(m for m in linear_modules if any(module_matches(m, t) for t in targets))
    mapped = MOE_PARAMETER_TARGETS.get(family, ())  # peft maps these to parameters (wrapped_parameters)
    missing = [t for t in targets if not any(module_matches(m, t) for m in linear_modules)
               and not any(module_matches(t, n) for n in mapped)]
    if missing:
        leaves = sorted({m.rsplit(".", 1)[-1] for m in linear_modules})
        raise ValueError(f"LoRA target {shorten(missing[0])} is not a linear module of this model; allowed: "
                         f"{', '.join(leaves)} or all-linear")
    return chosen
