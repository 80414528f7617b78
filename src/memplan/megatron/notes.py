"""Which Megatron figures rest on reading Megatron-DeepSpeed's code and which on a megatron-core measurement."""

from __future__ import annotations

from pathlib import Path

from ..specs import Job
from .layer import attention_path
from .shape import uses_pipe_engine

#: committed megatron-core rows (benchmarks/megatron/rows-*.jsonl), looked for beside the package's repository
ROWS_DIR = Path(__file__).resolve().parents[3] / "benchmarks" / "megatron"


def _measured() -> bool:
    return any(ROWS_DIR.glob("rows-*.jsonl")) if ROWS_DIR.is_dir() else False


def measurement_notes(job: Job) -> tuple[str, ...]:
    """One line per figure of a megatron job that no committed measurement covers, or that a measurement of
    megatron-core (not Megatron-DeepSpeed) stands for."""
    t, lay, meg = job.training, job.layout, job.training.megatron
    measured = _measured()
    source = ("megatron-core 0.16.1 rows in benchmarks/megatron" if measured else
              "the megatron-core harness (benchmarks/megatron, no rows committed yet)")
    notes = [(f"Megatron's GPT layer terms are read from Megatron-DeepSpeed f4157bea and megatron-core 0.16.1; "
             f"measured by {source}")]
    if meg.codebase == "megatron-deepspeed":
        notes.append("Megatron-DeepSpeed itself is not measured (it needs apex): its apex memory-efficient "
                     "LayerNorm, fused softmax kernel, DistributedAttention and PipelineEngine buffers are read "
                     "from its code; megatron-core's torch LayerNorm and softmax fallback are what the rows measure")
    if attention_path(job.model, job) == "flash":
        notes.append("flash attention is measured through torch's FlashAttention kernel laid out as "
                     "FlashSelfAttention lays out flash-attn's (the flash-attn package is not on the GPU machine)")
    if lay.sp > 1:
        notes.append("Ulysses (--ds-sequence-parallel-size) is modelled from DeepSpeed's DistributedAttention "
                     "and Megatron-DeepSpeed's code, not measured (megatron-core has no Ulysses)")
        if uses_pipe_engine(job):
            notes.append("GPTModelPipe's get_batch_pipe does not cut the sequence into sp shards (get_batch does): "
                         "under the pipeline engine each sp rank runs the whole sequence; pass "
                         "--no-pipeline-parallel as Megatron-DeepSpeed's Ulysses examples do")
    if meg.deepspeed_activation_checkpointing and t.checkpointing == "full":
        notes.append("DeepSpeed activation checkpointing (partition / CPU / contiguous) is modelled from "
                     "runtime/activation_checkpointing/checkpointing.py, not measured")
    if uses_pipe_engine(job):
        notes.append("GPTModelPipe under DeepSpeed's PipelineEngine: the fp32 logits in pipe_buffers and the "
                     "s×s bool attention masks of model_provider and get_batch_pipe are modelled, not measured")
    if lay.tp > 1 and not lay.tp_sequence_parallel:
        notes.append("tp without --sequence-parallel keeps the layernorm / dropout regions whole on every rank")
    notes.append("backward temporaries inside a layer are modelled from the kernels' allocations and held to "
                 "the harness's phase peaks only")
    return tuple(notes)
