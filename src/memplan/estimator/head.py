"""Outside the layers: embeddings, the final norm, logits and the causal-LM loss (transformers 5.17).

``*ForCausalLM.forward`` computes ``logits = lm_head(hidden)`` in the training dtype, then
``ForCausalLMLoss`` upcasts them (``logits.float()``) and calls ``cross_entropy`` = log_softmax + nll_loss.
Autograd keeps the fp32 log_softmax output [T, V]; the bf16 logits and the fp32 upcast are freed once
the loss is computed (the training loop keeps only ``.loss``). In backward, nll_loss's grad [T, V] fp32,
log_softmax's grad [T, V] fp32 and the saved output are alive together, then the grad is cast back.
Symbols as in activations.py; V vocab.
"""

from __future__ import annotations

from ..specs import ModelSpec
from .activations import DROPOUT_MASK_BYTES, LN_STATS_BYTES, RMS_RSQRT_BYTES, Term


def saved_terms(m: ModelSpec, b: int, seq: int = 0, tp: int = 1) -> tuple[Term, ...]:
    """What stays saved outside the layers until backward reaches it, per token of this rank."""
    h, v = m.hidden_size, m.vocab_size
    terms = [Term("embedding.indices", 8, "input_ids int64 (embedding backward)"),
             Term("loss.labels", 16, "padded and shifted labels int64")]
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
    """At lm_head's backward: the logits grad in the training dtype [T, V/tp] and the grad of its input [T, h]."""
    return b * m.vocab_size // tp + b * m.hidden_size
