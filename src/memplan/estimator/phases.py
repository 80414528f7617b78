"""The phases of one training step on the most loaded rank, each a list of parts alive at that moment.

A step after the first (optimizer states exist; ZeRO-3 has its trace and keeps reused parameters): forward
to the loss, backward from the loss down to layer 0, the optimizer step. With gradient accumulation the
later micro-steps also carry the gradients of the earlier ones. Parts are (name, bytes, detail) tuples;
estimator/__init__ turns them into typed results. Model states come from states.py, activations from
activations.py and head.py.
"""

from __future__ import annotations

from ..specs import Job
from ..units import MiB, dtype_bytes
from . import activations as act
from . import head
from .layout import RankShare, rank_share
from .states import States, bf16_optimizer, stage0, stage3, stage12

Part = tuple  # (name, bytes, detail)

#: cuBLAS and cuBLASLt workspaces that torch serves from its caching allocator (torch/csrc/cuda/
#: CublasHandlePool.cpp): 32 MiB each on Hopper, taken at the first matmul and kept. Seen in every
#: measured run as 64 MiB that appears in the first step and never leaves.
CUBLAS_WORKSPACE_BYTES = 64 * MiB


def model_states(job: Job, share: RankShare, rank0: bool = False) -> States:
    """Resolve the ZeRO stage's state bytes for this rank (``rank0``: rank 0 instead of the most loaded)."""
    t, z, lay = job.training, job.training.zero, job.layout
    b = dtype_bytes(t.dtype)
    g = dtype_bytes(t.grad_accum_dtype or t.dtype)
    c = dtype_bytes(t.sp_comm_dtype) if lay.sp > 1 else b
    n = lay.zero_group
    # engine._do_optimizer_sanity_check: BFLOAT16 for bf16 at ZeRO-0 under pipeline parallelism, and for
    # bf16 + ZeRO-1 + fp32 accumulation
    if z.stage == 0 and t.dtype == "bf16" and lay.pp > 1:
        return bf16_optimizer(share.params, lay.dp, t.optimizer, g)
    if z.stage == 0:
        return stage0(share.params, b, t.optimizer)
    if z.stage == 1 and t.dtype == "bf16" and t.grad_accum_dtype == "fp32" and z.offload_optimizer == "none":
        return bf16_optimizer(share.params, n, t.optimizer)
    if z.stage in (1, 2):
        buffer = share.zero2_grad_buffer_rank0 if rank0 else share.zero2_grad_buffer
        return stage12(z.stage, share.params, n, b, c, z.reduce_bucket_size, z.overlap, share.largest,
                       buffer, share.zero2_largest_piece_rank0 if rank0 else share.zero2_largest_piece,
                       t.grad_accum, t.optimizer, z.offload_optimizer)
    return stage3(share.zero3_partition, b * share.zero3_persistent, b, g, c, z.reduce_bucket_size,
                  t.optimizer, z.offload_optimizer, z.offload_param, z.sub_group_size)


def zero3_turn_gathered(job: Job, share: RankShare) -> int:
    """ZeRO-3 parameters gathered at the forward→backward turn, in elements.

    PartitionedParameterCoordinator.__params_to_release (runtime/zero/partitioned_param_coordinator.py)
    keeps a module's params when, walking the trace onward, they reappear before stage3_max_reuse_distance
    elements have gone by: measured, a module is kept when the modules after it in forward hold fewer than
    that many elements. The prefetch may then add modules up to min(stage3_prefetch_bucket_size,
    stage3_max_live_parameters − available), overshooting by the last module it takes.
    """
    z = job.training.zero
    kept = after = 0
    skipped = []
    # a tied word embedding is the first module and lm_head the last: one parameter, gathered once
    modules = share.modules[1:] if job.model.tie_word_embeddings else share.modules
    for numel in reversed(modules):
        if after < z.stage3_max_reuse_distance:
            kept += numel
        else:
            skipped.append(numel)
        after += numel
    budget = min(z.stage3_prefetch_bucket_size, z.stage3_max_live_parameters - kept)
    fetched = 0
    for numel in skipped:
        if fetched >= budget:
            break
        fetched += numel
    return kept + fetched


def build_phases(job: Job, rank0: bool = False, stepped: bool = True) -> list[tuple[str, list[Part]]]:
    """All modelled moments of a step, each with the parts alive then.

    Under pipeline parallelism the first and the last stage are both modelled (phase names start with the
    stage); the peak of the two is the most loaded rank's. ``stepped=False``: no optimizer step has
    succeeded yet (fp16's loss scaler skips overflowing steps; optimizers create their states lazily)."""
    lay = job.layout
    if lay.pp == 1:
        return _stage_phases(job, rank_share(job), rank0, stepped, first=True, last=True)
    # 1F1B (deepspeed/runtime/pipe/schedule.py TrainSchedule.num_pipe_buffers): stage s keeps
    # min(pp − s, micro-batches) micro-batches in flight
    first = _stage_phases(job, rank_share(job), rank0, stepped, first=True, last=False)
    last = _stage_phases(job, rank_share(job, last=True), rank0, stepped, first=False, last=True)
    return ([(f"stage 0, {name}", parts) for name, parts in first]
            + [(f"stage {lay.pp - 1}, {name}", parts) for name, parts in last])


def _stage_phases(job: Job, share: RankShare, rank0: bool, stepped: bool, first: bool,
                  last: bool) -> list[tuple[str, list[Part]]]:
    """The phases of one rank holding ``share``; ``first`` holds the embeddings, ``last`` the head and loss."""
    t, z, lay, m = job.training, job.training.zero, job.layout, job.model
    b = dtype_bytes(t.dtype)
    st = model_states(job, share, rank0)
    tokens = job.tokens_per_rank
    seq_attn = t.seq_len  # inside attention a rank sees the whole sequence (heads / sp under Ulysses)
    tsp = lay.tp_sequence_parallel
    layer_full = act.layer_bytes_per_token(m, b, t.attention, seq_attn, lay.sp > 1, False, lay.tp, tsp) * tokens
    if t.checkpointing == "full":
        layer_saved = act.layer_input_bytes_per_token(m, b) * tokens // (lay.tp if tsp else 1)
    elif t.checkpointing == "selective":
        layer_saved = act.layer_bytes_per_token(m, b, t.attention, seq_attn, lay.sp > 1, True, lay.tp, tsp) * tokens
    else:
        layer_saved = layer_full
    recompute = layer_full if t.checkpointing == "full" else 0
    in_flight = min(lay.pp, t.grad_accum) if first and lay.pp > 1 else 1
    # a pipeline stage keeps each in-flight micro-batch's output (pipe_buffers["outputs"]) for its backward,
    # and a later stage the received input it differentiates (pipe_buffers["inputs"]): [T, h] each. The last
    # stage's outputs are the logits; its backward returns before clearing them (PipelineEngine.
    # _exec_backward_pass), so both of its buffers (TrainSchedule.num_pipe_buffers: at least 2) keep logits.
    pipe = 0
    if lay.pp > 1:
        pipe = in_flight * b * m.hidden_size * tokens
        if last:
            pipe += min(2, max(2, t.grad_accum)) * b * m.vocab_size // lay.tp * tokens
    head_saved = (sum(x.bytes_per_token for x in head.saved_terms(m, b, seq_attn, lay.tp)) * tokens if last
                  else 8 * tokens)  # the first stage alone keeps only the input ids for the embedding
    lsm = 4 * m.vocab_size // lay.tp * tokens if last else 0
    acts_all = in_flight * share.layers * layer_saved + head_saved + pipe
    transient = act.backward_transient_bytes_per_token(m, b, t.attention, seq_attn, lay.tp) * tokens

    params_detail = {3: "16-bit parameter partitions of this rank (ZeRO-3)"}.get(
        z.stage, f"{'16-bit' if b == 2 else 'fp32'} parameters, flat (whole model replica)")
    base = [("params_16bit", st.params_16bit, params_detail),
            ("params_persistent", st.params_persistent, "ZeRO-3 persistent (always gathered) parameters"),
            ("master_params_fp32", st.master_fp32, "fp32 master weights"),
            ("optimizer_states", st.optimizer_states if stepped else 0, "optimizer states"),
            ("offload_staging", st.offload_staging, "GPU staging buffer for offload"),
            ("grad_accum_fp32", st.grad_accum_buffer, "BF16_Optimizer's full fp32 gradient buffer"),
            ("cuda_workspaces", CUBLAS_WORKSPACE_BYTES, "cuBLAS / cuBLASLt workspaces")]
    if z.stage == 3:
        base += [("params_gathered", b * zero3_turn_gathered(job, share), "ZeRO-3 gathered working set"),
                 ("gradients", st.grads_resident, "ZeRO-3 gradient partitions"),
                 ("grad_bucket", st.grad_bucket, "ZeRO-3 IPG bucket (allocated at initialize)")]
    # what earlier micro-steps leave for the next one
    carried: list[Part] = []
    whole_grads = z.stage == 0 or st.full_grads_in_backward  # param.grad accumulate, no reduce hooks
    # the pipeline engine moves a non-last stage's bf16 grads into BF16_Optimizer's buffer after every
    # micro-step's backward (PipelineEngine._exec_backward_pass: update_hp_grads(clear_lp_grads=True))
    moved_each_micro = st.full_grads_in_backward and lay.pp > 1 and not last
    if t.grad_accum > 1 and whole_grads and not moved_each_micro:
        carried = [("gradients", st.grads_full, "accumulated 16-bit gradients")]
    elif t.grad_accum > 1 and z.stage == 1:
        carried = [("gradients", st.grads_full, "full 16-bit gradients until the boundary"),
                   ("grad_bucket", st.grad_bucket, "IPG bucket(s) held across micro-steps")]
    elif t.grad_accum > 1 and z.stage == 2:
        carried = [("gradients", st.grads_resident, "grads_in_partition across micro-steps")]
    fwd = base + carried

    if whole_grads:
        grads_top, grads_bottom, bucket = b * (share.head + share.per_layer), st.grads_full, 0
    elif z.stage in (1, 2):
        grads_top, grads_bottom, bucket = 0, st.grads_resident, st.grad_bucket
    else:
        grads_top = grads_bottom = bucket = 0
    if carried:
        grads_top = grads_bottom = 0  # carried already holds them
        bucket = 0 if z.stage == 1 else bucket
    # a tied embedding's grad is complete only after the embedding's backward: DeepSpeed's grad hook
    # (AccumulateGrad post-hook) cannot take it earlier, so the full b·V·h grad waits through backward
    tied = [("tied_embedding_grad", b * share.head if m.tie_word_embeddings and z.stage > 0 and not whole_grads else 0,
             "full grad of the tied word embedding, reduced after the embedding's backward")]
    # one module's full weight grad (ZeRO-2/3 reduce it after; stage 0/1 keep it as param.grad) with the
    # activation grads of its matmul
    weight_grad = b * share.largest_layer_module if z.stage >= 2 else 0
    layer_transient = max(transient, weight_grad + b * tokens * (m.hidden_size + m.intermediate_size))
    lm_head_grad = b * share.head if z.stage >= 1 and not m.tie_word_embeddings else 0

    vocab_tp = lay.tp  # the loss is vocabulary-parallel under tp (logits [T, V/tp])
    step = ("optimizer step", [x for x in base if x[0] != "params_gathered"] + [
        ("gradients", st.grads_full if whole_grads else (st.grads_resident if z.stage != 3 else 0),
         "gradients at the step"),
        ("optimizer_step_transient", _step_transient(t.optimizer, st) if stepped else 0,
         "fp32 grads and optimizer temporaries")])
    layers = [
        ("backward, last layer", fwd + tied + [
            ("gradients", grads_top, "gradients so far"), ("grad_bucket", bucket, "IPG bucket(s)"),
            ("activations", acts_all - lsm + recompute - (layer_saved if recompute else 0),
             "all layers (the last one recomputed)" if recompute else "all layers"),
            ("layer_backward_transient", layer_transient, "grads inside the layer's backward")]),
        ("backward, layer 0", fwd + tied + [
            ("gradients", grads_bottom, "gradients so far"), ("grad_bucket", bucket, "IPG bucket(s)"),
            ("activations", layer_saved * (in_flight - 1) * share.layers + recompute + layer_saved * (not recompute)
             + pipe, "layer 0 (+ the other in-flight micro-batches)"),
            ("layer_backward_transient", layer_transient, "grads inside the layer's backward")]),
    ]
    if not last:
        in_flight_note = f"{share.layers} layers × {in_flight} micro-batch(es) in flight"
        return [("forward, end of stage", fwd + [("activations", acts_all, in_flight_note)]), *layers, step]
    return [
        ("forward, loss", fwd + [
            ("activations", acts_all, f"{share.layers} layers × {in_flight} micro-batch(es) + outside layers"),
            ("logits_loss", head.forward_loss_transient_per_token(m, b, vocab_tp) * tokens,
             "logits and their fp32 upcast")]),
        ("backward, loss", fwd + [
            ("activations", acts_all, "all layers + outside layers"),
            ("logits_loss", head.backward_loss_transient_per_token(m, b, vocab_tp) * tokens,
             "nll and log_softmax grads")]),
        ("backward, lm_head", fwd + tied + [
            ("gradients", grads_top, "gradients so far"), ("grad_bucket", bucket, "IPG bucket(s)"),
            ("activations", acts_all - lsm, "all layers + outside layers but the loss"),
            ("logits_loss", head.lm_head_backward_transient_per_token(m, b, vocab_tp) * tokens + lm_head_grad,
             "grad of the logits and of lm_head's input; lm_head's weight grad")]),
        *layers, step,
    ]


def _step_transient(optimizer: str, st: States) -> int:
    """The step's peak above the states: the larger of the grad preparation (norm, flatten, fp32 cast) and
    the optimizer's own run, which holds the fp32 grads plus, for torch AdamW (foreach), the
    sqrt(exp_avg_sq) temporaries of the size of one state (torch/optim/adamw.py _multi_tensor_adamw)."""
    temporaries = min(st.optimizer_states // 2, st.step_grad_fp32) if optimizer == "torch_adamw" else 0
    return max(st.step_transient, st.step_grad_fp32 + temporaries)
