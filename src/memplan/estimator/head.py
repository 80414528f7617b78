"""Outside the layers: embeddings, the final norm, logits and the causal-LM loss (transformers 5.17).

``*ForCausalLM.forward`` computes ``logits = lm_head(hidden)`` in the training dtype, then
``ForCausalLMLoss`` upcasts them (``logits.float()``) and calls ``cross_entropy`` = log_softmax + nll_loss.
Autograd keeps the fp32 log_softmax output [T, V]; the bf16 logits and the fp32 upcast are freed once
the loss is computed (the training loop keeps only ``.loss``). In backward, nll_loss's grad [T, V] fp32,
log_softmax's grad [T, V] fp32 and the saved output are alive together, then the grad is cast back.
Symbols as in activations.py; V vocab.

Gemma 2/3 (final_logit_softcapping): logits = c·tanh(logits / c); tanh keeps its output [T, V] until
backward, and backward runs mul, tanh and div backward on [T, V] grads one after the other. Gemma's embedding
scaling (embed_tokens(ids) · sqrt(h)) keeps only the 0-dim scale: its input and output are [T, h] transients.
Qwen3-MoE with output_router_logits: load_balancing_loss_func keeps, per MoE layer, softmax(router_logits)
[T, E] in the dtype (its topk keeps nothing: only the indices are used, and the node dies with its values,
measured); the router logits themselves stay alive only as long as
the model output does (the ``outputs`` loop), which is not a saved tensor and is not listed here. The
sliding-window bool masks Gemma / Phi-3 build once per forward are not saved (each layer's kernel keeps its
own additive copy, in activations_families.py).
"""

from __future__ import annotations

from functools import lru_cache

from ..specs import ModelSpec
from . import activations_families as families
from .activations import DROPOUT_MASK_BYTES, LN_STATS_BYTES, RMS_RSQRT_BYTES, Term


@lru_cache(maxsize=4096)
def saved_terms(m: ModelSpec, b: int, seq: int = 0, tp: int = 1) -> tuple[Term, ...]:
    """What stays saved outside the layers until backward reaches it, per token of this rank."""
    h, v = m.hidden_size, m.vocab_size
    terms = [Term("embedding.indices", 8, "input_ids int64 (embedding backward)"),
             Term("loss.labels", 16, "padded and shifted labels int64")]
    if m.family in families.FAMILIES:
        return tuple(terms + _family_terms(m, b, tp))
    if m.position_embedding == "rope":
        terms.append(Term("rope.cos_sin", 2 * b * m.head_dim, "cos, sin [T, head_dim] (shared by all layers)"))
    if m.sliding_window is not None and seq:  # create_sliding_window_causal_mask: bool [S, S] per sequence
        terms.append(Term("attention_mask", seq, "sliding-window mask bool [S, S] (per token: S)"))
    if m.embedding_dropout > 0:
        terms.append(Term("embedding.dropout_mask", DROPOUT_MASK_BYTES * h, "bool [T, h]"))
    if m.embedding_norm:  # BLOOM word_embeddings_layernorm
        terms.append(Term("embedding.layernorm", b * h + LN_STATS_BYTES, "[T, h] + stats"))
    if m.norm == "rmsnorm":
        terms.append(Term("final_norm", 4 * h + RMS_RSQRT_BYTES + (b * h if b != 4 else 0), "fp32 input, rsqrt, x"))
    else:
        terms.append(Term("final_norm", b * h + LN_STATS_BYTES, "[T, h] + stats"))
    terms.append(Term("lm_head.input", b * h, "final norm output [T, h]"))
    terms.append(Term("loss.log_softmax", 4 * v // tp, "log_softmax output [T, V/tp] fp32 (vocab-parallel)"))
    return tuple(terms)


@lru_cache(maxsize=4096)
def saved_bytes_per_token(m: ModelSpec, b: int, seq: int = 0, tp: int = 1) -> int:
    """The sum of saved_terms: bytes outside the layers per token of this rank."""
    return sum(x.bytes_per_token for x in saved_terms(m, b, seq, tp))


def forward_loss_transient_per_token(m: ModelSpec, b: int, tp: int = 1) -> int:
    """At the loss in forward: logits [T, V] in the training dtype and their fp32 upcast. Under tp, DeepSpeed's
    vocabulary-parallel loss (sequence/cross_entropy.py _VocabParallelCrossEntropy.forward) also holds
    ``logits - max`` [T, V/tp] fp32 while it computes the saved exp."""
    v = m.vocab_size // tp
    return b * v + (4 * v if b != 4 else 0) + (4 * v if tp > 1 else 0)


def backward_loss_transient_per_token(m: ModelSpec, b: int, tp: int = 1) -> int:
    """At log_softmax's backward: nll_loss's grad and log_softmax's grad, both [T, V] fp32. Under tp, the
    vocabulary-parallel loss's backward: grad_logits [T, V/tp] fp32 and its cast to the logits' dtype."""
    if tp > 1:
        return (4 + b) * (m.vocab_size // tp)
    return 2 * 4 * m.vocab_size


def lm_head_backward_transient_per_token(m: ModelSpec, b: int, tp: int = 1) -> int:
    """At lm_head's backward: the logits grad in the training dtype [T, V/tp] and the grad of its input [T, h]
    (Gemma's soft-capping: one more [T, V/tp] grad, softcap_backward_transient_per_token)."""
    return b * m.vocab_size // tp + b * m.hidden_size + softcap_backward_transient_per_token(m, b, tp)


def rope_terms(m: ModelSpec, b: int) -> list[Term]:
    """cos and sin [T, rotary width], computed once per forward and kept by every layer's RoPE multiply:
    Gemma 3 has one pair per layer kind (rope_parameters full_attention / sliding_attention), OLMo 2 keeps
    them fp32 (Olmo2RotaryEmbedding returns no cast), Phi-3 rotates int(head_dim · partial_rotary_factor)."""
    width = int(m.head_dim * m.rotary_pct)
    size = 4 if m.family == "olmo2" else b
    pairs = len({m.is_sliding_layer(i) for i in range(m.num_layers)}) if m.family == "gemma3_text" else 1
    return [Term("rope.cos_sin", pairs * 2 * size * width,
                 f"{pairs} × cos, sin [T, {width}] {'fp32' if size == 4 else 'dtype'} (shared by the layers)")]


def _family_terms(m: ModelSpec, b: int, tp: int) -> list[Term]:
    """Gemma 2/3, Phi-3, Qwen3-MoE, OLMo 2, DeepSeek-V3 outside the layers (see the module docstring)."""
    h, v = m.hidden_size, m.vocab_size
    terms = rope_terms(m, b) + families.rmsnorm(m, b, h, "final_norm")
    terms.append(Term("lm_head.input", b * h, "final norm output [T, h]"))
    if m.final_logit_softcapping is not None:
        terms.append(Term("logits.softcap_tanh", b * v // tp, "tanh(logits / c) [T, V/tp] (Gemma soft-capping)"))
    terms.append(Term("loss.log_softmax", 4 * v // tp, "log_softmax output [T, V/tp] fp32 (vocab-parallel)"))
    if m.output_router_logits and m.num_experts:
        moe = sum(m.is_moe_layer(i) for i in range(m.num_layers))
        terms.append(Term("moe.aux_loss", moe * b * m.num_experts,
                          f"{moe} MoE layers × softmax(router_logits) [T, {m.num_experts}] in the dtype"))
    return terms


def kept_output_bytes_per_token(m: ModelSpec, b: int, tp: int = 1) -> int:
    """What the ``outputs`` loop keeps beyond the saved tensors: the model output object (CausalLMOutputWithPast)
    from the forward's return until the next forward returns and rebinds the name (estimator/loop.py
    DeepSpeedLoop): its logits [T, V/tp] in the dtype (Gemma's: the soft-capped ones), and with
    output_router_logits each MoE layer's router logits [T, E] in the dtype (MoeCausalLMOutputWithPast)."""
    kept = b * m.vocab_size // tp
    if m.output_router_logits and m.num_experts:
        kept += sum(m.is_moe_layer(i) for i in range(m.num_layers)) * b * m.num_experts
    return kept


def softcap_backward_transient_per_token(m: ModelSpec, b: int, tp: int = 1) -> int:
    """Gemma's soft-capping backward: one more logits-sized grad [T, V/tp] in the dtype beside the one
    lm_head_backward_transient_per_token counts (tanh's backward reads its grad and writes a new one)."""
    return b * m.vocab_size // tp if m.final_logit_softcapping is not None else 0
