"""The phases of one training step on the most loaded rank, each a list of parts alive at that moment.

A step after the first (optimizer states exist; ZeRO-3 has its trace and keeps reused parameters): forward
to the loss, backward from the loss down to layer 0, the optimizer step. With gradient accumulation the
later micro-steps also carry the gradients of the earlier ones. Parts are (name, bytes, detail) tuples;
estimator/__init__ turns them into typed results. Model states come from states.py, activations from
activations.py and head.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..specs import Job
from ..units import MiB, dtype_bytes
from . import activations as act
from . import head
from .layout import RankShare, rank_share
from .lora import saved_deltas
from .states import States, bf16_optimizer, fp32_accumulation, picks_bf16_optimizer, stage0, stage3, stage12
from .zero3_working_set import zero3_saved_experts, zero3_turn_gathered

Part = tuple  # (name, bytes, detail)

#: cuBLAS and cuBLASLt workspaces that torch serves from its caching allocator (torch/csrc/cuda/
#: CublasHandlePool.cpp): 32 MiB each on Hopper, taken at the first matmul and kept. Seen in every
#: measured run as 64 MiB that appears in the first step and never leaves.
CUBLAS_WORKSPACE_BYTES = 64 * MiB


def model_states(job: Job, share: RankShare, rank0: bool = False) -> States:
    """Resolve the ZeRO stage's state bytes for this rank (``rank0``: rank 0 instead of the most loaded).

    The stage's groups hold the trainable parameters (``share.params``); frozen ones stay model parameters
    in the training dtype beside them (_with_frozen)."""
    return _with_frozen(_trained_states(job, share, rank0), job, share)


def _with_frozen(st: States, job: Job, share: RankShare) -> States:
    """Add the frozen parameters, which no optimizer group holds: DeepSpeedZeroOptimizer builds bit16_groups
    from the params that require grad (stage_1_and_2.py __init__: trainable_parameters), FP16_Optimizer and
    BF16_Optimizer flatten the param groups deepspeed.initialize was given (the trainable ones), and ZeRO-3's
    zero.Init partitions every parameter while DeepSpeedZeroOptimizer_Stage3._get_trainable_parameter_groups
    keeps only the optimized ones (no fp32, gradient or optimizer partition for the rest)."""
    if not share.frozen:
        return st
    b = dtype_bytes(job.training.dtype)
    if job.training.zero.stage < 3:
        return replace(st, params_16bit=st.params_16bit + b * share.frozen)
    frozen = b * share.zero3_frozen_partition
    if job.training.zero.offload_param != "none":  # the partitions live in host memory
        return replace(st, host_bytes=st.host_bytes + frozen)
    return replace(st, params_16bit=st.params_16bit + frozen)


def _trained_states(job: Job, share: RankShare, rank0: bool) -> States:
    t, z, lay = job.training, job.training.zero, job.layout
    b = dtype_bytes(t.dtype)
    g = dtype_bytes(t.grad_accum_dtype or t.dtype)
    c = dtype_bytes(t.sp_comm_dtype) if lay.sp > 1 else b
    n = lay.zero_group
    if picks_bf16_optimizer(job):
        if z.stage == 0:
            return bf16_optimizer(share.params, lay.dp, t.optimizer, g)
        return bf16_optimizer(share.params, n, t.optimizer)
    if z.stage == 0:
        return stage0(share.params, b, t.optimizer)
    if z.stage in (1, 2):
        buffer = share.zero2_grad_buffer_rank0 if rank0 else share.zero2_grad_buffer
        return stage12(z.stage, share.params, n, b, c, z.reduce_bucket_size, z.overlap, share.largest,
                       buffer, share.zero2_largest_piece_rank0 if rank0 else share.zero2_largest_piece,
                       t.grad_accum, t.optimizer, z.offload_optimizer,
                       compact_fp32=fp32_accumulation(job))
    return stage3(share.zero3_partition, b * share.zero3_persistent, b, g, c, z.reduce_bucket_size,
                  t.optimizer, z.offload_optimizer, z.offload_param, z.sub_group_size)


def build_phases(job: Job, rank0: bool = False, stepped: bool = True) -> list[tuple[str, list[Part]]]:
    """All modelled moments of a step, each with the parts alive then.

    Under pipeline parallelism the first and the last stage are both modelled (phase names start with the
    stage); the peak of the two is the most loaded rank's. ``stepped=False``: no optimizer step has
    succeeded yet (fp16's loss scaler skips overflowing steps; optimizers create their states lazily)."""
    return phases_and_states(job, rank0, stepped)[0]


def phases_and_states(job: Job, rank0: bool = False, stepped: bool = True
                      ) -> tuple[list[tuple[str, list[Part]]], States]:
    """build_phases, and the model states of the first stage's rank (what the host and NVMe figures read)."""
    lay = job.layout
    share = rank_share(job)
    st = model_states(job, share, rank0)
    if lay.pp == 1:
        return _stage_phases(job, share, st, stepped, first=True, last=True), st
    # 1F1B (deepspeed/runtime/pipe/schedule.py TrainSchedule.num_pipe_buffers): stage s keeps
    # min(pp − s, micro-batches) micro-batches in flight
    first = _stage_phases(job, share, st, stepped, first=True, last=False)
    last_share = rank_share(job, last=True)
    last = _stage_phases(job, last_share, model_states(job, last_share, rank0), stepped, first=False, last=True)
    return ([(f"stage 0, {name}", parts) for name, parts in first]
            + [(f"stage {lay.pp - 1}, {name}", parts) for name, parts in last]), st


#: pipe buffers a last pipeline stage keeps logits in: TrainSchedule.num_pipe_buffers is at least 2 and the
#: last stage's backward returns before clearing its outputs (PipelineEngine._exec_backward_pass)
LAST_STAGE_LOGITS_BUFFERS = 2


@dataclass(frozen=True, slots=True)
class Activations:
    """Activation bytes of one rank: per layer (saved, and whole when recomputed) and in total."""

    layer_saved: int  # what one layer keeps for backward (its input only under full checkpointing)
    recompute: int  # the layer recomputed in backward under full checkpointing (0 otherwise)
    in_flight: int  # micro-batches whose activations are alive at once (1F1B on a first pipeline stage)
    pipe: int  # pipeline buffers: in-flight outputs/inputs [T, h], and a last stage's logits
    lsm: int  # the loss's saved fp32 [T, V/tp] (on the stage with the head)
    total: int  # everything saved at the end of forward
    transient: int  # gradient temporaries inside one layer's backward
    first_layer: int = 0  # layer 0's difference when its input needs no grad (a frozen embedding, <= 0)
    #: Megatron's CoreAttention: all activations at its forward / backward peak in the stage's last layer
    #: (memplan.megatron.stage._score_peaks; 0 where the phases above already hold the peak)
    attention_forward: int = 0
    attention_backward: int = 0


def _activations(job: Job, share: RankShare, first: bool, last: bool) -> Activations:
    """What one rank keeps for backward, from activations.py and head.py, for this stage."""
    if job.training.model_impl == "megatron":  # Megatron's GPT: memplan.megatron's terms
        from ..megatron.hook import estimator_activations

        return estimator_activations(job, share.layers, first, last)
    t, lay, m = job.training, job.layout, job.model
    b = dtype_bytes(t.dtype)
    tokens = job.tokens_per_rank
    seq = t.seq_len  # inside attention a rank sees the whole sequence (heads / sp under Ulysses)
    shape = (m, b, t.attention, seq, lay.sp > 1)
    tsp = lay.tp_sequence_parallel
    # a frozen base and LoRA adapters (estimator/lora.py): per layer, layer 0 without input grad, the head
    frozen = saved_deltas(t, m, seq, lay.sp > 1)
    full = (act.layer_bytes_per_token(*shape, False, lay.tp, tsp) + frozen.layer) * tokens
    if t.checkpointing == "full":
        saved = act.layer_input_bytes_per_token(m, b) * tokens // (lay.tp if tsp else 1)
    elif t.checkpointing == "selective":
        saved = (act.layer_bytes_per_token(*shape, True, lay.tp, tsp) + frozen.layer) * tokens
    else:
        saved = full
    first_layer = frozen.first_layer * tokens if first and t.checkpointing == "none" else 0
    in_flight = min(lay.pp, t.grad_accum) if first and lay.pp > 1 else 1
    # each in-flight micro-batch's output (pipe_buffers["outputs"]) and received input ("inputs"): [T, h]
    pipe = in_flight * b * m.hidden_size * tokens if lay.pp > 1 else 0
    if lay.pp > 1 and last:
        pipe += LAST_STAGE_LOGITS_BUFFERS * b * m.vocab_size // lay.tp * tokens
    if last:
        outside = (head.saved_bytes_per_token(m, b, seq, lay.tp) + frozen.head) * tokens
    else:
        outside = 8 * tokens  # a first pipeline stage keeps only the input ids for the embedding
    return Activations(
        layer_saved=saved, recompute=full if t.checkpointing == "full" else 0, in_flight=in_flight, pipe=pipe,
        lsm=4 * m.vocab_size // lay.tp * tokens if last else 0,
        total=in_flight * share.layers * saved + first_layer + outside + pipe,
        transient=act.backward_transient_bytes_per_token(m, b, t.attention, seq, lay.tp) * tokens,
        first_layer=first_layer)


def _base_parts(job: Job, share: RankShare, st: States, stepped: bool) -> list[Part]:
    """What every moment of a step holds: model states, workspaces, and ZeRO-3's gathered working set."""
    z, b = job.training.zero, dtype_bytes(job.training.dtype)
    params_detail = {3: "16-bit parameter partitions of this rank (ZeRO-3)"}.get(
        z.stage, f"{'16-bit' if b == 2 else 'fp32'} parameters, flat (whole model replica)")
    if share.frozen:  # LoRA's base or --freeze: the optimizer's groups hold the trainable ones only
        params_detail += f"; {share.params:,} trainable and {share.frozen:,} frozen parameters in this rank's replica"
    base = [("params_16bit", st.params_16bit, params_detail),
            ("params_persistent", st.params_persistent, "ZeRO-3 persistent (always gathered) parameters"),
            ("master_params_fp32", st.master_fp32, "fp32 master weights"),
            ("optimizer_states", st.optimizer_states if stepped or st.states_at_init else 0, "optimizer states"),
            ("offload_staging", st.offload_staging, "GPU staging buffer for offload"),
            ("grad_accum_fp32", st.grad_accum_buffer, "BF16_Optimizer's full fp32 gradient buffer"),
            ("cuda_workspaces", CUBLAS_WORKSPACE_BYTES, "cuBLAS / cuBLASLt workspaces")]
    if z.stage == 3:
        base += [("params_gathered", b * zero3_turn_gathered(job, share), "ZeRO-3 gathered working set"),
                 ("gradients", st.grads_resident, "ZeRO-3 gradient partitions"),
                 ("grad_bucket", st.grad_bucket, "ZeRO-3 IPG bucket (allocated at initialize)")]
    return base


@dataclass(frozen=True, slots=True)
class Grads:
    """Gradient bytes through a micro-step: carried in from earlier micro-steps, then during backward."""

    carried: tuple  # parts an earlier micro-step leaves for this one
    top: int  # grads alive at the last layer's backward (besides carried)
    bottom: int  # at layer 0's backward
    bucket: int  # the IPG bucket(s) during backward
    whole: bool  # param.grad accumulate whole (no reduce hooks): ZeRO-0, BF16_Optimizer
    #: at the boundary's reduce_gradients (ZeRO-1 without overlap_comm): every 16-bit grad, the partition it
    #: fills and the bucket, after the activations are gone (0: no such moment)
    at_reduce: int = 0


def _grads(job: Job, share: RankShare, st: States, last: bool) -> Grads:
    t, z, lay = job.training, job.training.zero, job.layout
    b = dtype_bytes(t.dtype)
    whole = z.stage == 0 or st.full_grads_in_backward
    # the pipeline engine moves a non-last stage's bf16 grads into BF16_Optimizer's buffer after every
    # micro-step's backward (PipelineEngine._exec_backward_pass: update_hp_grads(clear_lp_grads=True))
    moved_each_micro = st.full_grads_in_backward and lay.pp > 1 and not last
    carried: tuple = ()
    if t.grad_accum > 1 and whole and not moved_each_micro:
        carried = (("gradients", st.grads_full, "accumulated 16-bit gradients"),)
    elif t.grad_accum > 1 and z.stage == 1:
        carried = (("gradients", st.grads_full, "full 16-bit gradients until the boundary"),
                   ("grad_bucket", st.grad_bucket, "IPG bucket(s) held across micro-steps"))
    elif t.grad_accum > 1 and z.stage == 2:
        carried = (("gradients", st.grads_resident, "grads_in_partition across micro-steps"),)
    if whole:
        top, bottom, bucket = b * (share.head + share.per_layer), st.grads_full, 0
    elif z.stage == 1 and not z.overlap and z.offload_optimizer == "none":
        # DeepSpeedZeroOptimizer at stage 1 without overlap_comm: process_gradients only sets up the IPG bucket,
        # so the 16-bit param.grad accumulate whole through backward; engine.backward's reduce_gradients then
        # copies this rank's partition into grads_in_partition while they are all still alive
        top, bottom, bucket = b * (share.head + share.per_layer), b * share.params, st.grad_bucket
        if not carried:
            return Grads(carried, top, bottom, bucket, whole, b * share.params + st.grads_resident + bucket)
    elif z.stage in (1, 2):
        top, bottom, bucket = 0, st.grads_resident, st.grad_bucket
    else:
        top = bottom = bucket = 0
    if carried:
        top = bottom = 0  # carried already holds them
        bucket = 0 if z.stage == 1 else bucket
    return Grads(carried, top, bottom, bucket, whole)


def _stage_phases(job: Job, share: RankShare, st: States, stepped: bool, first: bool,
                  last: bool) -> list[tuple[str, list[Part]]]:
    """The phases of one rank holding ``share`` (model states ``st``); ``first`` holds the embeddings, ``last``
    the head and loss."""
    t, z, lay, m = job.training, job.training.zero, job.layout, job.model
    b = dtype_bytes(t.dtype)
    tokens = job.tokens_per_rank
    a = _activations(job, share, first, last)
    g = _grads(job, share, st, last)
    base = _base_parts(job, share, st, stepped)
    saved_experts = [("params_gathered_saved", b * zero3_saved_experts(job, share),
                      "gathered MoE experts grouped_mm's saved weight views keep until their layer's backward")]
    if last and t.loop == "outputs" and lay.pp == 1:  # the previous micro-step's output, or this one's
        base.append(("logits_loss", head.kept_output_bytes_per_token(m, b, lay.tp) * tokens,
                     "the model output's logits, kept by the outputs loop until the next forward returns"))
    fwd = base + list(g.carried)
    # a tied embedding's grad is complete only after the embedding's backward: DeepSpeed's grad hook
    # (AccumulateGrad post-hook) cannot take it earlier, so the full b·V·h grad waits through backward
    tied_bytes = b * share.head if m.tie_word_embeddings and z.stage > 0 and not g.whole else 0
    tied = [("tied_embedding_grad", tied_bytes, "full grad of the tied word embedding (reduced late)")]
    # one module's full weight grad (ZeRO-2/3 reduce it after; stage 0/1 keep it as param.grad) with the
    # activation grads of its matmul
    weight_grad = b * share.largest_layer_module if z.stage >= 2 else 0
    layer_transient = max(a.transient, weight_grad + b * tokens * (m.hidden_size + m.intermediate_size))
    grads = [("grad_bucket", g.bucket, "IPG bucket(s)")]
    step = ("optimizer step", [x for x in base if x[0] != "params_gathered"] + [
        ("gradients", st.grads_full if g.whole else (st.grads_resident if z.stage != 3 else 0),
         "gradients at the step"),
        ("optimizer_step_transient", _step_transient(t.optimizer, st) if stepped else 0,
         "fp32 grads and optimizer temporaries")])
    other_in_flight = a.layer_saved * (a.in_flight - 1) * share.layers
    layers = [
        ("backward, last layer", fwd + saved_experts + tied + grads + [
            ("gradients", g.top, "gradients so far"),
            ("activations", a.total - a.lsm + a.recompute - (a.layer_saved if a.recompute else 0),
             "all layers (the last one recomputed)" if a.recompute else "all layers"),
            ("layer_backward_transient", layer_transient, "grads inside the layer's backward")]),
        ("backward, layer 0", fwd + tied + grads + [
            ("gradients", g.bottom, "gradients so far"),
            ("activations", other_in_flight + (a.recompute or a.layer_saved + a.first_layer) + a.pipe,
             "layer 0 (+ the other in-flight micro-batches)"),
            ("layer_backward_transient", layer_transient, "grads inside the layer's backward")]),
    ]
    if g.at_reduce:
        layers.append(("backward, reduce_gradients", fwd + tied + [
            ("gradients", g.at_reduce, "every 16-bit grad, grads_in_partition and the IPG bucket")]))
    if a.attention_forward:
        layers += [
            ("forward, attention", fwd + [("activations", other_in_flight + a.pipe + a.attention_forward,
                                           "the layers so far and CoreAttention's score-sized tensors")]),
            ("backward, attention", fwd + tied + grads + [
                ("gradients", g.top, "gradients so far"),
                ("activations", other_in_flight + a.pipe + a.attention_backward,
                 "the layers and CoreAttention's score-sized grads (softmax backward)")])]
    if not last:
        note = f"{share.layers} layers × {a.in_flight} micro-batch(es) in flight"
        return [("forward, end of stage", fwd + [("activations", a.total, note)]), *layers, step]
    lm_head_grad = b * share.head if z.stage >= 1 and not m.tie_word_embeddings else 0
    if t.model_impl == "megatron":  # Megatron's vocabulary-parallel loss (memplan.megatron.outside)
        from ..megatron.hook import loss_transients

        loss_fwd, loss_bwd, head_bwd = loss_transients(job)
    else:
        loss_fwd = head.forward_loss_transient_per_token(m, b, lay.tp) * tokens
        loss_bwd = head.backward_loss_transient_per_token(m, b, lay.tp) * tokens
        head_bwd = head.lm_head_backward_transient_per_token(m, b, lay.tp) * tokens
    return [
        ("forward, loss", fwd + saved_experts + [
            ("activations", a.total, f"{share.layers} layers × {a.in_flight} micro-batch(es) + outside layers"),
            ("logits_loss", loss_fwd, "logits and their fp32 upcast")]),
        ("backward, loss", fwd + saved_experts + [
            ("activations", a.total, "all layers + outside layers"),
            ("logits_loss", loss_bwd, "nll and log_softmax grads")]),
        ("backward, lm_head", fwd + saved_experts + tied + grads + [
            ("gradients", g.top, "gradients so far"),
            ("activations", a.total - a.lsm, "all layers + outside layers but the loss"),
            ("logits_loss", head_bwd + lm_head_grad,
             "grad of the logits and of lm_head's input; lm_head's weight grad")]),
        *layers, step,
    ]


def _step_transient(optimizer: str, st: States) -> int:
    """The step's peak above the states: the larger of the grad preparation (norm, flatten, fp32 cast) and
    the optimizer's own run, which holds the fp32 grads plus, for torch AdamW (foreach), the
    sqrt(exp_avg_sq) temporaries of the size of one state (torch/optim/adamw.py _multi_tensor_adamw)."""
    temporaries = min(st.optimizer_states // 2, st.step_grad_fp32) if optimizer == "torch_adamw" else 0
    return max(st.step_transient, st.step_grad_fp32 + temporaries)
