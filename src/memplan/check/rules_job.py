"""Rules across the launch line, the DeepSpeed config and the model config.

Megatron-DeepSpeed references are to microsoft/Megatron-DeepSpeed at the commit in tables.json:
megatron/arguments.py (validate_args), megatron/core/parallel_state.py (initialize_model_parallel),
pretrain_gpt.py (get_batch); the rules only a Megatron-DeepSpeed line has are rules_megatron's.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from ..dsconfig import DsSettings, batch_problem, derive_batch
from ..specs import ModelSpec
from .findings import Finding, error, info, warning
from .launch import Launch, launch_world
from .tables import launcher_flags, tables


@dataclass
class Layout:
    """The layout the launch asks for; sp_intended keeps an sp given through a flag that does not exist."""

    world: int | None
    tp: int = 1
    pp: int = 1
    sp: int = 1
    sp_intended: int = 1
    findings: list[Finding] = field(default_factory=list)

    @property
    def dp(self) -> int | None:
        inner = self.tp * self.pp * self.sp
        return self.world // inner if self.world and self.world % inner == 0 else None


def is_megatron(launch: Launch) -> bool:
    """A Megatron-DeepSpeed entry point: pretrain_*.py, or its model/parallel flags."""
    marks = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--num-layers", "--micro-batch-size",
             "--ds-sequence-parallel-size", "--seq-length")
    name = (launch.script or "").rsplit("/", 1)[-1]
    return name.startswith("pretrain_") or sum(launch.has(m) for m in marks) >= 2


def launcher_rules(launch: Launch) -> list[Finding]:
    """Options the launcher's argparse does not know: argparse exits with 'unrecognized arguments'."""
    out = []
    for flag in launch.launcher_unknown:
        table = launcher_flags(launch.launcher)
        hint = difflib.get_close_matches(flag, list(table), n=1)
        if launch.launcher == "accelerate":
            out.append(info(flag, "not in memplan's (partial) list of accelerate launch flags", ""))
        else:
            out.append(error(flag, f"the {launch.launcher} launcher does not define it and stops with "
                             "'unrecognized arguments'", f"use {hint[0]}" if hint else "remove it"))
    if launch.script is None:
        out.append(error("launch", "no training script found on the launch line", "name the script to run"))
    return out


def _int(text: str | None, default: int) -> int:
    """A script flag's value as its argparse type=int reads it (memplan.check.launch.check_counts has already
    refused the counts memplan reads when they are not integers in bounds)."""
    try:
        return int(text) if text not in (None, "") and len(text) <= 40 else default
    except ValueError:
        return default


def layout_from(launch: Launch | None, gpus: int | None, megatron: bool, s: DsSettings | None) -> Layout:
    """World and tp/pp/sp as Megatron-DeepSpeed reads them (validate_args: dp = world // (tp·pp·sp))."""
    world = launch_world(launch) if launch else None
    lay = Layout(world=gpus or world)
    if launch and gpus and world and world != gpus:
        lay.findings.append(warning("--gpus", f"--gpus {gpus} but the launch line starts {world} processes; "
                                    f"memplan uses {gpus}", "make them agree"))
    if launch and megatron:
        lay.tp = _int(launch.script_value("--tensor-model-parallel-size"), 1)
        lay.pp = 1 if launch.has("--no-pipeline-parallel") else _int(launch.script_value(
            "--pipeline-model-parallel-size"), 1)
        lay.sp = _int(launch.script_value("--ds-sequence-parallel-size"), 1)
        lay.sp_intended = _int(launch.script_value("--sequence-parallel-size"), lay.sp)
    elif s is not None:
        lay.sp = lay.sp_intended = s.sequence_parallel_size or 1
        lay.tp = s.autotp_size if s.autotp_size and s.autotp_size > 1 else 1
    if lay.sp_intended != lay.sp:
        lay.findings.append(warning("--sequence-parallel-size", f"the launch line means sp={lay.sp_intended}, but "
                                    f"the flag does not exist: as written (were it accepted) sp would be {lay.sp}",
                                    f"--ds-sequence-parallel-size {lay.sp_intended}"))
    return lay


def parallel_rules(lay: Layout, zero_stage: int, megatron: bool, launch: Launch | None) -> list[Finding]:
    """Combinations DeepSpeed or Megatron-DeepSpeed refuse, using the sp the user intends."""
    out = []
    tp, pp, sp, world = lay.tp, lay.pp, lay.sp_intended, lay.world
    inner = tp * pp * sp
    if world and world % inner:
        out.append(error("layout", f"world ({world}) is not divisible by tp·pp·sp ({tp}·{pp}·{sp} = {inner}) "
                         "(validate_args / initialize_model_parallel)", "change the parallel sizes"))
    if sp > 1 and (tp > 1 or pp > 1):
        out.append(error("--ds-sequence-parallel-size", f"sp={sp} with tp={tp}, pp={pp}: parallel_state."
                         "initialize_model_parallel asserts \"DeepSpeed's sequence parallel does not work with tensor "
                         "parallel or pipeline parallel\"", f"use tp=1 pp=1 sp={inner} (or sp=1)"))
    no_pipe = megatron and launch is not None and launch.has("--no-pipeline-parallel")
    if zero_stage >= 2 and pp > 1 and not no_pipe:
        out.append(error("zero_optimization.stage", f"ZeRO-{zero_stage} with pipeline parallelism (pp={pp}): "
                         "runtime/pipe/engine.py asserts \"ZeRO-2 and ZeRO-3 are incompatible with pipeline "
                         "parallelism\"", "use ZeRO stage 0/1 with pp, or pp=1"))
    if megatron and launch is not None:
        from .rules_megatron import pipe_engine_rules

        out += pipe_engine_rules(launch, zero_stage, pp, sp)
    if world and inner > 1 and world // max(inner, 1) == 0:
        out.append(error("layout", f"tp·pp·sp = {inner} exceeds the world ({world})", "use fewer model-parallel ranks"))
    return out


def model_shape_rules(m: ModelSpec, lay: Layout, seq: int | None, megatron: bool = False,
                      launch: Launch | None = None) -> list[Finding]:
    """Divisibility (hidden by heads, heads by tp and by sp, kv heads against sp, seq by sp, layers by pp) and the
    position table, as the code that runs the job checks them: Megatron-DeepSpeed's for a pretrain_gpt.py line,
    DeepSpeed's UlyssesSPAttentionHF and transformers' otherwise."""
    out, sp, tp = [], lay.sp_intended, lay.tp
    sp_flag = "--ds-sequence-parallel-size" if megatron else "sequence_parallel_size"
    if m.hidden_size % m.num_heads and megatron:
        out.append(error("--hidden-size", f"hidden ({m.hidden_size}) is not divisible by heads ({m.num_heads}) "
                         "(validate_args asserts it)"))
    if m.num_heads % tp:
        out.append(error("--tensor-model-parallel-size" if megatron else "tensor_parallel.autotp_size",
                         f"heads ({m.num_heads}) not divisible by tp ({tp}) ("
                         + ("megatron.core.utils.divide in ParallelAttention)" if megatron else
                            "DeepSpeed AutoTP shards whole heads)")))
    if sp > 1 and m.num_heads % (sp * tp):
        out.append(error(sp_flag, f"heads ({m.num_heads}) not divisible by tp·sp ({tp}·{sp}) ("
                         + ("transformer.py asserts num_attention_heads % sp == 0; DistributedAttention splits heads)"
                            if megatron else "UlyssesSPAttentionHF raises: attention heads not divisible by SP)")))
    kv = m.num_kv_heads
    if sp > 1 and megatron and kv < sp:
        out.append(error(sp_flag, f"kv heads ({kv}) < sp ({sp}): DeepSpeed's DistributedAttention asserts the kv "
                         "heads are at least the sequence-parallel size (sequence/layer.py _resolve_kv_heads)"))
    elif sp > 1 and not megatron and kv % sp and sp % kv:
        out.append(error(sp_flag, f"kv heads ({kv}) and sp ({sp}): UlyssesSPAttentionHF (runtime/sequence_parallel/"
                         "ulysses_sp.py) needs one to divide the other (kv heads split over the sp ranks, or "
                         "replicated when sp is a multiple of them)"))
    if sp > 1 and not megatron and m.config_head_dim_unset:
        out.append(error(sp_flag, f"{m.family}'s config leaves head_dim None: UlyssesSPAttentionHF.register_with_"
                         "transformers reads getattr(config, 'head_dim', hidden // heads), gets None and raises a "
                         "TypeError building its shapes (DeepSpeed 0.19.8; measured: benchmarks/accuracy/"
                         "rows-sampled-seed1-h200-1.jsonl s1-042)",
                         f"set head_dim ({m.hidden_size // m.num_heads}) in config.json, or sp 1"))
    if seq and sp > 1 and seq % sp:
        out.append(error("--seq-length" if megatron else "--seq", f"seq ({seq}) not divisible by sp ({sp}) ("
                         + ("pretrain_gpt.py get_batch asserts seq_length % seq_parallel_world_size == 0)" if megatron
                            else "UlyssesSPAttentionHF shards the sequence evenly)")))
    if lay.pp > 1 and m.num_layers % lay.pp:
        out.append(warning("--num-layers" if megatron else "pipeline", f"layers ({m.num_layers}) not divisible by "
                           f"pp ({lay.pp}): stages are uneven and the largest sets the memory"))
    if seq and not megatron and seq > m.max_position_embeddings:
        if m.position_embedding == "learned":
            out.append(error("--seq", f"seq ({seq}) > the learned position table of {m.family} "
                             f"(max_position_embeddings {m.max_position_embeddings}): the embedding lookup indexes "
                             "out of range (nn.Embedding)", f"--seq {m.max_position_embeddings} or less"))
        else:
            out.append(info("--seq", f"seq ({seq}) > max_position_embeddings ({m.max_position_embeddings}): {m.family} "
                            f"has no position table ({m.position_embedding}), so it runs, beyond the context it was "
                            "trained for (memory is estimated as usual)"))
    return out


def batch_rules(s: DsSettings, lay: Layout, launch: Launch | None, megatron: bool) -> tuple[list[Finding], dict | None]:
    """DeepSpeedConfig._set_batch_related_parameters / _batch_assertion with the dp DeepSpeed is given.

    Megatron-DeepSpeed passes its mpu (or the pipeline grid): dp = world / (tp·pp·sp), sp excluded.
    """
    dp = lay.dp
    if dp is None:
        return [], None
    autotp = not megatron and (s.autotp_size or 1) > 1
    if autotp and lay.world:
        # deepspeed.initialize parses the config before AutoTP builds its mesh (deepspeed/__init__.py), so
        # DeepSpeedConfig._batch_assertion counts every rank as data-parallel (runtime/config.py)
        dp = lay.world
    out: list[Finding] = []
    if s.train_batch_size is None and s.micro_batch is None:
        if {"train_batch_size", "train_micro_batch_size_per_gpu"} & set(s.auto_keys):
            return [], None  # "auto": rules_ds.auto_rules reports DeepSpeed's TypeError
        return [error("train_batch_size", "neither train_batch_size nor train_micro_batch_size_per_gpu is set "
                      "(DeepSpeedConfig asserts one is)", "set train_micro_batch_size_per_gpu")], None
    batch = derive_batch(s.train_batch_size, s.micro_batch, s.grad_accum, dp)
    problem = batch_problem(batch, dp)
    if problem:
        why = (f"dp = world {lay.world}: with AutoTP the config is checked before the tp mesh exists" if autotp
               else f"dp = world {lay.world} / (tp {lay.tp}·pp {lay.pp}·sp {lay.sp})")
        out.append(error("train_batch_size", f"{problem} (DeepSpeedConfig._batch_assertion; {why})",
                         "make train_batch_size = micro × accum × dp"))
        return out, None
    if launch and megatron:
        from .rules_megatron import megatron_batch_rules

        return out + megatron_batch_rules(s, batch, launch, dp), batch
    if s.grad_accum is None:
        out.append(info("gradient_accumulation_steps", f"derived: {batch['train_batch_size']} // micro "
                        f"{batch['micro_batch']} // dp {dp} = {batch['grad_accum']} micro-steps per optimizer step"))
    return out, batch


def model_config_rules(raw: dict | None, m: ModelSpec | None, launch: Launch | None, megatron: bool,
                       lay: Layout, seq: int | None = None) -> list[Finding]:
    """The model config against transformers, and (Megatron-DeepSpeed) the model the launch line builds."""
    if m is None:
        return []
    out = []
    if megatron and launch is not None:
        from .rules_megatron import model_rules

        out += model_rules(launch, m, seq)
    if raw is None:
        return out
    if "model_type" not in raw:
        out.append(warning("model.model_type", "no model_type: transformers' AutoConfig.from_pretrained refuses "
                           f"the file; memplan read it as {m.family} from 'architectures'", "add \"model_type\""))
    unknown = unknown_model_keys(raw, m.family)
    for key in unknown:
        out.append(warning(f"model.{key}", f"{m.family}'s config class does not know '{key}': transformers keeps it as "
                           "a plain attribute and no model code reads it, so it does nothing", "remove it"))
    sp_cfg = raw.get("sequence_parallel_size")
    if isinstance(sp_cfg, int) and sp_cfg != lay.sp_intended:
        out.append(warning("model.sequence_parallel_size", f"the model config says {sp_cfg}, the launch line "
                           f"{lay.sp_intended}; only the launch line counts", "make them agree"))
    return out


#: keys a config class consumes without keeping them, or modeling code reads by getattr: rope_theta /
#: rope_scaling (rope_local_base_freq) go into rope_parameters (convert_rope_params_to_dict); Gemma3TextConfig
#: reads sliding_window_pattern, Phi3Config partial_rotary_factor from kwargs; Phi3/Qwen3Moe/Olmo2Attention
#: read getattr(config, "head_dim", ...)
_CONSUMED_KEYS = {"": ("rope_theta", "rope_scaling"), "gemma3_text": ("sliding_window_pattern", "rope_local_base_freq"),
                  "phi3": ("head_dim", "partial_rotary_factor"), "qwen3_moe": ("head_dim",), "olmo2": ("head_dim",)}


def unknown_model_keys(raw: dict, family: str) -> list[str]:
    """Keys of config.json that transformers' config class for ``family`` does not define (needs transformers);
    a gemma3 (multimodal) config is checked against Gemma3Config, whose text_config memplan reads."""
    try:
        from transformers import CONFIG_MAPPING
    except ImportError:
        return []
    if raw.get("model_type") == "gemma3":
        family = "gemma3"
    try:
        default = CONFIG_MAPPING[family]()
    except (KeyError, ValueError, TypeError):
        return []
    renamed = {"torch_dtype", *_CONSUMED_KEYS[""], *_CONSUMED_KEYS.get(family, ())}  # torch_dtype: old name of dtype
    return [k for k in raw if not k.startswith("_") and k not in renamed and not hasattr(default, k)]


def zero3_padding_rule(m: ModelSpec, stage: int, megatron: bool) -> list[Finding]:
    """ZeRO-3 and an embedding with padding_idx (Gemma 2/3, Phi-3, OLMo 2 set pad_token_id): inside a plain
    deepspeed.zero.Init, post_init's _init_weights (modeling_utils.py) zeroes weight[padding_idx] of a size-0
    partition: IndexError, from_config and from_pretrained alike (verify/hfbuild.py build_model cites the fix)."""
    if stage != 3 or megatron or m.pad_token_id is None:
        return []
    return [warning(
        "model.pad_token_id", f"ZeRO-3 with pad_token_id {m.pad_token_id}: {m.family}'s nn.Embedding takes "
        "padding_idx, and from_config / from_pretrained inside your own deepspeed.zero.Init() fail with IndexError "
        "in transformers' _init_weights (weight[padding_idx] of a size-0 partition)",
        "create transformers.integrations.HfDeepSpeedConfig(ds_config) and keep it alive, then call from_pretrained "
        "/ from_config without entering deepspeed.zero.Init yourself (transformers partitions and initialises "
        "under GatheredParameters; HF Trainer does this for you)")]


def megatron_commit() -> str:
    return tables()["megatron_deepspeed"].get("commit", "")
