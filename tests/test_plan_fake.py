"""FAKE ESTIMATOR for the plan tests — not memplan's memory model.

`fake_quick_peak(job)` stands in for memplan.estimator.quick_peak so that the search machinery's tests do
not move whenever the memory model is refined. It is a deliberately simple analytic model (ZeRO model states by stage, Korthikanti et al. 2022 activations with
flash attention, full checkpointing keeping layer inputs) with the properties the search relies on: memory
grows with micro-batch and with less checkpointing, falls with tp / pp / sp / ZeRO stage / offload, and host
RAM / NVMe do not depend on the micro-batch. Tests of the search machinery use it; tests of real numbers use
the real estimator.
"""

from __future__ import annotations

from memplan.estimator import QuickPeak
from memplan.params import count_params
from memplan.specs import Job

GIB = 2**30
#: what the fake puts outside torch's allocator (CUDA context + NCCL)
FAKE_NON_TORCH_BYTES = 1 * GIB


FakePeak = QuickPeak  # the same fields the search reads


def _model_states(job: Job) -> tuple[int, int]:
    """(GPU bytes, offloaded bytes) of params, grads and Adam states on one rank."""
    lay, z = job.layout, job.training.zero
    shard = count_params(job.model).total_params // (lay.tp * lay.pp)
    n = lay.zero_group
    params = 2 * shard if z.stage < 3 else 2 * shard // n
    grads = 2 * shard if z.stage < 2 else 2 * shard // n
    optim = 12 * shard if z.stage == 0 else 12 * shard // n
    host = 0
    if z.offload_optimizer != "none":
        host += optim
        optim = 0
    if z.offload_param != "none":
        host += params
        params = 0
    return params + grads + optim, host


def _activations(job: Job) -> int:
    m, t, lay = job.model, job.training, job.layout
    sbh = t.micro_batch * (t.seq_len // lay.sp) * m.hidden_size
    per_layer = sbh * 34 // lay.tp  # Korthikanti et al. 2022 eq. 2 without the s² scores (flash)
    if t.attention == "eager":
        per_layer += 5 * m.num_heads * t.micro_batch * t.seq_len * (t.seq_len // lay.sp) // lay.tp
    layers = m.num_layers // lay.pp
    if t.checkpointing == "full":
        return 2 * sbh * layers + per_layer
    keep = per_layer if t.checkpointing == "none" else per_layer * 2 // 3
    return keep * layers * min(lay.pp, t.grad_accum)


def fake_quick_peak(job: Job) -> FakePeak:
    """FAKE: see the module docstring."""
    states, offloaded = _model_states(job)
    allocated = states + _activations(job)
    reserved = allocated + allocated // 20
    ranks_per_node = min(job.layout.world, job.layout.gpus_per_node)
    nvme = job.training.zero.offload_optimizer == "nvme" or job.training.zero.offload_param == "nvme"
    per_node = offloaded * ranks_per_node
    return FakePeak(allocated, reserved, reserved + FAKE_NON_TORCH_BYTES,
                    0 if nvme else per_node, per_node if nvme else 0, "backward")


def test_fake_grows_with_micro_batch_and_falls_with_zero_stage():
    from memplan.presets import load_model
    from memplan.specs import Layout, TrainingSpec, ZeroSpec

    m = load_model("llama-3.2-1b")
    def job(micro, stage):
        t = TrainingSpec(seq_len=4096, micro_batch=micro, zero=ZeroSpec(stage=stage))
        return Job(model=m, training=t, layout=Layout(world=8))
    assert fake_quick_peak(job(2, 1)).peak_allocated_bytes > fake_quick_peak(job(1, 1)).peak_allocated_bytes
    assert fake_quick_peak(job(1, 3)).peak_allocated_bytes < fake_quick_peak(job(1, 1)).peak_allocated_bytes
