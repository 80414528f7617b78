"""What the measuring harness cannot run, learned from the first GPU run of seed 1 (sampler version 1) and
checked against the installed code (transformers 5.17, DeepSpeed 0.19.8, torch's SDPA dispatch). Sampler
version 2 never draws these (memplan.verify.sample_space); tests/test_sample.py holds every rule to the
installed transformers / DeepSpeed, preset by preset. Pure: no torch, no transformers import.

Seed 1's errors (benchmarks/accuracy/README.md, "The sampled seed-1 run") and the rule each one became:

- BLOOM with sdpa (or flash, which verify runs as sdpa: hfbuild.ATTN_IMPLEMENTATION): PreTrainedModel's
  ``_supports_sdpa`` defaults to False (transformers/modeling_utils.py) and BloomPreTrainedModel does not set
  it, so ``_sdpa_can_dispatch`` raises "does not support an attention implementation through
  torch.nn.functional.scaled_dot_product_attention". -> NO_SDPA_FAMILIES: eager only.
- flash where transformers hands attention a mask: verify forces torch's FLASH_ATTENTION backend
  (worker.attention_context), and torch's flash kernel takes no attn_mask (sdp_utils.cpp check_for_attn_mask)
  nor q, k, v of different widths (check_head_dim_size_flash), so sdpa raises "No available kernel". Gemma 2/3,
  Mistral and Phi-3 build a mask for their sliding-window layers once the sequence reaches the window
  (masking_utils._ignore_causal_mask_sdpa: ``local_attention_size is not None and kv_length >=
  local_attention_size`` -> no skip); seed 1's gemma-3-4b line ran 2048 tokens against a 1024 window.
  Ulysses drops that mask (ulysses_sp.py uattn_wrapper: "we discard 4D tensor masks"), so sp > 1 is spared
  (seed 1's mistral-7b flash lines at sp 8 ran). MLA's values are narrower than its queries (DeepSeek-V3:
  q/k 192, v 128). -> flash_reason.
- DeepSeek-V3 with Ulysses: UlyssesSPAttentionHF checks the query against [seq/sp, batch, heads,
  config.head_dim] (ulysses_sp.py register_with_transformers reads ``getattr(arch_cfg, "head_dim", ...)``,
  UlyssesSPAttentionHF.required_query_shape), and DeepseekV3Config sets head_dim = qk_rope_head_dim (64,
  configuration_deepseek_v3.py) while its queries are qk_nope + qk_rope = 192 wide: "query input tensor does
  not match the required shape" at every sp > 1 (not a heads-per-rank matter: 128 heads divide 8).
- Mixtral with Ulysses: MixtralConfig leaves head_dim None when config.json omits it
  (configuration_mixtral.py: ``head_dim: int | None = None``, __post_init__ fills only num_key_value_heads;
  MistralConfig.__post_init__ does fill it), so register_with_transformers builds
  torch.Size([..., None]): "torch.Size() takes an iterable of 'int' (item 3 is 'NoneType')" in init, at
  any ZeRO stage (seed 1's line was ZeRO-3; the ZeRO-3 build was not the cause).
- GPT-NeoX (and GPT-2, BLOOM) with Ulysses: their configs have no num_key_value_heads, which
  register_with_transformers reads (AttributeError); GPT-2 is refused by worker.check_supported already.
- NVMe offload: DeepSpeed's async_io op does not build on the GPU image (no libaio headers), so every NVMe line
  failed in init; batch.py skips such lines where the op does not load, and version 2 draws none
  (sample_space's offload weights give nvme 0).
"""

from __future__ import annotations

from ..modelspec import ModelSpec

#: families whose transformers model has no sdpa attention (PreTrainedModel._supports_sdpa left False)
NO_SDPA_FAMILIES = ("bloom",)
#: families whose config class has no num_key_value_heads (GPT2Config, GPTNeoXConfig, BloomConfig)
NO_KV_HEADS_FAMILIES = ("gpt2", "gpt_neox", "bloom")
#: families whose config class keeps head_dim None when config.json omits it (MixtralConfig)
HEAD_DIM_UNSET_FAMILIES = ("mixtral",)


def eager_only(spec: ModelSpec) -> bool:
    """Whether the only attention verify can run for ``spec`` is eager."""
    return spec.family in NO_SDPA_FAMILIES


def _config_has_head_dim(spec: ModelSpec) -> bool:
    """Whether the config.json behind ``spec`` sets head_dim (a cut config keeps its source's keys)."""
    from .hfbuild import hf_config_dict

    return hf_config_dict(spec).get("head_dim") is not None


def ulysses_reason(spec: ModelSpec) -> str | None:
    """Why DeepSpeed's UlyssesSPAttentionHF cannot run ``spec`` at sp > 1 (None: it can)."""
    if spec.kv_lora_rank is not None:
        return ("MLA queries are qk_nope + qk_rope wide but UlyssesSPAttentionHF checks them against "
                "config.head_dim (qk_rope): query shape assertion")
    if spec.family in NO_KV_HEADS_FAMILIES:
        return f"{spec.family}'s config has no num_key_value_heads, which register_with_transformers reads"
    if spec.family in HEAD_DIM_UNSET_FAMILIES and not _config_has_head_dim(spec):
        return f"{spec.family}'s config keeps head_dim None: torch.Size TypeError in UlyssesSPAttentionHF"
    return None


def sdpa_mask(spec: ModelSpec, seq: int, sp: int) -> bool:
    """Whether transformers builds an attention mask for sdpa (some sliding layer at seq >= the window, sp 1)."""
    if sp > 1 or spec.sliding_window is None or seq < spec.sliding_window:
        return False
    return any(spec.is_sliding_layer(i) for i in range(spec.num_layers))


def flash_reason(spec: ModelSpec, seq: int, sp: int, dtype: str) -> str | None:
    """Why torch's FLASH_ATTENTION backend cannot run ``spec``'s attention (None: it can)."""
    if eager_only(spec):
        return f"{spec.family} has no sdpa attention"
    if dtype == "fp32":
        return "flash attention takes fp16 / bf16 only"
    if spec.kv_lora_rank is not None:
        return "MLA's values are narrower than its queries (check_head_dim_size_flash)"
    if spec.head_dim > 256 or spec.head_dim % 8:
        return "flash attention needs head_dim <= 256 and a multiple of 8"
    if sdpa_mask(spec, seq, sp):
        return "transformers passes a sliding-window mask, which the flash kernel does not take"
    return None


def attention_reason(spec: ModelSpec, attention: str, seq: int, sp: int, dtype: str) -> str | None:
    """Why verify cannot run ``attention`` for this model, sequence, sp and dtype (None: it can)."""
    if attention == "flash":
        return flash_reason(spec, seq, sp, dtype)
    if attention == "sdpa" and eager_only(spec):
        return f"{spec.family} has no sdpa attention"
    if attention == "eager" and sp > 1:
        return "Ulysses with eager attention: DeepSpeed refuses it (needs a 4D mask)"
    return None


__all__ = ["attention_reason", "eager_only", "flash_reason", "sdpa_mask", "ulysses_reason"]
