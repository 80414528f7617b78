"""A job as the ordered allocations of one rank: model build, deepspeed.initialize, then the training steps.

``build_ledger(job)`` runs the job the way memplan.verify measures it (and users' scripts run it): the model is
built on the GPU (one allocation per parameter, in module order), ``deepspeed.initialize`` wraps it (the ZeRO
stage's engine model: zero0.py, zero12.py, zero3.py), then ``steps`` optimizer steps of ``grad_accum``
micro-steps, each a forward (families/), ``engine.backward`` and ``engine.step``. Phase marks carry verify's
names ("init", "step1.micro0.forward", …), so measured and predicted phases line up.

The loop (TrainingSpec.loop) decides what the Python code keeps: ``outputs`` keeps the model output object —
its logits — from one forward until the next forward returns and rebinds the name; ``loss`` and ``hf-trainer``
(Trainer.training_step / compute_loss return the loss only) keep the loss until backward.

cuBLAS: the first matmul on a stream creates its handle's workspaces from torch's caching allocator
(aten/src/ATen/cuda/CublasHandlePool.cpp getCurrentCUDABlasHandle / getCUDABlasLtWorkspace: 32 MiB each on
Hopper), kept for the process's life.
"""

from __future__ import annotations

from ..ledger import Ledger
from ..specs import Job
from ..units import MiB, dtype_bytes
from .autograd import Autograd
from .families import forward
from .optim import Optimizer
from .transformer import Net, Params, Shape
from .zero0 import Zero0
from .zero3 import Zero3
from .zero12 import FlatGroup, Zero12

#: cuBLAS and cuBLASLt workspaces (CublasHandlePool.cpp: 32 MiB each on sm90), at the first matmul
CUBLAS_WORKSPACE_BYTES = (32 * MiB, 32 * MiB)


def _trainable(job: Job):
    """Whether a parameter name trains (frozen groups and LoRA bases do not)."""
    from ..params import frozen_names

    frozen = frozen_names(job.model, job.training.freeze) if job.training.freeze else frozenset()
    if job.training.lora is not None:
        return lambda name: False
    return lambda name: name not in frozen


def build_model(L: Ledger, job: Job) -> dict[str, int]:
    """AutoModelForCausalLM.from_config on the GPU: each parameter allocated as its module is built (ledger
    ids by name); a tied lm_head is built and then replaced by the embedding (tie_weights frees it)."""
    from ..params import parameter_tensors

    b = dtype_bytes(job.training.dtype)
    ids = {t.name: L.alloc(t.name, t.numel * b, "params_16bit") for t in parameter_tensors(job.model)}
    if job.model.tie_word_embeddings:
        first = parameter_tensors(job.model)[0]
        L.free(L.alloc("lm_head.weight (before tie_weights)", first.numel * b, "params_16bit"))
    return ids


def _engine(L: Ledger, job: Job, trainable):
    from ..params import parameter_tensors

    t, z, lay = job.training, job.training.zero, job.layout
    b = dtype_bytes(t.dtype)
    names = [p.name for p in parameter_tensors(job.model) if trainable(p.name)]
    numels = [p.numel for p in parameter_tensors(job.model) if trainable(p.name)]
    opt = Optimizer(t.optimizer, on_gpu=z.offload_optimizer == "none")
    if z.stage == 0:
        return Zero0(L, names, numels, b, opt, lay.dp, z.allgather_bucket_size)
    if z.stage in (1, 2):
        group = FlatGroup(names, numels, lay.zero_group, 0)
        comm = dtype_bytes(t.sp_comm_dtype) if lay.sp > 1 else b
        return Zero12(L, z.stage, [group], b, z.reduce_bucket_size, z.overlap, t.grad_accum, opt, comm,
                      offload=z.offload_optimizer != "none")
    g = dtype_bytes(t.grad_accum_dtype or t.dtype)
    comm = dtype_bytes(t.sp_comm_dtype) if lay.sp > 1 else b
    all_names = [p.name for p in parameter_tensors(job.model)]
    all_numels = [p.numel for p in parameter_tensors(job.model)]
    return Zero3(L, all_names, all_numels, set(names), lay.zero_group, b, g, z, opt, comm)


def shape(job: Job) -> Shape:
    t, lay = job.training, job.layout
    return Shape(t.micro_batch, t.seq_len // lay.sp, t.seq_len, dtype_bytes(t.dtype), positions_given=lay.sp > 1)


def build_ledger(job: Job, steps: int = 3, skipped=()) -> Ledger:
    """The job's allocation ledger on rank 0 (see the module docstring). ``skipped``: the optimizer steps
    (indices) the fp16 loss scaler skips on overflow (no optimizer state exists until one succeeds)."""
    skipped = frozenset(skipped)
    t = job.training
    L = Ledger()
    L.mark("init")
    trainable = _trainable(job)
    engine = _engine(L, job, trainable)
    if isinstance(engine, Zero3):
        from ..params import parameter_tensors

        engine.build([(p.name, p.numel) for p in parameter_tensors(job.model)])
        ids = {}
    else:
        ids = build_model(L, job)
    engine.initialize(ids)
    hooks = engine if isinstance(engine, Zero3) else None
    ag = Autograd(L, on_param_grad=lambda param, grad: engine.on_param_grad(ag, param, grad))
    workspaces = []

    def first_matmul():
        workspaces.extend(L.alloc("cublas.workspace", n, "cuda_workspaces") for n in CUBLAS_WORKSPACE_BYTES)

    ag.before_matmul = first_matmul
    params = Params(ag, job.model, dtype_bytes(t.dtype), trainable)
    s = shape(job)
    layer_fn = None
    if t.checkpointing == "full":
        from .checkpoint import nonreentrant

        layer_fn = nonreentrant(ag)
    kept = None  # the loop's ``outputs``: logits of the last forward
    stepped_yet = False
    for step in range(steps):
        for micro in range(t.grad_accum):
            L.mark(f"step{step}.micro{micro}.forward")
            if hooks is not None:
                hooks.start_forward()
            out = forward(Net(ag, job.model, s, params, hooks, layer_fn, attention=t.attention, dtype=t.dtype))
            if kept is not None:
                ag.release(kept)  # the name is rebound: the previous output object dies
                kept = None
            if t.loop == "outputs":
                kept = out.logits
            else:
                ag.release(out.logits)
            L.mark(f"step{step}.micro{micro}.backward")
            boundary = micro == t.grad_accum - 1
            ag.backward(out.loss, 4)
            ag.release(out.loss)
            engine.end_backward(ag, boundary)
            L.mark(f"step{step}.micro{micro}.step")
            if boundary and step in skipped:
                engine.skip(ag)
            elif boundary:
                first = not stepped_yet
                stepped_yet = True
                if isinstance(engine, Zero0):
                    engine.step(ag, first)
                else:
                    engine.step(first)
    return L
