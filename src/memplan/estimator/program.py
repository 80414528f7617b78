"""A job as the ordered allocations of one rank: model build, deepspeed.initialize, then the training steps.

``build_ledger(job)`` runs the job the way memplan.verify measures it (and users' scripts run it): the model is
built on the GPU (one allocation per parameter, in module order), ``deepspeed.initialize`` wraps it (the ZeRO
stage's engine model: zero0.py, zero12.py, zero3.py), then ``steps`` optimizer steps of ``grad_accum``
micro-steps, each a forward (families/), ``engine.backward`` and ``engine.step``. Phase marks carry verify's
names ("init", "step1.micro0.forward", …), so measured and predicted phases line up. With LoRA, peft's adapters are
built after the base (estimator/peft_linear.py: moved to the base's device and dtype, made fp32) and cast to the
training dtype by deepspeed.initialize, except under zero.Init (ZeRO-3), which partitions them in fp32; only the
trainable parameters (train_set.train_set) reach the optimizer.

The loop (TrainingSpec.loop: memplan.verify's DeepSpeed loop keeping ``outputs`` or the ``loss``, or
transformers' Trainer) is estimator/loop.py: its inputs, scalars, what its Python code keeps, and which phases
it has. Full backward hooks the job's code puts on the decoder layers (TrainingSpec.layer_backward_hooks) wrap each
layer of the forwards they cover (estimator/layer_hooks.py).

cuBLAS: a thread's first matmul creates its handle's workspace from torch's caching allocator
(aten/src/ATen/cuda/CublasHandlePool.cpp getCurrentCUDABlasHandle: handles are per thread; 32 MiB on Hopper),
kept for the process's life: one at the first forward matmul, one at the first backward matmul (the autograd
engine's device thread, right after that gemm's output: Autograd.backward_matmul, called by blocks_linear.linear's
backward). The measured rows show it: 32 MiB more before the first layer's forward than the model allocates,
32 MiB more by step 0's end; the allocation traces place the second one after the lm_head's weight grad.
"""

from __future__ import annotations

import itertools

from ..ledger import Ledger
from ..specs import Job
from ..units import MiB, dtype_bytes
from .autograd import Autograd
from .bf16opt import BF16Optimizer
from .families import forward as forward_of
from .flat_groups import FlatGroup
from .layer_hooks import LayerBackwardHooks
from .optim import Optimizer
from .peft_linear import adapter_tensors, build_adapters, cast_adapters
from .places import Places
from .states import fp32_accumulation, picks_bf16_optimizer
from .timing import GEMM, GEMM_FP32
from .transformer import Net, Params, Shape
from .zero0 import Zero0
from .zero3 import Zero3
from .zero12 import Zero12

#: a cuBLAS handle's workspace (CublasHandlePool.cpp getChosenWorkspaceSize: 32 MiB on sm90)
CUBLAS_WORKSPACE_BYTES = 32 * MiB


def _trainable(job: Job):
    """Whether a parameter name trains (frozen groups and LoRA bases do not; LoRA's adapters do)."""
    from .train_set import job_train_set

    trains = {t.name: tr for t, tr in job_train_set(job.training, job.model).tensors}
    return lambda name: trains.get(name, False)


def _adapter_bytes(job: Job) -> int:
    """Bytes per element of the adapter weights once deepspeed.initialize has run (lora.adapter_dtype_bytes)."""
    from .lora import adapter_dtype_bytes

    return adapter_dtype_bytes(job.training)


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


def engine_for(L: Ledger, job: Job, trainable, places: Places, every: list[tuple[str, int]] | None = None,
               dp_rank: int = 0):
    """The ZeRO stage's engine model over ``every`` (name, numel) in ``parameters()`` order (default: the whole
    model's, each LoRA adapter after its base layer's weight: train_set.train_set; a pipeline stage passes its own),
    seen from data-parallel rank ``dp_rank`` (whose ZeRO-1/2 partition it keeps)."""
    from .train_set import job_train_set

    t, z, lay = job.training, job.training.zero, job.layout
    b = dtype_bytes(t.dtype)
    if every is None:
        every = [(p.name, p.numel) for p, _ in job_train_set(t, job.model).tensors]
    names = [k for k, _ in every if trainable(k)]
    numels = [n for k, n in every if trainable(k)]
    opt = Optimizer(t.optimizer, on_gpu=z.offload_optimizer == "none", host=places)
    # the engine's communication_data_type: seq_parallel_communication_data_type once Ulysses is on
    # (DeepSpeedEngine.__init__: ``self.communication_data_type = self._config.seq_parallel_communication_data_type``
    # when sequence_parallel_size > 1), else the training dtype (no communication_data_type in the config)
    comm = dtype_bytes(t.sp_comm_dtype) if lay.sp > 1 else b
    if picks_bf16_optimizer(job):  # stage 1 with fp32 accumulation, or stage 0 in bf16 under pp
        return BF16Optimizer(L, names, numels, b, dtype_bytes(t.grad_accum_dtype or t.dtype), comm, lay.zero_group,
                             opt)
    if z.stage == 0:
        return Zero0(L, names, numels, b, opt, lay.world)
    if z.stage in (1, 2):
        group = FlatGroup(names, numels, lay.zero_group, dp_rank)
        # allreduce_bucket communicates in fp32 whenever sequence_parallel_size > 1, whatever
        # seq_parallel_communication_data_type says (stage_1_and_2.py: ``communication_data_type = torch.float32``)
        zero_comm = 4 if lay.sp > 1 else b
        # _configure_zero_optimizer turns overlap_comm off for a PipelineModule ("Pipeline parallelism does not
        # support overlapped communication, will be disabled.")
        return Zero12(L, z.stage, [group], b, z.reduce_bucket_size, z.overlap and lay.pp == 1, t.grad_accum, opt,
                      zero_comm, offload=z.offload_optimizer != "none", pipeline=lay.pp > 1,
                      compact=fp32_accumulation(job))
    all_names = [k for k, _ in every]
    all_numels = [n for _, n in every]
    # the trainable parameters' dtype (stage3.py: self.dtype, the first group's): fp32 adapters under zero.Init
    tb = _adapter_bytes(job) if adapter_tensors(job) else b
    g = dtype_bytes(t.grad_accum_dtype or t.dtype)  # DeepSpeedEngine.get_data_types: the model dtype by default
    widths = {k: b for k, _ in every if ".lora_" not in k} if tb != b else None
    engine = Zero3(places, all_names, all_numels, set(names), lay.zero_group, tb, g, z, opt, comm, t.grad_accum,
                   t.dtype == "fp16", widths)
    # peft's PeftModelForCausalLM calls its LoraModel, which calls the *ForCausalLM: two more parameter-less
    # modules above the base model, each hooked (a fetch at the forward's start, a wrap of the outputs)
    engine.wrapper_modules = 2 if t.lora is not None else 0
    return engine


def shape(job: Job) -> Shape:
    t, lay = job.training, job.layout
    return Shape(t.micro_batch, t.seq_len // lay.sp, t.seq_len, dtype_bytes(t.dtype), positions_given=lay.sp > 1)


def build_ledger(job: Job, steps: int = 3, skipped=(), *, host: Ledger | None = None, cpu_run: bool = False
                 ) -> Ledger:
    """The job's allocation ledger on rank 0 (see the module docstring). ``skipped``: the optimizer steps
    (indices) the fp16 loss scaler skips on overflow (no optimizer state exists until one succeeds). ``host``:
    a ledger that receives the rank's host allocations (estimator/places.py); ``cpu_run``: the allocations of
    a DS_ACCELERATOR=cpu run instead, host and device in one ledger (the CPU trace comparison)."""
    from .loop import TrainerLoop, make_loop
    from .train_set import job_train_set

    skipped = frozenset(skipped)
    t = job.training
    L = Ledger()
    L.mark("init")
    trainable = _trainable(job)
    places = Places(L, host, cpu_run)
    engine = engine_for(L, job, trainable, places)
    adapters = adapter_tensors(job)
    if isinstance(engine, Zero3):
        from ..params import parameter_tensors

        engine.build([(p.name, p.numel) for p in parameter_tensors(job.model)])
        if job.model.tie_word_embeddings:  # the *ForCausalLM's own lm_head, before post_init ties it
            engine.build_replaced("lm_head.weight (before tie_weights)", parameter_tensors(job.model)[0].name)
        # peft's adapters, made after zero.Init, are partitioned as deepspeed.initialize wraps the model
        # (DeepSpeedZeRoOffload converts the parameters without a ds_id)
        engine.partition(list(adapters), build_adapters(L, adapters, dtype_bytes(t.dtype)))
        ids = {}
    else:
        ids = build_model(L, job)
        adapter_ids = build_adapters(L, adapters, dtype_bytes(t.dtype))
    hooks = engine if isinstance(engine, Zero3) else None
    workspaces = []

    def workspace():
        workspaces.append(L.alloc("cublas.workspace", CUBLAS_WORKSPACE_BYTES, "cuda_workspaces"))

    def on_param_grad(param, grad):
        engine.on_param_grad(ag, param, grad)

    ag = Autograd(L, on_param_grad=on_param_grad)
    ag.backward_matmul = workspace  # the autograd engine thread's own cuBLAS handle
    ag.elem_bytes = dtype_bytes(t.dtype)
    ag.gemm_kernel = GEMM_FP32 if t.dtype == "fp32" else GEMM
    if isinstance(engine, Zero3):
        def saved_param_release(name: str) -> None:  # the node that saved the parameter released it
            engine.free_retained(name)
            ag.saved_param_views.discard(name)
        ag.on_saved_param_release = saved_param_release
    loop = make_loop(L, ag, job)
    if isinstance(loop, TrainerLoop):
        loop.before_initialize()
    if adapters and not isinstance(engine, Zero3):
        ids.update(cast_adapters(L, adapters, adapter_ids, dtype_bytes(t.dtype)))
    engine.initialize(ids)
    if isinstance(loop, TrainerLoop):
        loop.after_initialize()
    ag.before_matmul = workspace
    ab = _adapter_bytes(job)
    lora = t.lora
    params = Params(ag, job.model, dtype_bytes(t.dtype), trainable, tuple((k, n * ab) for k, n in adapters), ab,
                    lora.rank if lora else 0, lora.dropout if lora else 0.0,
                    job_train_set(t, job.model).wrapped if lora else None)
    s = shape(job)
    layer_fn = None
    if t.checkpointing == "full":
        from .checkpoint import nonreentrant

        layer_fn = nonreentrant(ag)

    micro_steps = itertools.count()  # each forward's micro-step index (TrainingSpec.layer_hooks_in)

    def forward():
        if hooks is not None:
            hooks.start_forward()
        net = Net(ag, job.model, s, params, hooks, layer_fn, attention=t.attention, dtype=t.dtype)
        net.input_require_grads = t.checkpointing != "none"  # gradient_checkpointing_enable's hook
        if t.layer_hooks_in(next(micro_steps)):
            net.layer_hooks = LayerBackwardHooks()
        out = forward_of(net)
        out = out if hooks is None else hooks.end_forward(ag, out)
        out.leaves = ag.take_leaves()
        return out

    stepped = []

    def step(index: int, boundary: bool) -> None:
        if not boundary:
            return
        if index in skipped:
            engine.skip(ag)
            return
        first = not stepped
        stepped.append(index)
        if isinstance(engine, (Zero0, BF16Optimizer)):
            engine.step(ag, first)
        else:
            engine.step(first)

    loop.run(steps, forward, engine, step)
    return L
