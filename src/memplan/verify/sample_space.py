"""The job space memplan.verify.sample draws from: presets, weights, and the slot design behind its quotas.

Pure (no torch, no files written): `catalog()` describes every preset in models/, `slots(seed, count)` lays
out which loop, LoRA design, regime and reserved family each line gets, and `draw(slot, rng, paths)` draws
the remaining dimensions of one line. memplan.verify.sample turns a draw into a matrix line and rejects what
memplan check refuses or what cannot fit the H200. benchmarks/accuracy/sampled/README.md explains the weights.

The slot design: lines come in rounds of ROUND_SIZE (30) lines, four rounds to a block of 120. Every round
holds each family once (the rest of its family slots are drawn by FAMILY_WEIGHTS), LOOPS_PER_ROUND of each
loop, LORA_PER_ROUND LoRA lines walking LORA_DESIGNS (one of them on the Trainer loop), and REGIMES_PER_ROUND lines of each targeted regime.
So every block of 120 lines holds every family >= 4 times, every loop >= 15 times and >= 12 LoRA lines over
ZeRO 0, 2, 3 with checkpointing on and off, and any prefix of whole rounds is a balanced part of the draw.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from ..specs import ModelSpec
from .pipeline import SUPPORTED_FAMILIES as PP_FAMILIES

#: bump whenever a weight, table or rule below changes what a seed draws
SAMPLER_VERSION = "1"

ROUND_SIZE = 30
#: loops per round of 30: 13 + 8 + 9 (a block of 120 holds 52 / 32 / 36, each >= 15)
LOOPS_PER_ROUND = {"outputs": 13, "loss": 8, "hf-trainer": 9}
#: LoRA lines per round (16 per block of 120, >= 12)
LORA_PER_ROUND = 4
#: (ZeRO stage, checkpointing) walked by the LoRA lines in turn: each appears twice per block
LORA_DESIGNS = ((0, "none"), (2, "full"), (3, "full"), (3, "none"), (2, "none"), (0, "full"), (3, "full"),
                (2, "full"))
LORA_RANKS = (8, 16, 32, 64)
#: the regimes where independently written jobs disagree most with the estimate (issue 13), per round
REGIMES_PER_ROUND = {"wide_z3": 2, "ulysses_long": 3, "moe_z3": 2, "tp_real": 1, "pp": 1, "z3_small_knobs": 2,
                     "fp16_scaler": 2}
#: regimes that need a line of their own DeepSpeed JSON or a layout the Trainer loop does not run
_NOT_HF = ("ulysses_long", "tp_real", "pp", "z3_small_knobs")

#: families by how much people train them (Hugging Face downloads of fine-tuning bases, roughly); a family
#: not listed (a preset added later) gets DEFAULT_FAMILY_WEIGHT
FAMILY_WEIGHTS = {"llama": 0.20, "qwen2": 0.12, "qwen3": 0.10, "mistral": 0.09, "mixtral": 0.05, "gemma2": 0.06,
                  "gemma3_text": 0.05, "phi3": 0.05, "olmo2": 0.04, "qwen3_moe": 0.05, "deepseek_v3": 0.03,
                  "gpt2": 0.04, "gpt_neox": 0.03, "bloom": 0.03}
DEFAULT_FAMILY_WEIGHT = 0.04
#: presets above this many parameters are drawn cut to CUT_LAYERS layers (a generated config.json)
FULL_SIZE_MAX_PARAMS = 16 * 10**9
CUT_LAYERS = (2, 3, 4)
#: a preset's weight within its family by size: 7B-class models are what people fine-tune most
SIZE_WEIGHTS = ((10**9, 1.0), (4 * 10**9, 1.5), (10 * 10**9, 2.5), (FULL_SIZE_MAX_PARAMS, 1.0))
CUT_WEIGHT = 0.7

ZERO_WEIGHTS = {0: 0.08, 1: 0.12, 2: 0.35, 3: 0.45}
WORLD_WEIGHTS = {1: 0.08, 2: 0.12, 4: 0.15, 8: 0.33, 16: 0.14, 32: 0.10, 64: 0.08}
SEQ_WEIGHTS = {1024: 0.12, 2048: 0.18, 4096: 0.25, 8192: 0.20, 16384: 0.12, 32768: 0.08, 65536: 0.03,
               131072: 0.02}
#: micro-batches; mb · seq above MAX_MICRO_TOKENS is not drawn (mb 1 always is)
MICRO_WEIGHTS = {1: 0.55, 2: 0.25, 4: 0.12, 8: 0.08}
MAX_MICRO_TOKENS = 32768
ACCUM_WEIGHTS = {1: 0.55, 2: 0.20, 4: 0.20, 8: 0.05}
DTYPE_WEIGHTS = {"bf16": 0.80, "fp16": 0.12, "fp32": 0.08}
ATTENTION_WEIGHTS = {"sdpa": 0.60, "flash": 0.30, "eager": 0.10}
#: eager attention materialises seq² scores: drawn up to this length only
EAGER_MAX_SEQ = 4096
#: torch_adamw_fused is accepted by the flags but to_ds_config has no mapping for it, so it is never drawn
OPTIMIZER_WEIGHTS = {"adamw": 0.72, "torch_adamw": 0.10, "sgd": 0.09, "lion": 0.09, "torch_adamw_fused": 0.0}
OFFLOADED_OPTIMIZER_WEIGHTS = {"adamw": 0.85, "lion": 0.15}
OFFLOAD_OPTIMIZER_WEIGHTS = {"none": 0.74, "cpu": 0.23, "nvme": 0.03}
OFFLOAD_PARAM_WEIGHTS = {"none": 0.80, "cpu": 0.18, "nvme": 0.02}
#: P(full checkpointing) by sequence length (selective is not drawn: transformers has no selective mode)
CKPT_BY_SEQ = ((2048, 0.25), (4096, 0.40), (8192, 0.55), (16384, 0.70), (2**40, 0.90))
#: P(Ulysses sp > 1) by sequence length, and sp's weights
SP_BY_SEQ = ((4096, 0.0), (16384, 0.25), (2**40, 0.50))
SP_WEIGHTS = {2: 0.30, 4: 0.35, 8: 0.35}
P_KNOBS = 0.35      # a line of its own ZeRO knobs (each knob then drawn with P_EACH_KNOB)
P_EACH_KNOB = 0.40
P_FREEZE = 0.08
P_EXPANDABLE = 0.15
FREEZE_CHOICES = ("embeddings", "norms", "layers:quarter", "embeddings,lm_head")
#: the docs' Trainer templates (transformers docs, DeepSpeed integration) as published, "auto" included
HF_TEMPLATES = {2: "examples/hf-trainer/ds_config_zero2.json", 3: "examples/hf-trainer/ds_config_zero3.json"}
HF_ZERO_WEIGHTS = {2: 0.4, 3: 0.6}
#: the families the harness has measured with AutoTP (committed rows: Llama, Qwen2; the rest share their code)
TP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
#: tp and pp sizes (tp: world = tp·dp <= 8 real ranks on one node)
TP_WEIGHTS = {2: 0.5, 4: 0.35, 8: 0.15}
PP_WEIGHTS = {2: 0.5, 4: 0.35, 8: 0.15}


@dataclass(frozen=True)
class Preset:
    """One models/ preset as the sampler sees it."""

    name: str
    spec: ModelSpec
    params: int
    layer_params: int  # the largest decoder layer: what "below one layer" is measured against

    @property
    def family(self) -> str:
        return self.spec.family

    @property
    def full_size(self) -> bool:
        return self.params <= FULL_SIZE_MAX_PARAMS


@lru_cache(maxsize=1)
def catalog() -> tuple[Preset, ...]:
    """Every preset in models/ (memplan.presets.list_presets), with its parameter counts."""
    from ..params import parameter_tensors
    from ..presets import list_presets, load_model

    out = []
    for name in list_presets():
        spec = load_model(name)
        tensors = parameter_tensors(spec)
        per_layer: dict[int, int] = {}
        for t in tensors:
            if t.layer is not None:
                per_layer[t.layer] = per_layer.get(t.layer, 0) + t.numel
        out.append(Preset(name, spec, sum(t.numel for t in tensors), max(per_layer.values(), default=0)))
    return tuple(out)


def families() -> tuple[str, ...]:
    return tuple(sorted({p.family for p in catalog()}))


def _is_7b(p: Preset) -> bool:
    return p.full_size and 6 * 10**9 <= p.params <= 10 * 10**9


#: which presets each regime draws from
REGIME_PRESETS = {
    "wide_z3": lambda p: p.spec.hidden_size >= 12288,
    "ulysses_long": lambda p: _is_7b(p) and p.family != "gpt2" and p.spec.max_position_embeddings >= 32768
    and p.spec.num_kv_heads % 4 == 0,
    "moe_z3": lambda p: p.spec.num_experts > 0,
    "tp_real": lambda p: p.family in TP_FAMILIES and p.full_size and p.params <= 4 * 10**9,
    "pp": lambda p: p.family in PP_FAMILIES and p.full_size,  # the families verify.pipeline builds
    "z3_small_knobs": lambda p: True,
    "fp16_scaler": lambda p: True,
    "free": lambda p: True,
}


@dataclass(frozen=True)
class LoraDesign:
    stage: int
    checkpointing: str
    rank: int
    targets: str  # "attention" (peft's default targets for the family) or "all-linear"
    dropout: float


@dataclass(frozen=True)
class Slot:
    """What the design fixes for one line before its draw."""

    index: int
    loop: str
    regime: str = "free"
    family: str | None = None  # reserved: this family's quota
    lora: LoraDesign | None = None


def _lora_design(k: int) -> LoraDesign:
    stage, ckpt = LORA_DESIGNS[k % len(LORA_DESIGNS)]
    return LoraDesign(stage, ckpt, LORA_RANKS[(k // 4) % 4], ("attention", "all-linear")[k % 2],
                      (0.0, 0.05)[(k // 2) % 2])


def _round(seed: int, r: int, fams: tuple[str, ...]) -> list[Slot]:
    """One round of ROUND_SIZE slots (see the module docstring)."""
    rng = random.Random(f"memplan-sample-round:{seed}:{r}")
    n = ROUND_SIZE
    loops = [loop for loop, k in LOOPS_PER_ROUND.items() for _ in range(k)]
    rng.shuffle(loops)
    reserved: list[str | None] = list(fams[:n]) + [None] * (n - min(n, len(fams)))
    rng.shuffle(reserved)
    lora: dict[int, LoraDesign] = {}
    trainer_lora = False  # one LoRA line a round runs the Trainer loop (issue 14: TRL / Trainer with peft)
    for j in range(LORA_PER_ROUND):
        design = _lora_design(r * LORA_PER_ROUND + j)
        on_hf = design.stage in HF_TEMPLATES and not trainer_lora
        free = [i for i in range(n) if i not in lora and (loops[i] == "hf-trainer" if on_hf else
                                                          design.stage in HF_TEMPLATES or loops[i] != "hf-trainer")]
        lora[rng.choice(free)] = design
        trainer_lora = trainer_lora or on_hf
    regime: dict[int, str] = {}
    for name, k in REGIMES_PER_ROUND.items():
        fam_ok = {p.family for p in catalog() if REGIME_PRESETS[name](p)}
        ok = [i for i in range(n) if i not in lora and i not in regime
              and (reserved[i] is None or reserved[i] in fam_ok)
              and not (name in _NOT_HF and loops[i] == "hf-trainer")]
        if fam_ok:
            for i in rng.sample(ok, min(k, len(ok))):
                regime[i] = name
    return [Slot(r * n + i, loops[i], regime.get(i, "free"), reserved[i], lora.get(i)) for i in range(n)]


def slots(seed: int, count: int) -> list[Slot]:
    """The first ``count`` slots of seed ``seed``."""
    fams = families()
    out: list[Slot] = []
    r = 0
    while len(out) < count:
        out += _round(seed, r, fams)
        r += 1
    return out[:count]


# ---------------------------------------------------------------------------------------------- the draw


def pick(rng: random.Random, weights: dict) -> Any:
    """One key of ``weights`` drawn in proportion to its weight (keys of weight 0 never)."""
    keys = [k for k, w in weights.items() if w > 0]
    return rng.choices(keys, weights=[weights[k] for k in keys])[0]


def _by_threshold(table, value) -> float:
    return next(p for limit, p in table if value <= limit)


@dataclass
class Draw:
    """One line's job before validation: the flags, the files the flags name, and what the design fixed."""

    flags: dict[str, Any]
    preset: Preset
    cut_layers: int | None
    ds: dict | None = None            # the line's own DeepSpeed JSON (None: a Trainer template)
    hf_template: str | None = None
    needs_gpus: int = 1
    meta: dict[str, Any] = field(default_factory=dict)


def _family_weights(slot: Slot, regime: str) -> dict[str, float]:
    fams = {p.family for p in catalog() if REGIME_PRESETS[regime](p)}
    return {f: FAMILY_WEIGHTS.get(f, DEFAULT_FAMILY_WEIGHT) for f in sorted(fams)}


def _preset(rng: random.Random, family: str, regime: str) -> tuple[Preset, int | None]:
    cands = [p for p in catalog() if p.family == family and REGIME_PRESETS[regime](p)]
    weights = {p: (_by_threshold(SIZE_WEIGHTS, p.params) if p.full_size else CUT_WEIGHT) for p in cands}
    p = pick(rng, weights)
    return p, (None if p.full_size else rng.choice(CUT_LAYERS))


def _seq(rng: random.Random, p: Preset, regime: str) -> int:
    table = {"ulysses_long": {32768: 0.4, 65536: 0.35, 131072: 0.25},
             "wide_z3": {1024: 0.3, 2048: 0.4, 4096: 0.3}}.get(regime, SEQ_WEIGHTS)
    # memplan check refuses seq > max_position_embeddings (rules_job.model_shape_rules): not drawn
    allowed = {s: w for s, w in table.items() if s <= p.spec.max_position_embeddings}
    return pick(rng, allowed or {min(SEQ_WEIGHTS): 1.0})


def _sp(rng: random.Random, p: Preset, seq: int, regime: str, attention: str) -> int:
    m = p.spec
    if regime == "ulysses_long":
        options = {4: 0.4, 8: 0.6}
    elif m.family == "gpt2" or attention == "eager" or rng.random() >= _by_threshold(SP_BY_SEQ, seq):
        return 1
    else:
        options = SP_WEIGHTS
    ok = {s: w for s, w in options.items() if m.num_heads % s == 0 and m.num_kv_heads % s == 0 and seq % s == 0}
    return pick(rng, ok) if ok else 1


def _world(rng: random.Random, inner: int, cap: int = 64) -> int:
    ok = {w: x for w, x in WORLD_WEIGHTS.items() if w % inner == 0 and w <= cap}
    return pick(rng, ok) if ok else inner


def _knobs(rng: random.Random, p: Preset, stage: int, regime: str, sp: int, dtype: str) -> dict[str, Any]:
    """zero_optimization keys (and data_types / sp dtype) of the line's own DeepSpeed JSON."""
    h, layer = p.spec.hidden_size, p.layer_params
    zero: dict[str, Any] = {}
    out: dict[str, Any] = {}
    if regime == "z3_small_knobs":
        which = pick(rng, {"live": 0.4, "prefetch": 0.4, "both": 0.2})
        for key, tag in (("stage3_max_live_parameters", "live"), ("stage3_prefetch_bucket_size", "prefetch")):
            if which in (tag, "both"):
                zero[key] = max(1, int(layer * rng.choice((0.1, 0.25, 0.5, 0.9))))
    elif rng.random() < P_KNOBS:
        table: dict[str, tuple] = {"reduce_bucket_size": (50_000_000, 100_000_000, 200_000_000, 500_000_000, h * h),
                                   "contiguous_gradients": (True, True, True, False)}
        if stage in (1, 2):
            table |= {"allgather_bucket_size": (50_000_000, 200_000_000, 500_000_000), "overlap_comm": (True, False)}
        if stage == 3:
            table |= {"stage3_prefetch_bucket_size": (int(0.9 * h * h), 50_000_000, 200_000_000, int(0.5 * layer)),
                      "stage3_param_persistence_threshold": (0, 10_000, 1_000_000, 10 * h),
                      "stage3_max_live_parameters": (100_000_000, 300_000_000, 1_000_000_000, int(0.5 * layer)),
                      "stage3_max_reuse_distance": (0, 100_000_000, 1_000_000_000),
                      "overlap_comm": (True, True, False)}
        if stage >= 1:
            table["sub_group_size"] = (100_000_000, 1_000_000_000)
        for key, values in table.items():
            if rng.random() < P_EACH_KNOB:
                zero[key] = rng.choice(values)
        if stage >= 1 and dtype == "bf16" and rng.random() < 0.15:
            out["data_types"] = {"grad_accum_dtype": "fp32"}
        if sp > 1 and rng.random() < 0.3:
            out["seq_parallel_communication_data_type"] = "bf16"
    if zero:
        out["zero_optimization"] = zero
    return out


def _lora_flags(p: Preset, design: LoraDesign) -> dict[str, Any]:
    """Attention-only: peft's default targets for the family that the model has (else its attention input
    projections by role); or all-linear."""
    from ..params import linear_modules, parameter_tensors
    from ..peftconfig import DEFAULT_TARGETS, module_matches

    if design.targets == "all-linear":
        targets = "all-linear"
    else:
        linears = linear_modules(p.spec)
        names = [t for t in DEFAULT_TARGETS.get(p.family, ()) if any(module_matches(m, t) for m in linears)]
        if not names:
            leaves = {t.name.removesuffix(".weight").rsplit(".", 1)[-1] for t in parameter_tensors(p.spec)
                      if t.role == "attn_in" and t.name.endswith(".weight")}
            names = sorted(leaves)
        targets = ",".join(names)
    return {"--lora-rank": design.rank, "--lora-targets": targets, "--lora-dropout": design.dropout}


def draw(slot: Slot, rng: random.Random, relax: int = 0) -> Draw:
    """Draw one line for ``slot``; ``relax`` 1 drops the regime, 2 also the reserved family."""
    regime = slot.regime if relax < 1 else "free"
    hf = slot.loop == "hf-trainer"
    lora = slot.lora
    family = slot.family if relax < 2 and slot.family else pick(rng, _family_weights(slot, regime))
    if not any(p.family == family and REGIME_PRESETS[regime](p) for p in catalog()):
        regime = "free"
    p, cut = _preset(rng, family, regime)
    seq = _seq(rng, p, regime)
    # stage: the LoRA design, the regime, the Trainer template's, or the weights
    if lora is not None:
        stage = lora.stage
    elif regime in ("wide_z3", "moe_z3", "z3_small_knobs"):
        stage = 3
    elif regime == "ulysses_long":
        stage = pick(rng, {2: 0.3, 3: 0.7})
    elif regime == "tp_real":
        stage = pick(rng, {0: 0.2, 1: 0.4, 2: 0.4})
    elif regime == "pp":
        stage = pick(rng, {0: 0.5, 1: 0.5})
    elif hf:
        stage = pick(rng, HF_ZERO_WEIGHTS)
    else:
        stage = pick(rng, ZERO_WEIGHTS)
    dtype = "fp16" if regime == "fp16_scaler" else pick(rng, DTYPE_WEIGHTS)
    if lora is not None:
        ckpt = lora.checkpointing
    elif regime == "wide_z3":
        ckpt = "full"
    elif regime == "pp":
        ckpt = "none"  # the pipeline builder does not wire checkpointing (verify.pipeline)
    else:
        ckpt = "full" if rng.random() < _by_threshold(CKPT_BY_SEQ, seq) else "none"
    attn = {k: w for k, w in ATTENTION_WEIGHTS.items()
            if not (k == "eager" and (seq > EAGER_MAX_SEQ or regime in ("pp", "ulysses_long")))
            and not (k == "flash" and (dtype == "fp32" or p.spec.head_dim > 256 or p.spec.head_dim % 8))}
    attention = pick(rng, attn)
    tp = pp = 1
    sp = 1 if hf or regime in ("tp_real", "pp") else _sp(rng, p, seq, regime, attention)
    needs = 1
    if regime == "tp_real":
        ok = {t: w for t, w in TP_WEIGHTS.items() if p.spec.num_heads % t == 0 and p.spec.num_kv_heads % t == 0}
        tp = pick(rng, ok) if ok else 1
        world = tp * pick(rng, {d: w for d, w in {1: 0.7, 2: 0.3}.items() if tp * d <= 8})
        needs = world
    elif regime == "pp":
        layers = cut or p.spec.num_layers
        pp = pick(rng, {k: w for k, w in PP_WEIGHTS.items() if layers >= k})
        world = _world(rng, pp * sp)
    else:
        world = _world(rng, sp, 64)
        if regime == "wide_z3":
            world = max(world, 8)
    mb = pick(rng, {m: w for m, w in MICRO_WEIGHTS.items() if m == 1 or m * seq <= MAX_MICRO_TOKENS})
    ga = pick(rng, {g: w for g, w in ACCUM_WEIGHTS.items() if g >= pp} or {pp: 1.0})
    flags: dict[str, Any] = {"--model": None, "--seq": seq, "--gpus": world, "--micro-batch": mb,
                             "--grad-accum": ga, "--dtype": dtype, "--checkpointing": ckpt, "--attention": attention,
                             "--loop": slot.loop}
    d = Draw(flags=flags, preset=p, cut_layers=cut, needs_gpus=needs)
    if hf:
        d.hf_template = HF_TEMPLATES[stage]
    else:
        oo = pick(rng, OFFLOAD_OPTIMIZER_WEIGHTS) if stage >= 1 and regime not in ("tp_real", "pp") else "none"
        op = pick(rng, OFFLOAD_PARAM_WEIGHTS) if stage == 3 else "none"
        opt = pick(rng, OFFLOADED_OPTIMIZER_WEIGHTS if oo != "none" else OPTIMIZER_WEIGHTS)
        flags.update({"--zero": stage, "--sp": sp, "--tp": tp, "--pp": pp, "--optimizer": opt,
                      "--offload-optimizer": oo, "--offload-param": op})
        d.ds = {"train_micro_batch_size_per_gpu": mb, "gradient_accumulation_steps": ga,
                **_knobs(rng, p, stage, regime, sp, dtype)}
        d.ds.setdefault("zero_optimization", {})["stage"] = stage
    if lora is not None:
        flags.update(_lora_flags(p, lora))
    elif regime not in ("tp_real", "pp") and rng.random() < P_FREEZE:
        choice = rng.choice(FREEZE_CHOICES)
        layers = cut or p.spec.num_layers
        flags["--freeze"] = choice.replace("layers:quarter", f"layers:{max(1, layers // 4)}")
    if rng.random() < P_EXPANDABLE:
        flags["--alloc-conf"] = "expandable_segments:True"
    d.meta = {"regime": regime, "family": p.family, "preset": p.name, "loop": slot.loop,
              "lora": lora is not None, "reserved_family": slot.family, "relaxed": relax}
    if regime != slot.regime:
        d.meta["design_regime"] = slot.regime
    return d


__all__ = ["SAMPLER_VERSION", "Draw", "Preset", "Slot", "catalog", "draw", "families", "pick", "slots"]
