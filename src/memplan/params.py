"""Every trainable parameter tensor of a model, bottom-up, as transformers builds it.

``parameter_tensors`` lists the tensors in exactly the order ``AutoModelForCausalLM.from_config(cfg)
.named_parameters()`` yields them in transformers 5.17 (module registration order; a tied lm_head is the
embedding and is listed once, as named_parameters does). The names and shapes follow each family's
``modeling_<family>.py``: ``nn.Linear(in, out)`` has weight (out, in) and bias (out,); GPT-2's ``Conv1D(nf, nx)``
has weight (nx, nf) and bias (nf,); norms have weight (and bias for LayerNorm) of their width.
Tests compare this with the real module tree on the meta device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from .specs import ModelSpec

#: what a tensor does, so callers need not parse names. Megatron-style TP (Shoeybi et al. 2019, §3) splits
#: attn_in / mlp_in column-wise (weight and bias) and attn_out / mlp_out row-wise (weight only; bias whole).
#: attn_latent: MLA's low-rank down projections (DeepSeek-V3 q_a_proj, kv_a_proj_with_mqa), which Megatron-Core's
#: MLASelfAttention keeps whole on every tp rank (their up projections q_b_proj / kv_b_proj are attn_in).
Role = Literal["embedding", "position", "norm", "attn_in", "attn_out", "attn_latent", "mlp_in", "mlp_out", "router",
               "lm_head"]


@dataclass(frozen=True, slots=True)
class ParamTensor:
    """One parameter tensor: its Hugging Face name, shape, transformer layer (None outside the layers), role."""

    name: str
    shape: tuple[int, ...]
    layer: int | None = None
    role: Role = "norm"

    @property
    def is_bias(self) -> bool:
        """A bias vector (name ends in .bias)."""
        return self.name.endswith(".bias")

    @property
    def numel(self) -> int:
        """Elements in the tensor: the product of its shape."""
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class ParamCounts:
    """Parameter counts; total = embedding + Σ layer_params + final_norm + lm_head (= embedding + num_layers ·
    per_layer + final_norm + lm_head where all layers are alike)."""

    total_params: int
    embedding_params: int  # word (+ position) embeddings, BLOOM's embedding LayerNorm
    per_layer_params: int  # layer 0 (DeepSeek-V3's dense first layers and Qwen3-MoE's mlp_only_layers differ)
    final_norm_params: int
    lm_head_params: int  # 0 when tied to the word embeddings
    largest_tensor_numel: int
    layer_params: tuple[int, ...] = ()  # each layer's parameters, in order


def _linear(name: str, out_dim: int, in_dim: int, bias: bool, layer: int, role: Role) -> list[ParamTensor]:
    """nn.Linear(in_dim, out_dim, bias): weight (out, in), then bias (out,)."""
    tensors = [ParamTensor(f"{name}.weight", (out_dim, in_dim), layer, role)]
    if bias:
        tensors.append(ParamTensor(f"{name}.bias", (out_dim,), layer, role))
    return tensors


def _conv1d(name: str, nf: int, nx: int, layer: int, role: Role) -> list[ParamTensor]:
    """transformers.pytorch_utils.Conv1D(nf, nx): weight (nx, nf), bias (nf,)."""
    return [ParamTensor(f"{name}.weight", (nx, nf), layer, role), ParamTensor(f"{name}.bias", (nf,), layer, role)]


def _norm(name: str, width: int, layernorm: bool, layer: int | None) -> list[ParamTensor]:
    """RMSNorm: weight (width,); nn.LayerNorm: weight and bias (width,)."""
    tensors = [ParamTensor(f"{name}.weight", (width,), layer, "norm")]
    if layernorm:
        tensors.append(ParamTensor(f"{name}.bias", (width,), layer, "norm"))
    return tensors


def _llama_layer(m: ModelSpec, i: int) -> list[ParamTensor]:
    """LlamaDecoderLayer and its kin (Mistral, Qwen2, Qwen3, Mixtral): self_attn, mlp, two RMSNorms."""
    p, h = f"model.layers.{i}", m.hidden_size
    t = _linear(f"{p}.self_attn.q_proj", m.q_dim, h, m.attention_bias, i, "attn_in")
    t += _linear(f"{p}.self_attn.k_proj", m.kv_dim, h, m.attention_bias, i, "attn_in")
    t += _linear(f"{p}.self_attn.v_proj", m.kv_dim, h, m.attention_bias, i, "attn_in")
    t += _linear(f"{p}.self_attn.o_proj", h, m.q_dim, m.attention_out_bias, i, "attn_out")
    if m.qk_norm:  # Qwen3Attention.q_norm / k_norm: RMSNorm(head_dim)
        t += _norm(f"{p}.self_attn.q_norm", m.head_dim, False, i)
        t += _norm(f"{p}.self_attn.k_norm", m.head_dim, False, i)
    e, ffn = m.num_experts, m.intermediate_size
    if e:  # MixtralSparseMoeBlock: router weight, then MixtralExperts' packed 3-D parameters
        t.append(ParamTensor(f"{p}.mlp.gate.weight", (e, h), i, "router"))
        t.append(ParamTensor(f"{p}.mlp.experts.gate_up_proj", (e, 2 * ffn, h), i, "mlp_in"))
        t.append(ParamTensor(f"{p}.mlp.experts.down_proj", (e, h, ffn), i, "mlp_out"))
    else:
        t += _linear(f"{p}.mlp.gate_proj", ffn, h, m.mlp_bias, i, "mlp_in")
        t += _linear(f"{p}.mlp.up_proj", ffn, h, m.mlp_bias, i, "mlp_in")
        t += _linear(f"{p}.mlp.down_proj", h, ffn, m.mlp_bias, i, "mlp_out")
    t += _norm(f"{p}.input_layernorm", h, False, i)
    t += _norm(f"{p}.post_attention_layernorm", h, False, i)
    return t


def _gpt2_layer(m: ModelSpec, i: int) -> list[ParamTensor]:
    """GPT2Block: ln_1, attn (c_attn, c_proj), ln_2, mlp (c_fc, c_proj)."""
    p, h = f"transformer.h.{i}", m.hidden_size
    t = _norm(f"{p}.ln_1", h, True, i)
    t += _conv1d(f"{p}.attn.c_attn", 3 * h, h, i, "attn_in") + _conv1d(f"{p}.attn.c_proj", h, h, i, "attn_out")
    t += _norm(f"{p}.ln_2", h, True, i)
    t += _conv1d(f"{p}.mlp.c_fc", m.intermediate_size, h, i, "mlp_in")
    t += _conv1d(f"{p}.mlp.c_proj", h, m.intermediate_size, i, "mlp_out")
    return t


def _neox_layer(m: ModelSpec, i: int) -> list[ParamTensor]:
    """GPTNeoXLayer: both LayerNorms, attention (query_key_value, dense), mlp (dense_h_to_4h, dense_4h_to_h)."""
    p, h = f"gpt_neox.layers.{i}", m.hidden_size
    t = _norm(f"{p}.input_layernorm", h, True, i) + _norm(f"{p}.post_attention_layernorm", h, True, i)
    t += _linear(f"{p}.attention.query_key_value", 3 * h, h, m.attention_bias, i, "attn_in")
    t += _linear(f"{p}.attention.dense", h, h, m.attention_out_bias, i, "attn_out")
    t += _linear(f"{p}.mlp.dense_h_to_4h", m.intermediate_size, h, True, i, "mlp_in")
    t += _linear(f"{p}.mlp.dense_4h_to_h", h, m.intermediate_size, True, i, "mlp_out")
    return t


def _bloom_layer(m: ModelSpec, i: int) -> list[ParamTensor]:
    """BloomBlock: input_layernorm, self_attention (query_key_value, dense), post_attention_layernorm, mlp."""
    p, h = f"transformer.h.{i}", m.hidden_size
    t = _norm(f"{p}.input_layernorm", h, True, i)
    t += _linear(f"{p}.self_attention.query_key_value", 3 * h, h, True, i, "attn_in")
    t += _linear(f"{p}.self_attention.dense", h, h, True, i, "attn_out")
    t += _norm(f"{p}.post_attention_layernorm", h, True, i)
    t += _linear(f"{p}.mlp.dense_h_to_4h", m.intermediate_size, h, True, i, "mlp_in")
    t += _linear(f"{p}.mlp.dense_4h_to_h", h, m.intermediate_size, True, i, "mlp_out")
    return t


def _attention_qkvo(m: ModelSpec, p: str, i: int) -> list[ParamTensor]:
    """q_proj, k_proj, v_proj, o_proj as Gemma2/Gemma3/Olmo2/Qwen3Moe attention register them."""
    h = m.hidden_size
    t = _linear(f"{p}.self_attn.q_proj", m.q_dim, h, m.attention_bias, i, "attn_in")
    t += _linear(f"{p}.self_attn.k_proj", m.kv_dim, h, m.attention_bias, i, "attn_in")
    t += _linear(f"{p}.self_attn.v_proj", m.kv_dim, h, m.attention_bias, i, "attn_in")
    t += _linear(f"{p}.self_attn.o_proj", h, m.q_dim, m.attention_out_bias, i, "attn_out")
    if m.qk_norm:  # per head (Gemma3Attention, Qwen3MoeAttention) or over the projection (Olmo2Attention)
        t += _norm(f"{p}.self_attn.q_norm", m.head_dim if m.qk_norm_per_head else m.q_dim, False, i)
        t += _norm(f"{p}.self_attn.k_norm", m.head_dim if m.qk_norm_per_head else m.kv_dim, False, i)
    return t


def _dense_mlp(m: ModelSpec, name: str, width: int, i: int) -> list[ParamTensor]:
    """gate_proj, up_proj, down_proj without biases (Gemma2MLP, Olmo2MLP, Qwen3MoeMLP, DeepseekV3MLP)."""
    h = m.hidden_size
    return (_linear(f"{name}.gate_proj", width, h, False, i, "mlp_in")
            + _linear(f"{name}.up_proj", width, h, False, i, "mlp_in")
            + _linear(f"{name}.down_proj", h, width, False, i, "mlp_out"))


def _experts(m: ModelSpec, p: str, i: int) -> list[ParamTensor]:
    """Qwen3MoeExperts / DeepseekV3Experts: packed gate_up_proj (E, 2I, h) and down_proj (E, h, I)."""
    e, h, ffn = m.num_experts, m.hidden_size, m.expert_intermediate_size
    return [ParamTensor(f"{p}.mlp.experts.gate_up_proj", (e, 2 * ffn, h), i, "mlp_in"),
            ParamTensor(f"{p}.mlp.experts.down_proj", (e, h, ffn), i, "mlp_out")]


def _gemma_layer(m: ModelSpec, i: int) -> list[ParamTensor]:
    """Gemma2DecoderLayer / Gemma3DecoderLayer: self_attn (Gemma 3: q_norm, k_norm), mlp, four RMSNorms."""
    p = f"model.layers.{i}"
    t = _attention_qkvo(m, p, i) + _dense_mlp(m, f"{p}.mlp", m.intermediate_size, i)
    for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"):
        t += _norm(f"{p}.{norm}", m.hidden_size, False, i)
    return t


def _phi3_layer(m: ModelSpec, i: int) -> list[ParamTensor]:
    """Phi3DecoderLayer: self_attn (o_proj registered before qkv_proj), mlp (gate_up_proj, down_proj), norms."""
    p, h = f"model.layers.{i}", m.hidden_size
    t = _linear(f"{p}.self_attn.o_proj", h, m.q_dim, False, i, "attn_out")
    t += _linear(f"{p}.self_attn.qkv_proj", m.q_dim + 2 * m.kv_dim, h, False, i, "attn_in")
    t += _linear(f"{p}.mlp.gate_up_proj", 2 * m.intermediate_size, h, False, i, "mlp_in")
    t += _linear(f"{p}.mlp.down_proj", h, m.intermediate_size, False, i, "mlp_out")
    return t + _norm(f"{p}.input_layernorm", h, False, i) + _norm(f"{p}.post_attention_layernorm", h, False, i)


def _olmo2_layer(m: ModelSpec, i: int) -> list[ParamTensor]:
    """Olmo2DecoderLayer: self_attn (q_norm, k_norm over the projections), mlp, the two norms after them."""
    p = f"model.layers.{i}"
    t = _attention_qkvo(m, p, i) + _dense_mlp(m, f"{p}.mlp", m.intermediate_size, i)
    return (t + _norm(f"{p}.post_attention_layernorm", m.hidden_size, False, i)
            + _norm(f"{p}.post_feedforward_layernorm", m.hidden_size, False, i))


def _qwen3_moe_layer(m: ModelSpec, i: int) -> list[ParamTensor]:
    """Qwen3MoeDecoderLayer: self_attn, then Qwen3MoeSparseMoeBlock (experts, then the router gate) or
    Qwen3MoeMLP (intermediate_size) on mlp_only_layers / off-step layers, then two RMSNorms."""
    p, h = f"model.layers.{i}", m.hidden_size
    t = _attention_qkvo(m, p, i)
    if m.is_moe_layer(i):
        t += _experts(m, p, i) + [ParamTensor(f"{p}.mlp.gate.weight", (m.num_experts, h), i, "router")]
    else:
        t += _dense_mlp(m, f"{p}.mlp", m.intermediate_size, i)
    return t + _norm(f"{p}.input_layernorm", h, False, i) + _norm(f"{p}.post_attention_layernorm", h, False, i)


def _deepseek_layer(m: ModelSpec, i: int) -> list[ParamTensor]:
    """DeepseekV3DecoderLayer: MLA self_attn (q_proj, or q_a_proj + q_a_layernorm + q_b_proj; kv_a_proj_with_mqa,
    kv_a_layernorm, kv_b_proj, o_proj), then DeepseekV3MLP (first_k_dense_replace layers) or DeepseekV3MoE
    (experts, gate, shared_experts), then two RMSNorms. attention_bias: q_a_proj, kv_a_proj_with_mqa, o_proj."""
    p, h, nh, bias = f"model.layers.{i}", m.hidden_size, m.num_heads, m.attention_bias
    rope, nope, v = m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim
    a = f"{p}.self_attn"
    if m.q_lora_rank is None:
        t = _linear(f"{a}.q_proj", m.q_dim, h, False, i, "attn_in")
    else:
        t = (_linear(f"{a}.q_a_proj", m.q_lora_rank, h, bias, i, "attn_latent")
             + _norm(f"{a}.q_a_layernorm", m.q_lora_rank, False, i)
             + _linear(f"{a}.q_b_proj", m.q_dim, m.q_lora_rank, False, i, "attn_in"))
    t += _linear(f"{a}.kv_a_proj_with_mqa", m.kv_lora_rank + rope, h, bias, i, "attn_latent")
    t += _norm(f"{a}.kv_a_layernorm", m.kv_lora_rank, False, i)
    t += _linear(f"{a}.kv_b_proj", nh * (nope + v), m.kv_lora_rank, False, i, "attn_in")
    t += _linear(f"{a}.o_proj", h, nh * v, bias, i, "attn_out")
    if m.is_moe_layer(i):
        t += _experts(m, p, i) + [ParamTensor(f"{p}.mlp.gate.weight", (m.num_experts, h), i, "router")]
        t += _dense_mlp(m, f"{p}.mlp.shared_experts", m.expert_intermediate_size * m.n_shared_experts, i)
    else:
        t += _dense_mlp(m, f"{p}.mlp", m.intermediate_size, i)
    return t + _norm(f"{p}.input_layernorm", h, False, i) + _norm(f"{p}.post_attention_layernorm", h, False, i)


_NEW_LAYERS = {"gemma2": _gemma_layer, "gemma3_text": _gemma_layer, "phi3": _phi3_layer, "qwen3_moe": _qwen3_moe_layer,
               "olmo2": _olmo2_layer, "deepseek_v3": _deepseek_layer}


#: family → (embedding tensors' names, layer builder, final norm name); lm_head.weight follows unless tied.
_LAYOUT = {
    "gpt2": (("transformer.wte.weight", "transformer.wpe.weight"), _gpt2_layer, "transformer.ln_f"),
    "gpt_neox": (("gpt_neox.embed_in.weight",), _neox_layer, "gpt_neox.final_layer_norm"),
    "bloom": (("transformer.word_embeddings.weight",), _bloom_layer, "transformer.ln_f"),
    **{family: (("model.embed_tokens.weight",), layer, "model.norm") for family, layer in _NEW_LAYERS.items()},
}
_LLAMA_LAYOUT = (("model.embed_tokens.weight",), _llama_layer, "model.norm")


def _embeddings(m: ModelSpec, names: tuple[str, ...]) -> list[ParamTensor]:
    """Word embeddings (vocab, hidden); GPT-2's position table (n_positions, hidden); BLOOM's embedding LayerNorm."""
    t = [ParamTensor(names[0], (m.vocab_size, m.hidden_size), None, "embedding")]
    if m.position_embedding == "learned":
        t.append(ParamTensor(names[1], (m.max_position_embeddings, m.hidden_size), None, "position"))
    if m.embedding_norm:
        t += _norm("transformer.word_embeddings_layernorm", m.hidden_size, True, None)
    return t


@lru_cache(maxsize=256)
def parameter_tensors(model: ModelSpec) -> tuple[ParamTensor, ...]:
    """All trainable tensors of ``model`` in named_parameters() order (tied lm_head once)."""
    names, layer, final_norm = _LAYOUT.get(model.family, _LLAMA_LAYOUT)
    tensors = _embeddings(model, names)
    for i in range(model.num_layers):
        tensors += layer(model, i)
    tensors += _norm(final_norm, model.hidden_size, model.norm == "layernorm", None)
    if not model.tie_word_embeddings:  # *ForCausalLM.lm_head = nn.Linear(hidden, vocab, bias=False)
        tensors.append(ParamTensor("lm_head.weight", (model.vocab_size, model.hidden_size), None, "lm_head"))
    return tuple(tensors)


@lru_cache(maxsize=256)
def count_params(model: ModelSpec) -> ParamCounts:
    """Parameter counts of ``model``, summed from parameter_tensors."""
    tensors = parameter_tensors(model)
    layers = [0] * model.num_layers
    for t in tensors:
        if t.layer is not None:
            layers[t.layer] += t.numel
    lm_head = sum(t.numel for t in tensors if t.role == "lm_head")
    first_layer_at = next(i for i, t in enumerate(tensors) if t.layer == 0)
    embedding = sum(t.numel for t in tensors[:first_layer_at])
    total = sum(t.numel for t in tensors)
    final_norm = total - embedding - sum(layers) - lm_head
    return ParamCounts(
        total_params=total, embedding_params=embedding, per_layer_params=layers[0], final_norm_params=final_norm,
        lm_head_params=lm_head, largest_tensor_numel=max(t.numel for t in tensors), layer_params=tuple(layers),
    )


@lru_cache(maxsize=256)
def linear_modules(model: ModelSpec) -> tuple[str, ...]:
    """Qualified names of the model's nn.Linear / Conv1D modules (a 2-D weight that is not an embedding), in
    named_modules() order: what peft's LoRA can adapt. A tied lm_head is the embedding, not a Linear; MoE
    routers (MixtralTopKRouter, Qwen3MoeTopKRouter, DeepseekV3TopkRouter) hold a bare nn.Parameter and the
    experts packed 3-D parameters, so neither is a Linear."""
    return tuple(t.name.removesuffix(".weight") for t in parameter_tensors(model)
                 if t.name.endswith(".weight") and len(t.shape) == 2
                 and t.role not in ("embedding", "position", "router"))


def frozen_names(model: ModelSpec, groups: tuple[str, ...]) -> frozenset[str]:
    """Parameter names --freeze turns off: embeddings (word, position, BLOOM's embedding norm; a tied lm_head
    is the word embedding), lm_head (the word embedding when tied), norms (every norm weight and bias), layers:N
    (every parameter of the first N transformer layers)."""
    out: set[str] = set()
    tensors = parameter_tensors(model)
    for group in groups:
        if group == "embeddings":
            out.update(t.name for t in tensors if t.layer is None and t.role in ("embedding", "position")
                       or (t.layer is None and t.role == "norm" and "embedding" in t.name))
        elif group == "lm_head":
            out.update(t.name for t in tensors if t.role == "lm_head")
            if model.tie_word_embeddings:
                out.update(t.name for t in tensors if t.role == "embedding")
        elif group == "norms":
            out.update(t.name for t in tensors if t.role == "norm")
        elif group.startswith("layers:"):
            first = int(group.split(":", 1)[1])
            out.update(t.name for t in tensors if t.layer is not None and t.layer < first)
    return frozenset(out)
