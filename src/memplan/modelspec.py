"""The model spec: a decoder-only transformer as transformers 5.17 builds its family (re-exported by specs).

Kept apart from specs.py (the training setup and layout) so that each file stays small to read.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Family = Literal["llama", "mistral", "qwen2", "qwen3", "gpt2", "gpt_neox", "bloom", "mixtral", "gemma2", "gemma3_text",
                 "phi3", "qwen3_moe", "olmo2", "deepseek_v3"]
#: transformers' per-layer attention kinds (Gemma2Config / Gemma3TextConfig layer_types)
LayerType = Literal["full_attention", "sliding_attention"]


class ModelSpec(BaseModel):
    """A decoder-only transformer as transformers implements its family (what `--model` resolves to).

    Field names after the first block are the config.json keys they come from, so an error names the key.
    Layers may differ (Gemma's sliding / full attention, dense layers before MoE ones): ``is_sliding_layer(i)``
    and ``is_moe_layer(i)`` answer per layer, from rules that also hold for a copy cut to fewer layers (as
    verify builds them: transformers keeps the full-depth ``layer_types`` and uses its first entries)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="preset name or config path")
    family: Family = Field(description="transformers model_type")
    hidden_size: int = Field(gt=0)
    num_layers: int = Field(gt=0, description="num_hidden_layers")
    num_heads: int = Field(gt=0, description="num_attention_heads")
    num_kv_heads: int = Field(gt=0, description="num_key_value_heads (= num_heads without GQA)")
    head_dim: int = Field(gt=0, description="query/key width per head (MLA: qk_rope_head_dim, the RoPE width, as "
                          "DeepseekV3Config sets head_dim; q_dim / kv_dim give MLA's real widths)")
    intermediate_size: int = Field(gt=0, description="MLP width (per expert for Mixtral; dense layers' for "
                                   "Qwen3-MoE / DeepSeek-V3, whose experts use moe_intermediate_size)")
    vocab_size: int = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)
    tie_word_embeddings: bool = False
    attention_bias: bool = Field(False, description="bias on q/k/v projections")
    attention_out_bias: bool = Field(False, description="bias on the attention output projection")
    mlp_bias: bool = False
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    gated_mlp: bool = Field(True, description="gate/up/down (SwiGLU) vs fc_in/fc_out")
    activation: str = "silu"
    position_embedding: Literal["rope", "learned", "alibi"] = "rope"
    parallel_residual: bool = Field(False, description="GPT-NeoX: attention and MLP read the same input")
    qk_norm: bool = Field(False, description="RMSNorm on q and k (Qwen3, Gemma 3, OLMo 2; see qk_norm_per_head)")
    embedding_norm: bool = Field(False, description="BLOOM: LayerNorm after the word embeddings")
    rotary_pct: float = Field(1.0, gt=0, le=1, description="share of head_dim that gets RoPE (GPT-NeoX rotary_pct, "
                              "Phi-3 partial_rotary_factor)")
    hidden_dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the attention and MLP outputs (gpt2 resid_pdrop)")
    attention_dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the attention probabilities (gpt2 attn_pdrop)")
    embedding_dropout: float = Field(0.0, ge=0, lt=1, description="dropout after the embeddings (gpt2 embd_pdrop)")
    config_head_dim_unset: bool = Field(False, description="the transformers config's head_dim attribute is None "
                                        "(MixtralConfig without a head_dim in config.json): code reading "
                                        "config.head_dim gets None (DeepSpeed's UlyssesSPAttentionHF)")
    sliding_window: int | None = Field(None, gt=0, description="sliding-window attention span; None: off; with "
                                       "layer_types only the sliding_attention layers use it")
    num_experts: int = Field(0, ge=0, description="routed MoE experts per MoE layer (0: dense)")
    num_experts_per_tok: int = Field(0, ge=0, description="experts each token is routed to (top-k)")
    pad_token_id: int | None = Field(None, ge=0, description="the word embedding's padding_idx (nn.Embedding; "
                                     "transformers' _init_weights zeroes that row); None: none, or the family's "
                                     "embedding takes no padding_idx (GPT-2, GPT-NeoX, BLOOM)")
    # ---- Gemma 2 / Gemma 3 ----
    layer_types: tuple[LayerType, ...] = Field((), description="per-layer attention kind (Gemma); (): every "
                                              "layer alike, sliding when sliding_window is set (Mistral, Phi-3)")
    final_logit_softcapping: float | None = Field(None, gt=0, description="Gemma 2: logits = c·tanh(logits/c)")
    attn_logit_softcapping: float | None = Field(None, gt=0, description="Gemma 2: scores = c·tanh(scores/c) "
                                                 "(eager attention only: sdpa ignores it)")
    query_pre_attn_scalar: float | None = Field(None, gt=0, description="Gemma: attention scale "
                                                "query_pre_attn_scalar**-0.5 instead of head_dim**-0.5")
    scale_embeddings: bool = Field(False, description="Gemma: embeddings times sqrt(hidden_size) "
                                   "(Gemma2TextScaledWordEmbedding)")
    norm_placement: Literal["pre", "post", "sandwich"] = Field(
        "pre", description="pre: input_layernorm, post_attention_layernorm before attention / MLP (Llama); "
        "post: OLMo 2's post_attention_layernorm, post_feedforward_layernorm on the attention / MLP outputs; "
        "sandwich: Gemma's four (input, post_attention, pre_feedforward, post_feedforward)")
    qk_norm_per_head: bool = Field(True, description="q/k norms over head_dim (Qwen3, Gemma 3); False: over the "
                                   "whole q and k projections (OLMo 2)")
    # ---- Phi-3 ----
    fused_qkv: bool = Field(False, description="Phi-3: q, k, v from one qkv_proj Linear")
    fused_gate_up: bool = Field(False, description="Phi-3: gate and up from one gate_up_proj Linear")
    # ---- MoE (Mixtral, Qwen3-MoE, DeepSeek-V3) ----
    moe_intermediate_size: int | None = Field(None, gt=0, description="per-expert MLP width; None: intermediate_size")
    n_shared_experts: int = Field(0, ge=0, description="DeepSeek-V3: shared experts, one MLP of "
                                  "n_shared_experts·moe_intermediate_size beside the routed ones")
    first_k_dense_replace: int = Field(0, ge=0, description="DeepSeek-V3: the first k layers have a dense MLP")
    decoder_sparse_step: int = Field(1, gt=0, description="Qwen3-MoE: layer i is MoE when (i+1) % step == 0")
    mlp_only_layers: tuple[int, ...] = Field((), description="Qwen3-MoE: layers with a dense MLP")
    norm_topk_prob: bool = Field(False, description="top-k routing weights renormalised to sum to 1")
    router_scoring: Literal["softmax", "sigmoid"] = Field(
        "softmax", description="softmax router (Mixtral, Qwen3-MoE); sigmoid with fp32 logits (DeepSeek-V3)")
    output_router_logits: bool = Field(False, description="the auxiliary load-balancing loss is computed")
    router_aux_loss_coef: float = Field(0.0, ge=0, description="weight of the load-balancing loss")
    n_group: int | None = Field(None, gt=0, description="DeepSeek-V3: expert groups of the group-limited router")
    topk_group: int | None = Field(None, gt=0, description="DeepSeek-V3: groups each token may use")
    # ---- MLA (DeepSeek-V3 multi-head latent attention) ----
    kv_lora_rank: int | None = Field(None, gt=0, description="MLA: width of the compressed kv latent; None: not MLA")
    q_lora_rank: int | None = Field(None, gt=0, description="MLA: width of the q latent; None: a full q_proj")
    qk_nope_head_dim: int | None = Field(None, gt=0, description="MLA: per-head q/k width without RoPE")
    qk_rope_head_dim: int | None = Field(None, gt=0, description="MLA: per-head q/k width with RoPE (k's shared)")
    v_head_dim: int | None = Field(None, gt=0, description="MLA: per-head value width")
    rope_interleave: bool = Field(False, description="MLA: RoPE on interleaved pairs (DeepSeek rope_interleave)")
    source: str = Field("", description="where the numbers come from")

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be divisible by num_key_value_heads ({self.num_kv_heads})"
            )
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts):
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts ({self.num_experts})"
            )
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries; num_hidden_layers is {self.num_layers}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but sliding_window is null")
        if self.n_group is not None and self.num_experts:
            if self.num_experts % self.n_group or self.num_experts // self.n_group < 2:
                raise ValueError(f"n_group ({self.n_group}) must divide num_experts ({self.num_experts}) into groups "
                                 "of at least 2 (the router's topk(2) per group)")
            if not 0 < (self.topk_group or 0) <= self.n_group:
                raise ValueError(f"topk_group ({self.topk_group}) must be in 1..n_group ({self.n_group})")
        mla = (self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)
        if self.kv_lora_rank is not None and None in mla:
            raise ValueError("kv_lora_rank (MLA) needs qk_nope_head_dim, qk_rope_head_dim and v_head_dim")
        if self.kv_lora_rank is not None and self.head_dim != mla[1]:
            raise ValueError(f"MLA head_dim ({self.head_dim}) must be qk_rope_head_dim ({mla[1]}), as "
                             "DeepseekV3Config.__post_init__ sets it")
        if self.kv_lora_rank is not None and self.num_kv_heads != self.num_heads:
            raise ValueError(f"MLA num_key_value_heads ({self.num_kv_heads}) must equal num_attention_heads "
                             f"({self.num_heads}): DeepseekV3Attention expands k and v to every head")
        return self

    @property
    def q_dim(self) -> int:
        """Width of the query projection output: heads · head_dim (MLA: heads · (qk_nope + qk_rope))."""
        if self.kv_lora_rank is not None:
            return self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of each key / value projection output: kv_heads · head_dim (MLA: the expanded keys,
        heads · (qk_nope + qk_rope); values are heads · v_head_dim)."""
        if self.kv_lora_rank is not None:
            return self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        return self.num_kv_heads * self.head_dim

    @property
    def expert_intermediate_size(self) -> int:
        """One routed expert's MLP width: moe_intermediate_size, or intermediate_size (Mixtral)."""
        return self.moe_intermediate_size or self.intermediate_size

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` routes to experts: Qwen3MoeDecoderLayer (not in mlp_only_layers and
        (i+1) % decoder_sparse_step == 0) and DeepseekV3DecoderLayer (i >= first_k_dense_replace)."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
                and i >= self.first_k_dense_replace)

    def is_sliding_layer(self, i: int) -> bool:
        """Whether layer ``i`` attends within sliding_window: its layer_types entry (repeated past the end,
        which only a copy with more layers than the config reaches), else every layer when the window is set."""
        if self.layer_types:
            return self.layer_types[i % len(self.layer_types)] == "sliding_attention"
        return self.sliding_window is not None
