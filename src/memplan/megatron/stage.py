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
from .layer import SELECTIVE_DROPPED, attention_path, layer_input_bytes_per_token, layer_terms, selective_terms
from .outside import buffers, outside_terms
from .shape import resolve, uses_pipe_engine


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
    return StageActivations(
        layer_full=full, layer_saved=saved, saved_layers=kept, recompute=recompute,
        outside=_sum(outside_terms(model, job, first, last)) * tokens,
        buffers=sum(b.bytes for b in buffers(model, job, in_flight)),
        backward_transient=backward_transient_per_token(model, job) * tokens)


def backward_transient_per_token(model: ModelSpec, job: Job) -> int:
    """The largest set of gradient temporaries inside one layer's backward, above what the layer saved
    (modelled from the code, to be held to the harness's phase peaks).

    MLP: the grad of dense_4h_to_h's input and bias_gelu_back's output [T, I/t] with the grads of the layer's
    input and output [T/r, h]. Flash: dq, dk, dv, the grad of out, FlashAttention-2's fp32 dq accumulator, and
    the grad of the fused projection the slices' backward fills. Unfused softmax (fp32): the fp32 grad and
    _softmax_backward_data's fp32 output beside the saved fp32 output, once the 16-bit probabilities are freed;
    fused kernel: the grad of the probabilities (the kernel's backward writes in place)."""
    s = resolve(model, job)
    meg = job.training.megatron
    b, t = s.b, s.tp
    mlp = b * (2 * s.ffn // t + 2 * s.h // s.r)
    path = attention_path(model, job)
    if path == "flash":
        attn = b * (4 * s.q // t + (s.q + 2 * s.kv) // t) + 4 * s.q // t
    else:
        elems = s.nh * s.seq_in // t
        if path == "fused-softmax":
            per = b
        elif meg.attention_softmax_in_fp32 and b != 4:
            per = 8 - b - (1 if meg.attention_dropout > 0 else 0)
        else:
            per = 2 * b
        attn = per * elems + b * (s.q + 2 * s.kv) // t
        if job.training.checkpointing == "selective":  # the recomputed score tensors are alive again
            attn += sum(x.bytes_per_token for x in layer_terms(model, job) if x.name in SELECTIVE_DROPPED)
    return max(mlp, attn)
