"""Frozen input specs: the model, the training setup and the parallel layout.

Everything the estimator reads is here, validated once. Errors name the field and show the arithmetic.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .modelspec import Family, LayerType, ModelSpec  # noqa: F401 - the model spec lives in its own module

TrainDtype = Literal["bf16", "fp16", "fp32"]
Checkpointing = Literal["none", "selective", "full"]
Attention = Literal["flash", "sdpa", "eager"]
OffloadDevice = Literal["none", "cpu", "nvme"]
Optimizer = Literal["adamw", "torch_adamw", "torch_adamw_fused", "cpu_adam", "sgd", "lion"]
#: the training loop around the engine (what the Python code keeps alive between calls):
#: outputs — DeepSpeed's tutorial loop, ``outputs = engine(...); engine.backward(outputs.loss); engine.step()``;
#: loss — only the loss survives the forward, ``loss = engine(...).loss``;
#: hf-trainer — transformers' Trainer with --deepspeed (training_step / compute_loss keep only the loss)
Loop = Literal["outputs", "loss", "hf-trainer"]
#: full backward hooks (``register_full_backward_hook``) on every decoder layer, which keep each layer's output
#: gradient alive through its backward (estimator/layer_hooks.py): none; first — during the first micro-step only
#: (the timeline markers of memplan verify before session 25); every — in every micro-step (a profiler's hooks)
LayerBackwardHooks = Literal["none", "first", "every"]
#: which code builds the model: transformers' modeling_<family>.py, or Megatron's GPT (megatron-core layers)
ModelImpl = Literal["transformers", "megatron"]
#: peft's LoraConfig.bias
LoraBias = Literal["none", "all", "lora_only"]


#: parameter groups --freeze takes by name (layers:N, the first N transformer layers, besides)
FREEZE_GROUPS = ("embeddings", "lm_head", "norms")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ZeroSpec(_Frozen):
    """DeepSpeed zero_optimization, with DeepSpeed 0.19.8's defaults (runtime/zero/config.py)."""

    stage: Literal[0, 1, 2, 3] = 0
    reduce_bucket_size: int = Field(500_000_000, gt=0)
    allgather_bucket_size: int = Field(500_000_000, gt=0)
    overlap_comm: bool | None = Field(None, description="None: True for stage 3, False for 1/2")
    contiguous_gradients: bool = True
    stage3_prefetch_bucket_size: int = Field(50_000_000, ge=0)
    stage3_param_persistence_threshold: int = Field(100_000, ge=0)
    stage3_max_live_parameters: int = Field(1_000_000_000, ge=0)
    stage3_max_reuse_distance: int = Field(1_000_000_000, ge=0)
    sub_group_size: int = Field(1_000_000_000, gt=0)
    offload_optimizer: OffloadDevice = "none"
    offload_param: OffloadDevice = "none"
    pin_memory: bool = True

    @model_validator(mode="after")
    def _check(self) -> ZeroSpec:
        if self.offload_param != "none" and self.stage != 3:
            raise ValueError(f"offload_param needs ZeRO stage 3 (stage is {self.stage})")
        if self.offload_optimizer != "none" and self.stage == 0:
            raise ValueError("offload_optimizer needs ZeRO stage 1, 2 or 3 (stage is 0)")
        return self

    @property
    def overlap(self) -> bool:
        """overlap_comm as DeepSpeed resolves it (DeepSpeedZeroConfig: stage 3 → True)."""
        return self.overlap_comm if self.overlap_comm is not None else self.stage == 3


class LoraSpec(_Frozen):
    """LoRA adapters as peft 0.x builds them (peft/tuners/lora: LoraConfig, LoraModel, Linear): a frozen base,
    per adapted linear an A (r × in) and a B (out × r) parameter, optional dropout on the adapter's input."""

    rank: int = Field(gt=0, le=2**16, description="LoraConfig.r")
    alpha: float = Field(8.0, gt=0, description="LoraConfig.lora_alpha (no effect on memory)")
    targets: tuple[str, ...] = Field(min_length=1, description="module names (q_proj, v_proj, …) or all-linear")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoraConfig.lora_dropout")
    bias: LoraBias = "none"
    modules_to_save: tuple[str, ...] = Field((), description="modules trained in full beside the adapters")
    use_rslora: bool = Field(False, description="rank-stabilised scaling (no effect on memory)")
    use_dora: bool = Field(False, description="weight-decomposed LoRA: a magnitude vector per adapted linear")


class AllocatorSpec(_Frozen):
    """PYTORCH_CUDA_ALLOC_CONF options the caching allocator honours (c10/cuda/CUDAAllocatorConfig.cpp)."""

    expandable_segments: bool = False
    max_split_size_mb: int | None = Field(None, gt=20, description="blocks above this are never split")
    roundup_power2_divisions: int | None = Field(None, gt=0)
    garbage_collection_threshold: float | None = Field(None, gt=0, lt=1)

    def alloc_conf(self) -> str:
        """The PYTORCH_CUDA_ALLOC_CONF string for these settings ('' for the defaults)."""
        parts = []
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.max_split_size_mb is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size_mb}")
        if self.roundup_power2_divisions is not None:
            parts.append(f"roundup_power2_divisions:{self.roundup_power2_divisions}")
        if self.garbage_collection_threshold is not None:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold}")
        return ",".join(parts)


class MegatronSpec(_Frozen):
    """The Megatron flags that change activation memory (``model_impl="megatron"``). Field names follow
    Megatron-DeepSpeed's megatron/arguments.py (microsoft/Megatron-DeepSpeed f4157bea); recompute granularity
    is the job's ``checkpointing`` (none; selective = --recompute-granularity selective / --recompute-activations;
    full = --checkpoint-activations or --recompute-granularity full); flash is the job's ``attention`` "flash"
    (eager and sdpa both mean Megatron's unfused CoreAttention)."""

    codebase: Literal["megatron-deepspeed", "megatron-core"] = Field(
        "megatron-deepspeed", description="megatron-deepspeed: Megatron-DeepSpeed's GPT (pretrain_gpt.py); "
        "megatron-core: megatron-core 0.16.1's GPTModel with the local layer spec, as memplan's harness builds it")
    flash_variant: Literal["v1", "v2", "triton", "builder"] = Field(
        "v2", description="--use-flash-attn(-v1) / -v2 / -triton / -builder, when attention is flash")
    recompute_method: Literal["uniform", "block"] = Field("uniform", description="--recompute-method (full only)")
    recompute_num_layers: int = Field(1, gt=0, description="--recompute-num-layers / --checkpoint-num-layers")
    distribute_saved_activations: bool = Field(False, description="--distribute-saved-activations (tp > 1)")
    masked_softmax_fusion: bool = Field(True, description="False: --no-masked-softmax-fusion")
    bias_gelu_fusion: bool = Field(True, description="False: --no-bias-gelu-fusion")
    bias_dropout_fusion: bool = Field(True, description="False: --no-bias-dropout-fusion")
    attention_softmax_in_fp32: bool = Field(
        True, description="softmax in fp32 on the unfused path (Megatron-DeepSpeed: on unless "
        "--no-query-key-layer-scaling without --attention-softmax-in-fp32)")
    hidden_dropout: float = Field(0.1, ge=0, lt=1, description="--hidden-dropout")
    attention_dropout: float = Field(0.1, ge=0, lt=1, description="--attention-dropout")
    deepspeed_activation_checkpointing: bool = Field(False, description="--deepspeed-activation-checkpointing")
    partition_activations: bool = Field(False, description="--partition-activations (DeepSpeed checkpointing)")
    contigious_checkpointing: bool = Field(False, description="--contigious-checkpointing (Megatron's spelling)")
    checkpoint_in_cpu: bool = Field(False, description="--checkpoint-in-cpu (DeepSpeed checkpointing)")
    pipeline_engine: bool = Field(
        True, description="GPTModelPipe under DeepSpeed's PipelineEngine (False: --no-pipeline-parallel)")
    make_vocab_size_divisible_by: int = Field(128, gt=0, description="--make-vocab-size-divisible-by")
    mem_efficient_ln: bool = Field(
        True, description="apex's memory-efficient LayerNorm saves its output, not its input (False: "
        "--disable-mem-efficient-ln; megatron-core's local spec uses torch.nn.LayerNorm, which saves the input)")

    @model_validator(mode="after")
    def _check(self) -> MegatronSpec:
        deepspeed_only = [f for f in ("deepspeed_activation_checkpointing", "partition_activations",
                                      "contigious_checkpointing", "checkpoint_in_cpu") if getattr(self, f)]
        if self.codebase == "megatron-core" and deepspeed_only:
            raise ValueError(f"megatron {deepspeed_only[0]} is DeepSpeed activation checkpointing, which "
                             "megatron-core does not have; allowed: codebase megatron-deepspeed")
        if (self.partition_activations or self.checkpoint_in_cpu or self.contigious_checkpointing) and not \
                self.deepspeed_activation_checkpointing:
            raise ValueError("megatron partition_activations / checkpoint_in_cpu / contigious_checkpointing need "
                             "--deepspeed-activation-checkpointing (megatron/initialize.py configures DeepSpeed's "
                             "checkpointing only then)")
        return self


class TrainingSpec(_Frozen):
    """What one rank does per step: tokens, dtype, checkpointing, attention, optimizer, ZeRO."""

    seq_len: int = Field(gt=0, description="tokens per sequence (before Ulysses splits it)")
    micro_batch: int = Field(1, gt=0, description="sequences per rank per micro-step")
    grad_accum: int = Field(1, gt=0, description="micro-steps per optimizer step")
    dtype: TrainDtype = "bf16"
    checkpointing: Checkpointing = "none"
    attention: Attention = "sdpa"
    optimizer: Optimizer = "adamw"
    zero: ZeroSpec = ZeroSpec()
    grad_accum_dtype: TrainDtype | None = Field(None, description="data_types.grad_accum_dtype; None: the training dtype")
    sp_comm_dtype: TrainDtype = Field("fp32", description="seq_parallel_communication_data_type (used when sp > 1)")
    loop: Loop = Field("outputs", description="the training loop: outputs, loss or hf-trainer (see Loop)")
    checkpoint_reentrant: bool = Field(
        False, description="torch.utils.checkpoint use_reentrant (transformers' gradient_checkpointing_enable "
        "defaults to False)")
    checkpoint_every_n_layers: int = Field(1, gt=0, description="transformers 5.17: checkpoint every n-th layer only")
    checkpoint_offload: bool = Field(False, description="transformers 5.17: checkpointed inputs in pinned host memory")
    lora: LoraSpec | None = Field(None, description="LoRA adapters on a frozen base (None: full training)")
    freeze: tuple[str, ...] = Field((), description="frozen parameter groups without adapters: embeddings, "
                                    "lm_head, norms, layers:N (the first N layers)")
    allocator: AllocatorSpec = AllocatorSpec()
    layer_backward_hooks: LayerBackwardHooks = Field(
        "none", description="full backward hooks on every decoder layer: none, first (first micro-step) or every")
    model_impl: ModelImpl = Field("transformers", description="which code builds the model")
    megatron: MegatronSpec = Field(MegatronSpec(), description="Megatron's memory flags (model_impl megatron)")

    @model_validator(mode="after")
    def _check_megatron(self) -> TrainingSpec:
        if self.model_impl != "megatron":
            return self
        if self.lora is not None or self.freeze:
            raise ValueError("model_impl megatron trains every parameter (Megatron-DeepSpeed has no LoRA or "
                             "frozen groups); allowed: no --lora-*/--peft-config/--freeze")
        if self.loop == "hf-trainer":
            raise ValueError("model_impl megatron runs Megatron's own training loop; allowed: --loop outputs or loss")
        return self

    def layer_hooks_in(self, micro: int) -> bool:
        """Whether the forward of micro-step ``micro`` (counted from 0 over all optimizer steps) runs with the
        layer_backward_hooks."""
        return self.layer_backward_hooks == "every" or (self.layer_backward_hooks == "first" and micro == 0)

    @model_validator(mode="after")
    def _check_layer_hooks(self) -> TrainingSpec:
        if self.layer_backward_hooks != "none" and (self.checkpointing != "none" or self.model_impl != "transformers"):
            raise ValueError("layer_backward_hooks is modelled on transformers' layers without checkpointing (a "
                             "checkpointed layer's hooks run again in its recompute); allowed: layer_backward_hooks "
                             "none, or checkpointing none with model_impl transformers")
        return self

    @model_validator(mode="after")
    def _check_freeze(self) -> TrainingSpec:
        for item in self.freeze:
            if item in FREEZE_GROUPS:
                continue
            head, _, count = item.partition(":")
            if head != "layers" or not count.isdigit() or int(count) < 1:
                raise ValueError(f"freeze item {item!r} is not known; allowed: {', '.join(FREEZE_GROUPS)}, layers:N")
        return self


class Layout(_Frozen):
    """The parallel layout, resolved once: world = dp · tp · pp · sp."""

    world: int = Field(1, gt=0, description="--gpus: all ranks")
    gpus_per_node: int = Field(8, gt=0)
    tp: int = Field(1, gt=0)
    pp: int = Field(1, gt=0)
    sp: int = Field(1, gt=0)
    tp_sequence_parallel: bool = Field(
        False, description="Megatron-style sequence parallelism with tp (Korthikanti et al. 2022): the "
        "activations outside attention and MLP are split over the tp ranks too")

    @model_validator(mode="after")
    def _check(self) -> Layout:
        inner = self.tp * self.pp * self.sp
        if self.tp_sequence_parallel and self.tp == 1:
            raise ValueError("tp_sequence_parallel needs tp > 1 (it splits tp's replicated activations)")
        if self.world % inner:
            raise ValueError(
                f"gpus ({self.world}) must be divisible by tp·pp·sp ({self.tp}·{self.pp}·{self.sp} = {inner})"
            )
        return self

    @property
    def dp(self) -> int:
        """Data-parallel size: world / (tp·pp·sp)."""
        return self.world // (self.tp * self.pp * self.sp)

    @property
    def zero_group(self) -> int:
        """ZeRO partition group size N: dp·sp (DeepSpeed partitions over the sequence-data-parallel group)."""
        return self.dp * self.sp

    @property
    def nodes(self) -> int:
        """Nodes used: ceil(world / gpus_per_node)."""
        return -(-self.world // self.gpus_per_node)


class Job(_Frozen):
    """One training job: what `estimate` and `verify` take."""

    model: ModelSpec
    training: TrainingSpec
    layout: Layout = Layout()

    @model_validator(mode="after")
    def _check(self) -> Job:
        m, t, lay = self.model, self.training, self.layout
        if lay.sp > 1:
            if t.seq_len % lay.sp:
                raise ValueError(f"seq ({t.seq_len}) must be divisible by sp ({lay.sp})")
            if m.num_heads % (lay.sp * lay.tp):
                raise ValueError(
                    f"num_attention_heads ({m.num_heads}) must be divisible by tp·sp ({lay.tp}·{lay.sp})"
                )
            kv = m.num_kv_heads
            if t.model_impl == "megatron" and kv < lay.sp:
                raise ValueError(
                    f"num_key_value_heads ({kv}) must be at least sp ({lay.sp}) (DeepSpeed's DistributedAttention, "
                    "sequence/layer.py _resolve_kv_heads asserts it)"
                )
            if t.model_impl != "megatron" and t.attention == "eager":
                raise ValueError(
                    f"attention eager with Ulysses sp ({lay.sp}): DeepSpeed's UlyssesSPAttentionHF."
                    "register_with_transformers refuses attn_implementation eager; allowed: sdpa or flash"
                )
            if t.model_impl != "megatron" and kv % lay.sp and lay.sp % kv:
                raise ValueError(
                    f"num_key_value_heads ({kv}) and sp ({lay.sp}): one must divide the other (DeepSpeed's "
                    "UlyssesSPAttentionHF splits the kv heads over the sp ranks, or replicates them when sp is a "
                    "multiple of their count)"
                )
        if t.layer_backward_hooks != "none" and lay.pp > 1:
            raise ValueError("layer_backward_hooks with pp > 1: the pipeline's layers are not modelled with them; "
                             "allowed: layer_backward_hooks none, or pp 1")
        if lay.tp > 1 and m.num_heads % lay.tp:
            raise ValueError(f"num_attention_heads ({m.num_heads}) must be divisible by tp ({lay.tp})")
        if lay.tp > 1 and m.num_kv_heads % lay.tp:
            raise ValueError(f"num_key_value_heads ({m.num_kv_heads}) must be divisible by tp ({lay.tp})")
        if m.position_embedding == "learned" and t.seq_len > m.max_position_embeddings:
            raise ValueError(
                f"seq ({t.seq_len}) exceeds the learned position table of {m.family} "
                f"(n_positions {m.max_position_embeddings}): the embedding lookup would index out of range; "
                f"allowed: seq <= {m.max_position_embeddings}"
            )
        if t.attention == "flash" and (t.dtype == "fp32" or m.head_dim > 256 or m.head_dim % 8):
            raise ValueError(
                f"attention flash needs bf16 or fp16 and head_dim <= 256, a multiple of 8 (dtype {t.dtype}, "
                f"head_dim {m.head_dim}; torch's FlashAttention kernel, sdp_utils check_flash_attention_*); "
                "allowed: sdpa or eager"
            )
        if t.zero.stage == 0 and t.grad_accum_dtype not in (None, t.dtype):
            raise ValueError(
                f"ZeRO stage 0 cannot accumulate {t.dtype} gradients in {t.grad_accum_dtype} "
                "(data_types.grad_accum_dtype; DeepSpeed's engine raises 'unsupported mix of model_dtype and "
                "grad_accum_dtype'); allowed: stage 1, 2 or 3, or grad_accum_dtype equal to the training dtype"
            )
        if lay.pp > 1 and m.num_layers < lay.pp:
            raise ValueError(f"num_layers ({m.num_layers}) must be at least pp ({lay.pp})")
        if lay.pp > 1 and t.zero.stage >= 2:
            raise ValueError(
                f"ZeRO stage {t.zero.stage} is incompatible with pipeline parallelism (pp={lay.pp}); use stage 0 or 1"
            )
        if lay.sp > 1 and (lay.tp > 1 or lay.pp > 1):
            raise ValueError(
                f"Ulysses sp ({lay.sp}) does not combine with tp ({lay.tp}) or pp ({lay.pp}) in DeepSpeed"
            )
        return self

    @property
    def tokens_per_rank(self) -> int:
        """Tokens one rank holds outside attention per micro-step: micro_batch · seq / sp."""
        return self.training.micro_batch * self.training.seq_len // self.layout.sp
