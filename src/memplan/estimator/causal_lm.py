"""The pieces of a transformers causal LM outside its decoder layers in the autograd model: the embedding lookup,
``*ForCausalLM.forward``'s head and ``ForCausalLMLoss`` (transformers 5.17 loss/loss_utils.py). Shapes, parameters
and the module hooks they run through are estimator/transformer.py's."""

from __future__ import annotations

from ..specs import ModelSpec
from . import blocks as B
from .autograd import Autograd, Tensor
from .transformer import INT64, Net, Output, Shape


#: embedding_dense_backward_cuda (aten/src/ATen/native/cuda/Embedding.cu): up to this many indices the grad is summed
#: by embedding_backward_feature_kernel straight into the zeroed table, with no sort and no temporaries
EMBEDDING_FEATURE_KERNEL_MAX_INDICES = 3072
#: EmbeddingBackwardKernel.cu NROWS_PER_THREAD: rows a partial segment sums (max_partial_segment's divisor)
EMBEDDING_NROWS_PER_THREAD = 10


def embedding(ag: Autograd, m: ModelSpec, s: Shape, weight: Tensor, rows: int | None = None,
              name: str = "embedding", indices: Tensor | None = None, cuda: bool = True) -> Tensor:
    """nn.Embedding: the looked-up rows [rows, h] (default: the T tokens). EmbeddingBackward0 returns the whole
    table's grad [V, h] in the weight's dtype. On the CPU (embedding_dense_backward_cpu) that zeroed table is all it
    makes; on CUDA above EMBEDDING_FEATURE_KERNEL_MAX_INDICES indices it sorts them first and sums segment by segment
    (``_cuda_sorted_backward``). ``indices``: the index tensor when the model made it (saved by the node)."""
    t = s.tokens if rows is None else rows

    def backward(ctx, grad, node):
        if cuda and t > EMBEDDING_FEATURE_KERNEL_MAX_INDICES:
            return (_cuda_sorted_backward(ctx, name, t, weight.nbytes, weight.nbytes // (s.b * m.hidden_size),
                                          m.hidden_size),)
        return (ctx.new(f"grad.{name}.weight", weight.nbytes),)

    return ag.op(name, s.b * t * m.hidden_size, (weight,), (indices,) if indices is not None else (), backward)


def _cuda_sorted_backward(ctx, name: str, t: int, grad_bytes: int, vocab: int, h: int):
    """embedding_dense_backward_cuda's sorted path for ``t`` int64 indices into a [``vocab``, ``h``] table (torch 2.11,
    aten/src/ATen/native/cuda/Embedding.cu and EmbeddingBackwardKernel.cu): sorted_indices and orig_indices
    (empty_like), the arange radix_sort_pairs reads (freed after it), then embedding_backward_cuda_kernel: the zeroed
    grad, segment_offsets [t] and the segment count, cub::unique_by_key's keys_out [t] (ATen/cuda/cub.cuh, freed when
    it returns), partials_per_segment and its offsets [min(t, V)], the partial count, partial_segment_offset and the
    fp32 partial sums [max_partial_segment(, h)] (max_partial_segment = t / NROWS_PER_THREAD + min(t, V)), freed last
    made first as their scopes close; the sorted indices go when embedding_dense_backward_cuda returns. cub's own temp
    storage (radix sort, unique_by_key, exclusive_sum) is not counted: 83,455 bytes for 4,096 keys, 1,068,543 for
    65,536 on the committed traces."""
    segments = min(t, vocab)
    partials = t // EMBEDDING_NROWS_PER_THREAD + segments
    sort = [ctx.new(f"{name}.{w}.tmp", INT64 * t) for w in ("sorted_indices", "orig_indices", "range")]
    ctx.free(sort.pop())
    gw = ctx.new(f"grad.{name}.weight", grad_bytes)
    kernel = [ctx.new(f"{name}.segment_offsets.tmp", INT64 * t), ctx.new(f"{name}.num_of_segments.tmp", INT64)]
    ctx.free(ctx.new(f"{name}.unique_keys_out.tmp", INT64 * t))
    scoped = [ctx.new(f"{name}.{w}.tmp", INT64 * segments) for w in ("partials_per_segment",
                                                                     "partials_per_segment_offset")]
    scoped += [ctx.new(f"{name}.num_of_partial_segments.tmp", INT64),
               ctx.new(f"{name}.partial_segment_offset.tmp", INT64 * partials),
               ctx.new(f"{name}.grad_weight_per_segment.tmp", B.FP32 * partials * h)]
    for x in reversed(kernel + scoped):
        ctx.free(x)
    for x in reversed(sort):
        ctx.free(x)
    return gw


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
