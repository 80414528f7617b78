"""The estimator's hook into memplan.megatron (``model_impl == "megatron"``): the activation figures of
estimator/phases.py computed from Megatron's terms. Kept apart so the allocation ledger can re-point it."""

from __future__ import annotations

from ..specs import Job
from .outside import loss_backward_transient_per_token, loss_forward_transient_per_token
from .shape import resolve
from .stage import stage_activations


def estimator_activations(job: Job, layers: int, first: bool, last: bool):
    """estimator.phases.Activations for a stage of ``layers`` layers (the first and/or the last stage)."""
    from ..estimator.phases import Activations

    m, lay = job.model, job.layout
    s = resolve(m, job)
    in_flight = min(lay.pp, job.training.grad_accum) if first and lay.pp > 1 else 1
    a = stage_activations(m, job, layers, first, last, in_flight)
    # pipe_buffers['outputs'] / ['inputs'] of a stage: one [T/r, h] per micro-batch in flight
    pipe = in_flight * s.b * s.h * s.tokens // s.r if lay.pp > 1 else 0
    v = s.vocab if (s.sp > 1 and a.outside and not job.training.megatron.pipeline_engine) else s.vocab // s.tp
    return Activations(
        layer_saved=a.saved_layers // max(1, layers), recompute=a.recompute, in_flight=in_flight,
        pipe=pipe + a.buffers, lsm=4 * v * s.tokens if last else 0,
        total=in_flight * a.saved_layers + a.outside + pipe + a.buffers, transient=a.backward_transient,
        attention_forward=a.forward_layer_peak, attention_backward=a.backward_layer_peak)


def loss_transients(job: Job) -> tuple[int, int, int]:
    """(forward at the loss, backward at the loss, the head's backward) in bytes, Megatron's loss."""
    m = job.model
    s = resolve(m, job)
    fwd = loss_forward_transient_per_token(m, job) * s.tokens
    bwd = loss_backward_transient_per_token(m, job) * s.tokens
    return fwd, bwd, bwd
