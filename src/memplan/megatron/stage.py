"""One pipeline stage's activations under Megatron's recompute flags, and the backward's temporaries.

Full recompute: Megatron-DeepSpeed's GPTModelPipe hands DeepSpeed's PipelineModule
activation_checkpoint_interval = --checkpoint-num-layers (with --checkpoint-activations) or
--recompute-num-layers (with --recompute-granularity full --recompute-method uniform), else 0 ("deepspeed's
pipeline doesn't support the block recompute method", gpt_model.py); GPTModel's ParallelTransformer and
megatron-core's TransformerBlock._checkpointed_forward: uniform checkpoints chunks of recompute_num_layers
layers, block checkpoints the first recompute_num_layers layers one by one. A checkpointed chunk keeps its
input (tensor_parallel.checkpoint / deepspeed.checkpointing.checkpoint) and, in backward, holds every layer of
the chunk again while it is recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..specs import Job, ModelSpec
from .layer import (
    attention_path,
    before_scores_bytes_per_token,
    layer_input_bytes_per_token,
    layer_terms,
    score_peak_bytes_per_token,
    selective_terms,
)
from .outside import buffers, outside_terms
from .shape import resolve, split, uses_pipe_engine


@dataclass(frozen=True, slots=True)
class StageActivations:
    """Activation bytes of one micro-batch on one stage (T tokens), and what backward adds."""

    layer_full: int  # one layer without recompute
    layer_saved: int  # one layer as configured (selective drops the core attention's score tensors)
    saved_layers: int  # every layer of the stage at the end of forward
    recompute: int  # a recomputed chunk during its backward (0 without full recompute)
    outside: int  # outside_terms of this stage
    buffers: int  # global memory buffer and masks
    backward_transient: int  # gradient temporaries inside one layer's backward
    #: activations alive at CoreAttention's forward / backward peak in the stage's last layer (0 on the flash
    #: path, whose peaks are the loss's and the MLP's)
    forward_layer_peak: int = 0
    backward_layer_peak: int = 0


def _sum(terms) -> int:
    return sum(t.bytes_per_token for t in terms)


def recompute_plan(job: Job, layers: int) -> tuple[int, int]:
    """(checkpointed chunks, layers per recomputed chunk); (0, 0) when nothing is recomputed."""
    t, meg = job.training, job.training.megatron
    if t.checkpointing != "full":
        return 0, 0
    n = min(meg.recompute_num_layers, layers)
    if meg.recompute_method == "block":
        return (0, 0) if uses_pipe_engine(job) else (n, 1)
    return -(-layers // n), n


def stage_activations(model: ModelSpec, job: Job, layers: int, first: bool = True,
                      last: bool = True, in_flight: int = 1) -> StageActivations:
    """What a stage holding ``layers`` layers keeps for one micro-batch."""
    tokens = resolve(model, job).tokens
    full = _sum(layer_terms(model, job)) * tokens
    saved = _sum(selective_terms(model, job)) * tokens if job.training.checkpointing == "selective" else full
    chunks, per_chunk = recompute_plan(job, layers)
    if chunks and job.training.megatron.recompute_method == "block" and not uses_pipe_engine(job):
        kept = chunks * layer_input_bytes_per_token(model, job) * tokens + (layers - chunks) * full
        recompute = full
    elif chunks:
        kept = chunks * layer_input_bytes_per_token(model, job) * tokens
        recompute = per_chunk * full
    else:
        kept, recompute = layers * saved, 0
    fwd_peak, bwd_peak = _score_peaks(model, job, layers, first, saved, kept, per_chunk, full)
    return StageActivations(
        layer_full=full, layer_saved=saved, saved_layers=kept, recompute=recompute,
        outside=_sum(outside_terms(model, job, first, last)) * tokens,
        buffers=sum(b.bytes for b in buffers(model, job, in_flight)),
        backward_transient=backward_transient_per_token(model, job) * tokens,
        forward_layer_peak=fwd_peak, backward_layer_peak=bwd_peak)


def _score_peaks(model: ModelSpec, job: Job, layers: int, first: bool, saved: int, kept: int, per_chunk: int,
                 full: int) -> tuple[int, int]:
    """(forward, backward) activations at CoreAttention's peaks in the stage's last layer (layer.py
    score_peak_bytes_per_token): the other layers as kept (a recomputed chunk: its inputs, and in backward the
    chunk's earlier layers again), the embedding side's tensors, what the layer saved before the score matmul,
    the score-sized tensors; in backward also the grads waiting beside them (bmm's grad of v until the qkv
    split's backward has all three, and the residual stream's grads [T/r, h])."""
    fwd_scores, bwd_scores = score_peak_bytes_per_token(model, job)
    if not fwd_scores or layers < 1:
        return 0, 0
    s = resolve(model, job)
    tokens = s.tokens
    terms = selective_terms(model, job) if job.training.checkpointing == "selective" else layer_terms(model, job)
    before = before_scores_bytes_per_token(terms) * tokens
    pre = _sum(outside_terms(model, job, first, False)) * tokens
    others_fwd = kept if per_chunk else (layers - 1) * saved
    others_bwd = kept + (per_chunk - 1) * full if per_chunk else (layers - 1) * saved
    grads = (s.b * (s.q + 2 * s.kv) // s.tp + 2 * split(s.b * s.h, s.r)) * tokens
    return (others_fwd + pre + before + fwd_scores * tokens,
            others_bwd + pre + before + bwd_scores * tokens + grads)


def backward_transient_per_token(model: ModelSpec, job: Job) -> int:
    """The largest set of gradient temporaries inside one layer's backward, above what the layer saved.

    MLP: the grad of dense_4h_to_h's input and bias_gelu_back's output [T, I/t] with the grads of the layer's
    input and output [T/r, h]. Flash: dq, dk, dv, the grad of out, FlashAttention-2's fp32 dq accumulator, and
    the grad of the fused projection the slices' backward fills. CoreAttention's score-sized grads are not
    here: they are counted with the tensors alive beside them (StageActivations.backward_layer_peak)."""
    s = resolve(model, job)
    b, t = s.b, s.tp
    mlp = b * (2 * s.ffn // t + 2 * s.h // s.r)
    if attention_path(model, job) != "flash":
        return mlp
    return max(mlp, b * (4 * s.q // t + (s.q + 2 * s.kv) // t) + 4 * s.q // t)
