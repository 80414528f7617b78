"""Pipeline parallelism on the ledger: one stage of memplan.verify's PipelineModule under DeepSpeed 0.19.8's
PipelineEngine (runtime/pipe/engine.py), as allocation events.

The stage (pipe_schedule.stage_specs over the specs embedding, positions, decoder layers, final norm, head) is
built on the GPU in the training dtype, one allocation per parameter in spec order (PipelineModule._build; a tied
embedding is a TiedLayerSpec on the first and the last stage, registered first in ``parameters()``), then
deepspeed.initialize wraps it in the stage's optimizer (program.engine_for: BF16_Optimizer for bf16 at stage 0,
DeepSpeedZeroOptimizer at stage 1, FP16_Optimizer otherwise). ``train_batch`` runs TrainSchedule's instructions
(pipe_schedule.train_instructions) and each is a phase named as memplan.verify.pipeline.InstructionPhases names
it (what each instruction allocates and keeps: estimator/pipeline_instructions.py). Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ledger import Ledger
from ..specs import Job
from ..units import dtype_bytes
from . import pipe_schedule as P
from .autograd import Autograd
from .pipeline_instructions import PipeStage

#: optimizer steps a stage's ledger runs: all three verify measures (as estimator.LEDGER_STEPS). For the caching
#: allocator a later step is not a repeat of the second: the in-flight micro-batches' activations land in other
#: free blocks each step, so reserved memory still grows at the third
#: (the H200 row s4-084, Mistral-7B pp 4: 28.9, 32.6, 36.1 GiB at the end of each step; the ledger replays it
#: within 0.3 %)
PIPELINE_STEPS = 3
#: micro-batches per step `plan` confirms a pipeline candidate with (at least; see steady_state_job)
PLAN_MICRO_BATCHES = 8


def steady_state_job(job: Job) -> Job:
    """The job with its micro-batches per step cut to what shows 1F1B's whole pattern, for `plan`'s
    confirmations: the warm-up fills the first stage's pp in-flight micro-batches, each steady unit (one forward,
    one backward) after the first backward issues the same allocations, then the cool-down; so max(2·pp + 2,
    PLAN_MICRO_BATCHES) micro-batches hold every distinct unit and the peak allocated is the whole job's but for
    the last stage's per-micro-batch losses (``fwd_outputs``: one 512-byte block each, kept for the batch; a
    few KiB, on tiny Llama / GPT-2 / Qwen3 stacks at 19–25 micro-batches). Reserved memory may still grow over
    more steady units (the
    free lists drift: the allocator's state does not repeat within 32 of them on a tiny Llama), so the estimate
    of one job always builds them all; `plan` says when it confirmed a pipeline row this way."""
    keep = max(2 * job.layout.pp + 2, PLAN_MICRO_BATCHES)
    if job.layout.pp == 1 or job.training.grad_accum <= keep:
        return job
    return job.model_copy(update={"training": job.training.model_copy(update={"grad_accum": keep})})


@dataclass(frozen=True, slots=True)
class Stage:
    """One pipeline stage of the job: its index, its decoder layers and whether it holds the ends."""

    index: int
    stages: int
    layers: tuple[int, ...]
    embedding: bool  # the token embedding (the first stage; a tied one on the last too)
    positions: bool  # the positions spec (GPT-2: wpe and the embedding dropout)
    head: bool  # the final norm, the head and the loss (the last stage)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.stages - 1


#: the families memplan.verify's pipeline builder stacks (verify/pipeline.py SUPPORTED_FAMILIES)
FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gpt2"})


def pipeline_modelled(job: Job) -> bool:
    """Whether the stage ledger models this pp job: the builder's families, DeepSpeed's pipeline ZeRO stages
    (0 and 1: PipelineEngine asserts below ZeRO-2), sdpa or flash (the stages pass no mask), no checkpointing,
    tp, sp, adapters or frozen parameters, and the optimizers the ledger ports."""
    t, lay, m = job.training, job.layout, job.model
    return (m.family in FAMILIES and t.zero.stage <= 1 and t.attention != "eager" and t.checkpointing == "none"
            and lay.tp == 1 and lay.sp == 1 and t.lora is None and not t.freeze and t.model_impl == "transformers"
            and t.zero.offload_optimizer == "none" and t.zero.offload_param == "none"
            and t.optimizer in ("adamw", "torch_adamw", "torch_adamw_fused", "sgd", "lion")
            and not (t.zero.stage == 1 and t.grad_accum_dtype == "fp32"))


def stage_of(job: Job, index: int) -> Stage:
    """Stage ``index`` of the job's PipelineModule (memplan.verify.pipeline.layer_specs: embedding, positions,
    decoder layers, final norm, head; partitioned by ``type:``)."""
    L, pp = job.model.num_layers, job.layout.pp
    start, stop = P.stage_specs(2, L, 2, pp)[index]
    layers = tuple(i - 2 for i in range(start, stop) if 2 <= i < L + 2)
    head = stop > L + 3 - 1  # the head spec (index L + 3) is on this stage
    embedding = start == 0 or (head and job.model.tie_word_embeddings)
    return Stage(index, pp, layers, embedding, start <= 1 < stop, head)


def stage_parameters(job: Job, stage: Stage) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(built, registered): the stage's parameters in the order they are allocated (spec order) and in
    ``module.parameters()`` order (the tied embedding first: PipelineModule's tied_modules ModuleDict is
    registered before the layers)."""
    from ..params import parameter_tensors

    m = job.model
    tensors = parameter_tensors(m)
    embed = tensors[0]
    wpe = [t for t in tensors if t.name == "transformer.wpe.weight"]
    body = [t for t in tensors if t.layer in stage.layers]
    ends = [t for t in tensors if t.layer is None and t is not embed and t not in wpe]
    built: list[tuple[str, int]] = []
    if stage.first:
        built.append((embed.name, embed.numel))
    if stage.positions:
        built += [(t.name, t.numel) for t in wpe]
    built += [(t.name, t.numel) for t in body]
    if stage.head:
        built += [(t.name, t.numel) for t in ends]  # final norm, then lm_head when untied
        if m.tie_word_embeddings:
            built.append((embed.name, embed.numel))
    if m.tie_word_embeddings and stage.embedding:
        registered = [(embed.name, embed.numel)] + [x for x in built if x[0] != embed.name]
    else:
        registered = list(built)
    return built, registered



def instruction_labels(instructions: list[tuple[str, int]], step: int) -> list[str]:
    """The phase of each instruction, as memplan.verify.pipeline.InstructionPhases names it:
    ``step{s}.micro{m}.forward`` / ``.backward`` (m counts the stage's own), ``step{s}.step``, and
    ``step{s}.i{k}.<instruction>`` (k its index in the batch's schedule) for the rest."""
    counts = {P.FORWARD: 0, P.BACKWARD: 0}
    out = []
    for k, (kind, _buf) in enumerate(instructions):
        if kind in counts:
            out.append(f"step{step}.micro{counts[kind]}.{kind.split('_')[0]}")
            counts[kind] += 1
        elif kind == P.OPTIMIZER_STEP:
            out.append(f"step{step}.step")
        else:
            out.append(f"step{step}.i{k:02d}.{kind}")
    return out


def build_pipeline_ledger(job: Job, stage_index: int, steps: int = 3, skipped=(), *, cpu_run: bool = False
                          ) -> Ledger:
    """Stage ``stage_index``'s allocation ledger: the stage built, deepspeed.initialize, ``steps`` train_batch
    calls (see the module docstring). ``skipped``: optimizer steps the fp16 loss scaler skips."""
    from .bf16opt import BF16Optimizer
    from .pipeline_stage import stage_forward
    from .places import Places
    from .program import CUBLAS_WORKSPACE_BYTES, engine_for, shape
    from .transformer import Net, Params, Shape
    from .zero0 import Zero0

    skipped = frozenset(skipped)
    t = job.training
    b = dtype_bytes(t.dtype)
    stage = stage_of(job, stage_index)
    built, registered = stage_parameters(job, stage)
    L = Ledger()
    L.mark("init")
    ids = {}
    for name, numel in built:  # PipelineModule._build under torch.device(device), default dtype the train dtype
        if name not in ids:
            ids[name] = L.alloc(name, numel * b, "params_16bit")
    # the rank measured: the first stage's first (global rank 0), the last stage's last (world - 1, as verify's
    # runner emulates it): PipeDataParallelTopology numbers ranks stage-major, so its data-parallel rank is dp - 1
    dp_rank = job.layout.dp - 1 if stage.last else 0
    engine = engine_for(L, job, lambda name: True, Places(L, None, cpu_run), registered, dp_rank)
    engine.initialize(ids)
    workspaces: list[int] = []

    def workspace() -> None:
        if len(workspaces) < 2 and not cpu_run:  # no cuBLAS on the CPU accelerator
            workspaces.append(L.alloc("cublas.workspace", CUBLAS_WORKSPACE_BYTES, "cuda_workspaces"))

    def first_matmul() -> None:
        if not workspaces:
            workspace()

    def on_grad(param, grad) -> None:
        if len(workspaces) == 1 or (cpu_run and not workspaces):  # the first grad: the first backward matmul, on the autograd engine's thread
            workspace()
        engine.on_param_grad(current[0], param, grad)

    current: list = [None]
    params = Params(Autograd(L), job.model, b, lambda name: True)
    base = shape(job)
    s = Shape(base.batch, base.seq, base.attn_seq, b, positions_given=True)  # rotary rows: the [B, S] ids

    def net_of(ag: Autograd) -> Net:
        current[0] = ag
        return Net(ag, job.model, s, params, attention=t.attention, dtype=t.dtype, device="cpu" if cpu_run else "cuda")

    pipe = PipeStage(L, job, stage, engine, lambda ag, ins, p: stage_forward(ag, ins, p, net_of), on_grad,
                     first_matmul, s)
    pipe.cpu_run = cpu_run
    stepped: list[int] = []
    instructions = P.train_instructions(stage.stages, stage.index, t.grad_accum)
    for step in range(steps):
        L.mark(f"step{step}.setup")
        for (kind, buf), label in zip(instructions, instruction_labels(instructions, step)):
            L.mark(label)
            if kind == P.LOAD:
                pipe.load(buf)
            elif kind == P.RECV_ACT:
                pipe.recv_activation(buf)
            elif kind == P.FORWARD:
                pipe.forward(buf)
            elif kind == P.SEND_ACT:
                pipe.send_activation(buf)
            elif kind == P.RECV_GRAD:
                pipe.recv_grad(buf)
            elif kind == P.BACKWARD:
                current[0] = pipe.graphs[buf][0]
                pipe.backward(buf)
            elif kind == P.SEND_GRAD:
                pipe.send_grad(buf)
            elif kind == P.REDUCE_GRADS:
                engine.end_backward(pipe.host, True)
            elif kind == P.OPTIMIZER_STEP:
                if step in skipped:
                    engine.skip(pipe.host)
                else:
                    first = not stepped
                    stepped.append(step)
                    if isinstance(engine, (Zero0, BF16Optimizer)):
                        engine.step(pipe.host, first)
                    else:
                        engine.step(first)
        pipe.end_batch()
    return L
