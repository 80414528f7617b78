"""Outside the layers: the batch, embeddings, final norm, logits and the vocabulary-parallel loss, and the
buffers that do not scale with tokens (the global memory buffer, the attention masks).

Megatron-DeepSpeed f4157bea: pretrain_gpt.py (model_provider, get_batch, get_batch_pipe), megatron/utils.py
get_ltor_masks_and_position_ids, megatron/model/gpt_model.py (GPTModelPipe, CrossEntropy,
post_language_model_processing), megatron/model/language_model.py (Embedding, parallel_lm_logits),
megatron/core/tensor_parallel/cross_entropy.py _VocabParallelCrossEntropy, megatron/core/sequence_parallel/
cross_entropy.py _VocabSequenceParallelCrossEntropy, megatron/core/utils.py GlobalMemoryBuffer; DeepSpeed
runtime/pipe/engine.py (pipe_buffers) and schedule.py (TrainSchedule.num_pipe_buffers). megatron-core 0.16.1:
models/gpt/gpt_model.py, common/language_module compute_language_model_loss, tensor_parallel/cross_entropy.py.
Symbols in shape.py; V the padded vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..estimator.activations import DROPOUT_MASK_BYTES, Term
from ..specs import Job, ModelSpec
from .layer import _norm, attention_path
from .shape import Shape, resolve, split, uses_pipe_engine

#: DeepSpeed's TrainSchedule.num_pipe_buffers is at least 2; a last stage's outputs stay in them
PIPE_BUFFERS_MIN = 2


@dataclass(frozen=True, slots=True)
class Buffer:
    """A tensor whose size does not follow the tokens: bytes, and the code that allocates it."""

    name: str
    bytes: int
    detail: str


def pipe_logits_buffers(job: Job) -> int:
    """fp32 logits a last pipeline stage keeps in pipe_buffers['outputs'] (one per micro-batch, at most the
    buffer count); 0 without the pipeline engine."""
    if not uses_pipe_engine(job):
        return 0
    return min(max(PIPE_BUFFERS_MIN, job.layout.pp), job.training.grad_accum)


def outside_terms(model: ModelSpec, job: Job, first: bool = True, last: bool = True) -> tuple[Term, ...]:
    """Per token of this rank: what the embedding stage (``first``) and the head stage (``last``) keep until
    backward reaches them."""
    s = resolve(model, job)
    meg = job.training.megatron
    terms: list[Term] = []
    if first:
        terms += [Term("batch.tokens", 8, "input ids int64 (pipe_buffers['inputs'] / the embedding's indices)"),
                  Term("batch.position_ids", split(8, s.micro), "arange(s) int64, expanded over the batch")]
        if s.tp > 1:  # VocabParallelEmbedding.forward: masked_input = input_.clone() - start; [input_mask] = 0
            terms += [Term("embedding.masked_input", 8, "input_.clone() - vocab_start_index int64 [T]"),
                      Term("embedding.input_mask", 1, "bool [T] (output_parallel[input_mask, :] = 0.0)")]
        if meg.hidden_dropout > 0:
            terms.append(Term("embedding.dropout_mask", DROPOUT_MASK_BYTES * s.h // s.r, "bool [T/r, h]"))
    if last:
        mcore = meg.codebase == "megatron-core"
        if not mcore:  # the harness passes the input ids as labels (no second tensor)
            terms += [Term("batch.labels", 8, "labels int64 (tokens_[:, 1:].contiguous())"),
                      Term("batch.loss_mask", 4, "loss_mask fp32 (get_ltor_masks_and_position_ids)")]
        ln_input = mcore or not meg.mem_efficient_ln or s.rmsnorm
        terms += _norm(s, job, "final_layernorm", ln_input)
        terms.append(Term("lm_head.input", split(s.b * s.h, s.r), "final norm output [T/r, h] (logits' input)"))
        terms += _loss_saved(s, job)
    return tuple(terms)


def _loss_saved(s: Shape, job: Job) -> list[Term]:
    """The loss's saved tensors: _VocabParallelCrossEntropy saves exp_logits / sum (the softmax) fp32
    [T, V/t], target_mask bool and masked_target int64; under Ulysses (GPTModel with sp > 1),
    _VocabSequenceParallelCrossEntropy saves F.softmax fp32 [T, V] and the target. GPTModelPipe also keeps the
    fp32 logits (float16_to_fp32, its last layer) in the pipeline's output buffers."""
    v = s.vocab // s.tp
    if s.sp > 1 and not uses_pipe_engine(job):
        terms = [Term("loss.softmax", 4 * s.vocab, "F.softmax fp32 [T, V] (vocab_sequence_parallel_cross_entropy)")]
    else:
        terms = [Term("loss.softmax", 4 * v, "exp_logits / sum fp32 [T, V/t] (vocab-parallel)"),
                 Term("loss.target", 1 + 8, "target_mask bool, masked_target_1d int64 [T]")]
    n = pipe_logits_buffers(job)
    if n:
        terms.append(Term("pipe.logits_fp32", n * 4 * v, f"{n} × fp32 logits [T, V/t] in pipe_buffers['outputs']"))
    return terms


def loss_forward_transient_per_token(model: ModelSpec, job: Job) -> int:
    """Above the saved terms, at the loss in forward. Megatron-DeepSpeed GPTModel: the 16-bit logits, their
    .float() copy and ``logits - max`` (a new fp32 tensor); GPTModelPipe: the fp32 logits are a pipe buffer
    (saved), so only ``logits - max``; Ulysses: 16-bit logits, fp32 copy and softmax.log(). megatron-core:
    the 16-bit logits and the fp32 copy, shifted in place."""
    s = resolve(model, job)
    meg = job.training.megatron
    v = s.vocab // s.tp
    if meg.codebase == "megatron-core":
        return s.b * v
    if uses_pipe_engine(job):
        return 4 * v
    if s.sp > 1:
        return (s.b + 4 + 4) * s.vocab
    return (s.b + 4) * v


def loss_backward_transient_per_token(model: ModelSpec, job: Job) -> int:
    """Above the saved terms, after the loss's backward: the softmax becomes the gradient in place
    (grad_input = softmax), its cast back to the logits' dtype [T, V/t], and the grad of the head's input."""
    s = resolve(model, job)
    v = s.vocab if (s.sp > 1 and not uses_pipe_engine(job)) else s.vocab // s.tp
    return s.b * v + s.b * s.h


def buffers(model: ModelSpec, job: Job, in_flight: int = 1) -> tuple[Buffer, ...]:
    """Token-independent allocations that stay: the global memory buffer and the causal masks."""
    s = resolve(model, job)
    meg, t = job.training.megatron, job.training
    out = []
    elems = 0
    path = attention_path(model, job)
    if path != "flash":  # CoreAttention's baddbmm takes its (unused, beta=0) input from the buffer
        elems = s.micro * (s.nh // (s.tp * s.sp)) * s.seq_in * s.seq_in
    if s.r > 1:  # --sequence-parallel all-gathers each linear's input [T, h] into it
        elems = max(elems, s.tokens * s.h)
    if elems:
        out.append(Buffer("global_memory_buffer", s.b * elems, "parallel_state.get_global_memory_buffer() "
                          "('mpu'): the largest of [b·np, S_in, S_in] and the all-gathered [T, h]"))
    mask = t.seq_len * t.seq_len  # bool [1, 1, s, s]
    if meg.codebase == "megatron-core":
        if path != "flash":
            out.append(Buffer("attention_mask", mask, "bool [1, 1, s, s] the harness passes (Megatron-LM's "
                              "dataloader mask)"))
    elif uses_pipe_engine(job):
        out.append(Buffer("attention_mask.args", mask, "args.attn_mask bool [1, 1, s, s] (model_provider)"))
        out.append(Buffer("attention_mask.batches", in_flight * mask,
                          f"{in_flight} × get_batch_pipe's bool [1, 1, s, s] (built even with flash)"))
    elif path != "flash":
        out.append(Buffer("attention_mask.batches", in_flight * mask, "get_batch's bool [1, 1, s, s]"))
    return tuple(out)


def mask_build_transient_bytes(model: ModelSpec, job: Job) -> int:
    """get_ltor_masks_and_position_ids at batch load: torch.ones [1, s, s] fp32 and its tril, both fp32, before
    the bool conversion (Megatron-DeepSpeed; nothing for megatron-core or when the mask is skipped)."""
    meg, t = job.training.megatron, job.training
    if meg.codebase == "megatron-core":
        return 0
    if not uses_pipe_engine(job) and attention_path(model, job) == "flash":
        return 0
    return 2 * 4 * t.seq_len * t.seq_len
