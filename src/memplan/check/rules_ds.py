"""Rules on the DeepSpeed JSON alone (DeepSpeed 0.19.8: runtime/config.py, runtime/zero/config.py, engine.py)."""

from __future__ import annotations

import difflib

from ..dsconfig import DsSettings, ds_settings
from ..errors import InputError
from .findings import Finding, error, info, warning
from .tables import tables

#: DEEPSPEED_OPTIMIZERS (runtime/config.py): names DeepSpeed builds itself (matched lower-cased).
DEEPSPEED_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd", "lion", "muon")

_NOT_DEEPSPEED = {
    "sequence_parallel": "DeepSpeed has no 'sequence_parallel' key: Ulysses is switched on by the sequence-parallel "
                         "process group (Megatron-DeepSpeed --ds-sequence-parallel-size, or an mpu passed to "
                         "deepspeed.initialize), not by the config",
}


def _close(word: str, options) -> str:
    hits = difflib.get_close_matches(word, list(options), n=1, cutoff=0.75)
    return f"did you mean '{hits[0]}'?" if hits else ""


def removed_keys(cfg: dict) -> list[Finding]:
    """_reject_removed_config_keys (runtime/config.py) raises DeepSpeedConfigError for these."""
    t = tables()
    out = [error(k, f"DeepSpeed {t['deepspeed_version']} refuses it: {msg}", f"remove '{k}'")
           for k, msg in t["ds_removed_top_level"].items() if k in cfg]
    zero = cfg.get("zero_optimization")
    if isinstance(zero, dict):
        out += [error(f"zero_optimization.{k}", f"DeepSpeed refuses it: {msg}", f"remove '{k}'")
                for k, msg in t["ds_removed_zero"].items() if k in zero]
    return out


def unknown_top_level(cfg: dict) -> list[Finding]:
    """DeepSpeedConfig is not a pydantic model at the top level: keys it never looks up are ignored silently."""
    t = tables()
    known = set(t["ds_top_level_keys"])
    out = []
    for key in cfg:
        if key in known or key in t["ds_removed_top_level"]:
            continue
        why = _NOT_DEEPSPEED.get(key, "DeepSpeedConfig never reads this key, so it is ignored without a word")
        hint = _close(key, known)
        out.append(warning(key, f"{why}{'; ' + hint if hint else ''}", f"remove '{key}' or use the real key"))
    return out


def strict_sections(cfg: dict) -> list[Finding]:
    """Sections that are DeepSpeedConfigModel (extra="forbid"): an unknown key raises a ValidationError."""
    out = []
    for path, allowed in tables()["ds_strict_sections"].items():
        section = _at(cfg, path)
        if not isinstance(section, dict):
            continue
        for key in section:
            if key not in allowed and f"{path}.{key}" not in tables()["ds_strict_sections"]:
                hint = _close(key, allowed)
                out.append(error(f"{path}.{key}", f"'{path}' is validated strictly (pydantic extra='forbid'): "
                                 f"DeepSpeed refuses the unknown key{'; ' + hint if hint else ''}",
                                 f"remove it; allowed keys: {', '.join(allowed)}"))
    return out


def _at(cfg: dict, path: str):
    node = cfg
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def settings_or_finding(cfg: dict, hf: bool = False) -> tuple[DsSettings | None, list[Finding]]:
    """memplan's reading of the config; a value DeepSpeed refuses becomes an error finding. ``hf``: the job runs
    under the Hugging Face Trainer, which fills "auto" values (memplan.dsconfig.ds_settings).

    An optimizer DeepSpeed builds but memplan does not model (Lamb, Adagrad, ...) is an info and is left out.
    """
    opt = cfg.get("optimizer") if isinstance(cfg.get("optimizer"), dict) else {}
    name = str(opt.get("type", ""))
    out: list[Finding] = []
    if name and name.lower() in DEEPSPEED_OPTIMIZERS and name.lower() not in ("adam", "adamw", "lion"):
        out.append(info("optimizer.type", f"DeepSpeed builds {name}; memplan models Adam/AdamW, Lion and SGD, so "
                                          "the estimate assumes AdamW states"))
        cfg = {k: v for k, v in cfg.items() if k != "optimizer"}
    elif name and name.lower() not in DEEPSPEED_OPTIMIZERS and name != "SGD" and name.lower() == "sgd":
        out.append(error("optimizer.type", f"'{name}' is looked up as torch.optim.{name} (case-sensitive, "
                                           "engine._configure_basic_optimizer): that is a module, not a class",
                         "write \"SGD\""))
        cfg = {**cfg, "optimizer": {**opt, "type": "SGD"}}
    try:
        return ds_settings(cfg, hf=hf), out
    except InputError as err:
        return None, out + [error(err.field, err.message, "see DeepSpeed's config documentation for allowed values")]


def value_rules(cfg: dict, s: DsSettings) -> list[Finding]:
    """What DeepSpeed does with the values: ignored combinations, auto, loss scaling, gradient clipping."""
    out: list[Finding] = []
    zero = s.zero_stage or 0
    if s.offload_param not in (None, "none") and zero != 3:
        out.append(warning("zero_optimization.offload_param", f"only ZeRO-3 offloads parameters; under stage {zero} "
                           "DeepSpeed ignores it (stage_1_and_2.py never reads offload_param)",
                           "set zero_optimization.stage 3 or remove offload_param"))
    if s.offload_optimizer not in (None, "none") and zero == 0:
        out.append(warning("zero_optimization.offload_optimizer", "ZeRO is off (stage 0): no ZeRO optimizer is "
                           "built, so nothing is offloaded", "use stage 1, 2 or 3"))
    params = (cfg.get("optimizer") or {}).get("params") if isinstance(cfg.get("optimizer"), dict) else None
    if isinstance(params, dict) and "max_grad_norm" in params:
        out.append(error("optimizer.params.max_grad_norm", "engine._configure_basic_optimizer raises ValueError: "
                         "max_grad_norm is not an optimizer parameter", "use top-level gradient_clipping"))
    if s.dtype == "fp16":
        window = s.fp16_loss_scale_window or 1000
        if not s.fp16_loss_scale:
            out.append(info("fp16", f"dynamic loss scaling: starts at 2^{s.fp16_initial_scale_power or 16}, halves on "
                            f"overflow (skipping that step), doubles after {window} clean steps "
                            "(DeepSpeedFP16Config defaults: initial_scale_power 16, loss_scale_window 1000)",
                            "bf16 needs no loss scaling where the GPU supports it (A100 and later)"))
    if s.sequence_parallel_size and s.sequence_parallel_size > 1:
        out.append(info("sequence_parallel_size", "read only by DeepSpeedConfig when no mpu is passed (the HF "
                        "zero.init path), to divide the world for the batch check; it does not create Ulysses groups"))
    if "gradient_clipping" not in cfg:
        out.append(info("gradient_clipping", "not set: DeepSpeed 0.19.8 clips at 1.0 by default "
                        "(GRADIENT_CLIPPING_DEFAULT)", "set 0.0 to disable"))
    return out


#: batch keys DeepSpeedConfig computes with (runtime/config.py _set_batch_related_parameters, _batch_assertion)
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def auto_rules(cfg: dict) -> list[Finding]:
    """"auto" reaching plain DeepSpeed (no Trainer / Accelerate to fill it in). Top-level scalars are read with
    get_scalar_param (the string is kept): a batch field "auto" makes DeepSpeedConfig raise TypeError ("'>' not
    supported between instances of 'str' and 'int'" in _batch_assertion, or an int // str in
    _set_batch_related_parameters). In the pydantic sections (DeepSpeedConfigModel) "auto" is dropped: the
    field keeps DeepSpeed's default."""
    auto = [k for k in _auto_paths(cfg)]
    batch = [k for k in auto if k in BATCH_KEYS]
    top = [k for k in auto if "." not in k and k not in BATCH_KEYS]
    nested = [k for k in auto if "." in k]
    hint = "if a Hugging Face Trainer launches it, pass --loop hf-trainer (the Trainer fills \"auto\")"
    out = []
    if batch:
        out.append(error(", ".join(batch), "\"auto\" under plain DeepSpeed: DeepSpeedConfig keeps the string and "
                         "raises TypeError in its batch arithmetic (runtime/config.py _batch_assertion / "
                         "_set_batch_related_parameters)", f"write numbers; {hint}"))
    if top:
        out.append(warning(", ".join(top), "\"auto\" under plain DeepSpeed: get_scalar_param keeps the string, "
                           "which DeepSpeed then compares with numbers", f"write a number; {hint}"))
    if nested:
        out.append(info(", ".join(nested), "\"auto\" under plain DeepSpeed: DeepSpeedConfigModel drops it, so each "
                        "keeps DeepSpeed's default (runtime/config_utils.py)", hint))
    return out


def _auto_paths(cfg: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in cfg.items():
        if value == "auto":
            out.append(prefix + str(key))
        elif isinstance(value, dict):
            out += _auto_paths(value, f"{prefix}{key}.")
    return out


def ds_rules(cfg: dict, trainer: bool = False, hf: bool | None = None) -> tuple[DsSettings | None, list[Finding]]:
    """All rules on the config alone, and memplan's reading of it (None when DeepSpeed would refuse a value).

    ``trainer`` (or ``hf``): the Hugging Face Trainer fills the config (rules_hf reports what it left; see
    settings_or_finding for the "auto" it accepts)."""
    trainer = trainer or bool(hf)
    findings = removed_keys(cfg) + unknown_top_level(cfg) + strict_sections(cfg)
    if not trainer:
        findings += auto_rules(cfg)
    settings, more = settings_or_finding(cfg, trainer)
    findings += more
    if settings is not None:
        findings += value_rules(cfg, settings)
    return settings, findings
