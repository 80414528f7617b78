"""What a command asks for and what it gets back, for memplan.resolve: the job flags as given (JobRequest), where
each value came from (Source), the resolved job (ResolvedJob), and the article's job these fall back on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from .specs import (Attention, Checkpointing, LayerBackwardHooks, Loop, ModelImpl, OffloadDevice, Optimizer,
                    TrainDtype)

#: the article's model preset (176b_config.json), sequence length, launch (launch.sh: --num_nodes 1
#: --num_gpus 8) and GPU (the article's 8×A100-80GB)
ARTICLE_MODEL = "176b"
ARTICLE_SEQ = 32768
ARTICLE_GPUS = 8
ARTICLE_GPU = "a100-80g"
ARTICLE = "the article (examples/seed-176b)"

#: Job fields of the article's job when no file describes it: ds_config_ulysses.json (zero_optimization, fp16,
#: train_micro_batch_size_per_gpu) and 176b_config.json (sequence_parallel_size)
ARTICLE_FIELDS: dict[str, Any] = {
    "micro_batch": 1, "grad_accum": 1, "dtype": "fp16", "sp": 8,
    "zero": {
        "stage": 3, "contiguous_gradients": True, "stage3_max_live_parameters": 1_000_000_000,
        "stage3_max_reuse_distance": 1_000_000_000, "stage3_prefetch_bucket_size": 500_000_000,
        "stage3_param_persistence_threshold": 1_000_000, "reduce_bucket_size": 100_000_000,
        "sub_group_size": 1_000_000_000, "offload_optimizer": "cpu", "pin_memory": True,
    },
}
#: the neutral sequence length: min(NEUTRAL_SEQ, the model's max_position_embeddings)
NEUTRAL_SEQ = 4096

SourceKind = Literal["article", "deepspeed", "memplan", "file", "flag", "derived"]


class JobRequest(BaseModel):
    """The job flags as given (None: not given), and the files and launch line that describe the job."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    model: str | None = None
    seq: int | None = None
    micro_batch: int | None = None
    grad_accum: int | None = None
    gpus: int | None = None
    gpus_per_node: int | None = None
    nodes: int | None = None
    tp: int | None = None
    pp: int | None = None
    sp: int | None = None
    tp_sequence_parallel: bool | None = None
    zero: Literal[0, 1, 2, 3] | None = None
    offload_optimizer: OffloadDevice | None = None
    offload_param: OffloadDevice | None = None
    dtype: TrainDtype | None = None
    checkpointing: Checkpointing | None = None
    attention: Attention | None = None
    optimizer: Optimizer | None = None
    loop: Loop | None = None
    model_impl: ModelImpl | None = None
    layer_backward_hooks: LayerBackwardHooks | None = None
    ds_config: str | None = None
    training_args: str | None = None
    alloc_conf: str | None = None
    lora_rank: int | None = None
    lora_targets: str | None = None
    lora_dropout: float | None = None
    peft_config: str | None = None
    freeze: str | None = None
    gpu: str | None = None
    launch: Any = None  # a memplan.check.launch.Launch (its values are laid over --ds-config)


class Source(BaseModel):
    """Where one value of the job came from: ``source`` is the kind, ``origin`` names the flag, file key or
    rule."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    field: str
    value: Any
    source: SourceKind
    origin: str


@dataclass(frozen=True)
class ResolvedJob:
    """The validated Job, where each value came from, the GPU the defaults assumed, and the Trainer's reading."""

    job: Any  # memplan.specs.Job
    sources: tuple[Source, ...]
    gpu: Any = None  # memplan.gpus.GpuSpec or None
    trainer: Any = None  # memplan.hf.job.TrainerJob or None


def is_article(model: str | None) -> bool:
    """Whether --model names the article's model (or is left out)."""
    return model is None or model.strip() == ARTICLE_MODEL
