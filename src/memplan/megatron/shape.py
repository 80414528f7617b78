"""The dimensions one rank sees in Megatron's GPT, resolved once per job.

Symbols (used in every term's detail): T tokens of this rank's micro-batch (micro · seq / sp, see
``tokens_per_rank``), h hidden, q = heads·head_dim, kv = kv_heads·head_dim, I the MLP width (ffn_hidden_size),
nh heads, t tensor-parallel size, r = t with --sequence-parallel (the layernorm / dropout regions hold T/t
tokens, Korthikanti et al. 2022 §4.2.2) and 1 without, S_in the sequence one attention call sees (seq; under
Ulysses the all-to-all gathers the sp shards), b bytes of the training dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..specs import Job, ModelSpec
from ..units import dtype_bytes


@dataclass(frozen=True, slots=True)
class Shape:
    """One rank's dimensions (integers; bytes per element in ``b``)."""

    b: int
    h: int
    q: int
    kv: int
    nh: int
    ffn: int
    tp: int
    r: int  # tp with Megatron's --sequence-parallel, else 1
    sp: int
    micro: int
    tokens: int  # T
    seq_in: int  # S_in
    gated: bool
    rope: bool
    rmsnorm: bool
    bias: bool
    vocab: int  # padded vocabulary (all tp ranks together)


def padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary (megatron/tokenizer/tokenizer.py _vocab_size_with_padding): a multiple of
    make_vocab_size_divisible_by · tp."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def uses_pipe_engine(job: Job) -> bool:
    """Whether pretrain_gpt.py builds GPTModelPipe under DeepSpeed's PipelineEngine (--deepspeed without
    --no-pipeline-parallel, model_provider) rather than GPTModel."""
    meg = job.training.megatron
    return meg.codebase == "megatron-deepspeed" and meg.pipeline_engine


def tokens_per_rank(job: Job) -> int:
    """T: tokens of one micro-batch on this rank. pretrain_gpt.py get_batch cuts the sequence into sp shards
    (sub_seq_start / sub_seq_end) for Ulysses; get_batch_pipe, the batch function of GPTModelPipe, does not, so
    under the pipeline engine every sp rank runs the whole sequence (Megatron-DeepSpeed's own Ulysses examples
    pass --no-pipeline-parallel)."""
    t, lay = job.training, job.layout
    if lay.sp > 1 and uses_pipe_engine(job):
        return t.micro_batch * t.seq_len
    return t.micro_batch * t.seq_len // lay.sp


def resolve(model: ModelSpec, job: Job) -> Shape:
    """The dimensions of ``job`` on its most loaded rank."""
    t, lay = job.training, job.layout
    tokens = tokens_per_rank(job)
    return Shape(
        b=dtype_bytes(t.dtype), h=model.hidden_size, q=model.q_dim, kv=model.kv_dim, nh=model.num_heads,
        ffn=model.intermediate_size, tp=lay.tp, r=lay.tp if lay.tp_sequence_parallel else 1, sp=lay.sp,
        micro=t.micro_batch, tokens=tokens, seq_in=tokens // t.micro_batch * lay.sp, gated=model.gated_mlp,
        rope=model.position_embedding == "rope", rmsnorm=model.norm == "rmsnorm",
        bias=model.attention_bias or model.mlp_bias,
        vocab=padded_vocab(model.vocab_size, lay.tp, t.megatron.make_vocab_size_divisible_by),
    )


def split(nbytes: int, parts: int) -> int:
    """Bytes per token of a region split over ``parts`` ranks (rounded up: LayerNorm stats 8/t at t = 16)."""
    return -(-nbytes // parts)
