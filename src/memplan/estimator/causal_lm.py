"""The pieces of a transformers causal LM outside its decoder layers in the autograd model: the embedding lookup,
``*ForCausalLM.forward``'s head and ``ForCausalLMLoss`` (transformers 5.17 loss/loss_utils.py). Shapes, parameters
and the module hooks they run through are estimator/transformer.py's."""

from __future__ import annotations

from ..specs import ModelSpec
from . import blocks as B
from .autograd import Autograd, Tensor
from .transformer import INT64, Net, Output, Shape


def embedding(ag: Autograd, m: ModelSpec, s: Shape, weight: Tensor, rows: int | None = None,
              name: str = "embedding", indices: Tensor | None = None) -> Tensor:
    """nn.Embedding: the looked-up rows [rows, h] (default: the T tokens). EmbeddingBackward0
    (embedding_dense_backward on CUDA) builds the whole table's grad [V, h] in the weight's dtype; on CUDA it
    first sorts the int64 indices (embedding_backward_cuda_kernel: sorted indices and their original positions,
    freed before it returns). ``indices``: the index tensor when the model made it (saved by the node)."""
    t = s.tokens if rows is None else rows

    def backward(ctx, grad, node):
        tmp = [ctx.new(f"{name}.sorted_indices.tmp", INT64 * t), ctx.new(f"{name}.orig_indices.tmp", INT64 * t)]
        gw = ctx.new(f"grad.{name}.weight", weight.nbytes)
        for x in tmp:
            ctx.free(x)
        return (gw,)

    return ag.op(name, s.b * t * m.hidden_size, (weight,), (indices,) if indices is not None else (), backward)


def causal_lm_loss(ag: Autograd, m: ModelSpec, s: Shape, logits: Tensor) -> Tensor:
    """ForCausalLMLoss: logits.float() [T, V] fp32 (freed when the function returns), labels padded
    [B, S+1] and shifted [B, S] int64, cross_entropy = log_softmax (saves its fp32 output) + nll_loss.
    Backward: nll_loss's grad zeros [T, V] fp32, log_softmax's grad [T, V] fp32, the cast back [T, V]."""
    t, v = s.tokens, m.vocab_size
    f32 = B.to_dtype(ag, logits, B.FP32 * t * v, "loss.logits_fp32")
    padded = ag.empty("loss.labels_padded", INT64 * s.batch * (s.seq + 1), component="logits_loss")
    # labels[..., 1:].contiguous(): a copy unless the batch is 1 (a [1, S] slice is already contiguous)
    shifted = (ag.empty("loss.labels_shifted", INT64 * t, component="logits_loss") if s.batch > 1
               else ag.view(padded, "loss.labels_shifted", INT64 * t))
    flat = ag.view(f32)
    lsm = ag.op("loss.log_softmax", B.FP32 * t * v, (flat,), ("out",),
                lambda ctx, grad, node: (ctx.new("grad.loss.log_softmax", B.FP32 * t * v),),
                component="logits_loss")
    loss = ag.op("loss.nll", B.FP32, (lsm,), (shifted,),
                 lambda ctx, grad, node: (ctx.new("grad.loss.nll", B.FP32 * t * v),), component="logits_loss")
    ag.release(lsm)
    ag.release(flat)
    ag.release(f32)  # ForCausalLMLoss returns: logits (fp32), labels, shift_labels die
    ag.release(padded)
    ag.release(shifted)
    return loss


def causal_lm_head(net: Net, normed: Tensor, cap=None) -> Output:
    """*ForCausalLM.forward after its decoder returns the final norm's output ``normed`` (the caller's
    reference passes here): ``hidden_states = outputs.last_hidden_state`` stays alive until forward returns,
    after the loss; ``lm_head(hidden_states[:, slice_indices, :])`` (the slice a temporary view); ``cap``:
    Gemma 2's final logit soft-capping (rebinding logits); then ForCausalLMLoss. A frozen lm_head saves no
    input, so the norm's output dies here, not at the head."""
    ag = net.ag
    head_in = ag.view(normed)
    logits = net.linear(head_in, "lm_head", net.m.vocab_size)
    ag.release(head_in)
    if cap is not None:
        logits = cap(logits)
    logits_comp(ag, logits)
    loss = causal_lm_loss(ag, net.m, net.s, logits)
    ag.release(normed)
    return Output(loss, logits)


def logits_comp(ag: Autograd, logits: Tensor) -> None:
    """Label the logits' allocation as the head's (component logits_loss)."""
    ag.ledger.components[logits.storage.tid] = "logits_loss"
