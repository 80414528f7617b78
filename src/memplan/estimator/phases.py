"""The phases of one training step on the most loaded rank, each a list of parts alive at that moment.

A step (after the first, so optimizer states exist): forward to the loss, backward from the loss down to
layer 0, the optimizer step. Parts are (name, bytes, detail) tuples; estimator/__init__ turns them into
typed results. Model states come from states.py, activations from activations.py and head.py.
"""

from __future__ import annotations

from ..specs import Job
from ..units import dtype_bytes
from . import activations as act
from . import head
from .layout import RankShare, rank_share
from .states import States, stage0, stage3, stage12

Part = tuple  # (name, bytes, detail)


def model_states(job: Job, share: RankShare) -> States:
    """Resolve the ZeRO stage's state bytes for this rank."""
    t, z, lay = job.training, job.training.zero, job.layout
    b = dtype_bytes(t.dtype)
    g = dtype_bytes(t.grad_accum_dtype or t.dtype)
    c = dtype_bytes(t.sp_comm_dtype) if lay.sp > 1 else b
    n = lay.zero_group
    if z.stage == 0:
        return stage0(share.params, b, t.optimizer)
    if z.stage in (1, 2):
        return stage12(z.stage, share.params, n, b, g, c, z.reduce_bucket_size, z.overlap, share.largest,
                       t.optimizer, z.offload_optimizer)
    persistent = b * share.zero3_persistent
    return stage3(share.zero3_partition, persistent, b, g, c, z.reduce_bucket_size, t.optimizer,
                  z.offload_optimizer, z.offload_param, z.sub_group_size)


def zero3_turn_gathered(job: Job, share: RankShare) -> int:
    """ZeRO-3 parameters still gathered at the forward→backward turn, in elements.

    PartitionedParameterCoordinator.__params_to_release (runtime/zero/partitioned_param_coordinator.py)
    keeps a released module's params when they reappear within stage3_max_reuse_distance elements of the
    trace; a module with X elements after it in forward reappears in backward after about 2·X. Plus the
    prefetch of up to stage3_prefetch_bucket_size elements for the next modules.
    """
    z = job.training.zero
    reuse = z.stage3_max_reuse_distance
    kept = share.head if 0 < reuse else 0
    after = share.head
    for _ in range(share.layers):
        if 2 * after >= reuse:
            break
        kept += share.per_layer
        after += share.per_layer
    return kept + min(z.stage3_prefetch_bucket_size, max(0, share.params - kept))


def build_phases(job: Job) -> list[tuple[str, list[Part]]]:
    """All modelled moments of a step, each with the parts alive then."""
    t, z, lay, m = job.training, job.training.zero, job.layout, job.model
    b = dtype_bytes(t.dtype)
    share = rank_share(job)
    st = model_states(job, share)
    tokens = job.tokens_per_rank
    seq_attn = t.seq_len  # inside attention a rank sees the whole sequence (heads / sp under Ulysses)
    layer_full = act.layer_bytes_per_token(m, b, t.attention, seq_attn) * tokens
    if t.checkpointing == "full":
        layer_saved = act.layer_input_bytes_per_token(m, b) * tokens
    else:
        layer_saved = layer_full
    in_flight = min(lay.pp, t.grad_accum) if lay.pp > 1 else 1  # 1F1B: the first stage holds pp micro-batches
    head_saved = sum(x.bytes_per_token for x in head.saved_terms(m, b)) * tokens
    lsm = 4 * m.vocab_size * tokens
    acts_all = in_flight * share.layers * layer_saved
    transient = act.backward_transient_bytes_per_token(m, b, t.attention, seq_attn) * tokens
    recompute = layer_full if t.checkpointing == "full" else 0

    base = [("params_16bit", st.params_16bit, "16-bit parameters"),
            ("params_persistent", st.params_persistent, "ZeRO-3 persistent (gathered) parameters"),
            ("master_params_fp32", st.master_fp32, "fp32 master weights"),
            ("optimizer_states", st.optimizer_states, "optimizer states")]
    if z.stage == 3:
        gathered = b * zero3_turn_gathered(job, share)
        base.append(("params_gathered", gathered, "ZeRO-3 gathered working set at the turn"))
        base.append(("gradients", st.grads_resident, "ZeRO-3 gradient partitions"))
    accum_grads = 0
    if t.grad_accum > 1 and z.stage in (0, 1):
        accum_grads = st.grads_resident  # previous micro-steps' grads stay until the boundary
    elif t.grad_accum > 1 and z.stage == 2:
        accum_grads = st.grads_resident
    fwd_base = base + ([("gradients", accum_grads, "accumulated gradients")] if z.stage != 3 else [])
    offload = [("offload_staging", st.offload_staging, "GPU staging for offload")] if st.offload_staging else []

    phases = []
    phases.append(("forward, loss", fwd_base + offload + [
        ("activations", acts_all + head_saved, f"{share.layers} layers × {in_flight} micro-batch(es) + head"),
        ("logits_loss", head.forward_loss_transient_per_token(m, b) * tokens, "logits and their fp32 upcast"),
    ]))
    phases.append(("backward, loss", fwd_base + offload + [
        ("activations", acts_all + head_saved, "all layers + head"),
        ("logits_loss", head.backward_loss_transient_per_token(m, b) * tokens, "nll and log_softmax grads"),
    ]))
    # grads while walking down the layers
    if z.stage in (0, 1):
        grads_top = accum_grads or int(st.grads_accumulating_per_param * (share.head + share.per_layer))
        grads_bottom = accum_grads or int(st.grads_accumulating_per_param * (share.params - share.embedding))
        bucket = st.grad_bucket if z.stage == 1 else 0
    elif z.stage == 2:
        grads_top = grads_bottom = st.grads_resident
        bucket = st.grad_bucket
    else:
        grads_top = grads_bottom = 0
        bucket = st.grad_bucket
    phases.append(("backward, last layer", base + offload + [
        ("gradients", grads_top, "gradients so far"), ("grad_bucket", bucket, "IPG bucket(s)"),
        ("activations", acts_all + head_saved - lsm - (layer_saved - layer_full if recompute else 0),
         "all layers (the last one recomputed)"),
        ("layer_backward_transient", transient, "grads inside the layer's backward"),
    ]))
    phases.append(("backward, layer 0", base + offload + [
        ("gradients", grads_bottom, "gradients so far"), ("grad_bucket", bucket, "IPG bucket(s)"),
        ("activations", layer_saved * (in_flight - 1) * share.layers + recompute + layer_saved, "layer 0"),
        ("layer_backward_transient", transient, "grads inside the layer's backward"),
    ]))
    step_grads = st.grads_resident if z.stage in (0, 1, 2) else 0
    step_extra = st.step_transient
    if t.optimizer == "torch_adamw" and st.optimizer_states:
        step_extra += st.optimizer_states // 2  # foreach sqrt(exp_avg_sq) temporaries (torch/optim/adamw.py)
    phases.append(("optimizer step", base + offload + [
        ("gradients", step_grads, "gradients at the step"),
        ("optimizer_step_transient", step_extra, "flattened / fp32 grads and optimizer temporaries"),
    ]))
    return phases
