"""The per-GPU memory estimator: phases of a step → the peak and its breakdown (pure, no torch)."""

from __future__ import annotations

from operator import itemgetter
from typing import NamedTuple

from ..result import Estimate, Part, Phase
from ..specs import Job
from ..units import dtype_bytes
from .layout import rank_share
from .overheads import non_torch_bytes, reserved_bytes
from .phases import model_states, phases_and_states


class QuickPeak(NamedTuple):
    """The headline numbers without the typed breakdown (for `plan`'s hot loop)."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_total_bytes: int
    host_bytes_per_node: int
    nvme_bytes_per_node: int
    peak_phase: str
    #: peak reserved with the GPU a whole phase behind (estimator.gpu_behind); None: no record_stream frees
    peak_reserved_behind_bytes: int | None = None


def _ranks_per_node(job: Job) -> int:
    return min(job.layout.world, job.layout.gpus_per_node)


def ledger_supported(job: Job) -> bool:
    """Whether the allocation ledger (estimator/program.py) models this job yet; others use the phase lists."""
    from .families import FORWARD

    t, lay, m = job.training, job.layout, job.model
    if lay.pp > 1:
        from .pipeline import pipeline_modelled

        return pipeline_modelled(job)
    return (lay.tp == 1 and _sequence_parallel_modelled(job)
            and m.family in FORWARD and t.checkpointing != "selective" and not t.checkpoint_reentrant
            and t.checkpoint_every_n_layers == 1 and not t.checkpoint_offload and _adapter_modelled(job)
            and _attention_modelled(m, t.attention, t.seq_len, dtype_bytes(t.dtype), lay.sp > 1)
            and t.optimizer in ("adamw", "torch_adamw", "torch_adamw_fused", "sgd", "lion", "cpu_adam")
            and not _unmodelled_fp32_accumulation(job) and t.model_impl == "transformers"
            and not m.output_router_logits)  # the MoE auxiliary loss (load_balancing_loss_func) is not ported


#: families whose attention goes through llama.attend, where Ulysses' wrapper is modelled (estimator/ulysses.py;
#: event for event against the CPU trace of DeepSpeed's UlyssesSPAttentionHF on the fake process group)
ULYSSES_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "gemma2", "gemma3_text",
                              "phi3", "olmo2"})


def _sequence_parallel_modelled(job: Job) -> bool:
    """No sequence parallelism, or Ulysses in the DeepSpeed loops on a family above with sdpa or flash (DeepSpeed
    refuses eager; the Trainer's sp path is not the ledger's)."""
    t, lay = job.training, job.layout
    return lay.sp == 1 or (job.model.family in ULYSSES_FAMILIES and t.attention != "eager"
                           and t.loop != "hf-trainer")


def _adapter_modelled(job: Job) -> bool:
    """No adapter, or LoRA on linears as the ledger runs it (estimator/peft_linear.py: bias "none", no
    modules_to_save, no DoRA); what peft adapts through lora.ParamWrapper (MoE routers and fused experts:
    estimator/peft_param.py) under ZeRO 0–2 only (ZeRO-3's hooks around the parametrised experts are not
    ported)."""
    lora = job.training.lora
    if lora is None:
        return True
    from ..peftconfig import parameter_wrapper_targets
    from .peft_linear import ledger_models

    return ledger_models(lora) and (job.training.zero.stage < 3
                                    or not parameter_wrapper_targets(job.model.family, lora.targets))


def _attention_modelled(m, attention: str, seq: int | None = None, b: int = 2, mask_dropped: bool = False) -> bool:
    """Attention the ledger models: transformers' eager path in every ported family (its ops are the same on
    every device; event for event against the CPU trace, tests/test_ledger_trace.py) and sdpa with whichever
    kernel the one dispatch rule (blocks_attention.dispatch) picks: cuDNN, flash (never given a mask), the
    memory-efficient kernel and the math fallback (the kernels' outputs and workspaces as torch's source and
    the H200 traces give them, tests/test_attention_kernels.py; math is composite aten ops, which the CPU traces
    check with and without masks). A sliding window's mask goes to cuDNN where cuDNN takes the call (the H200
    trace of a Mistral job, trace-s1-049-mistral-7b-*, shows the converted mask saved, the philox seed and
    offset, cuDNN's backward workspace, with k and v repeat_kv'd), else to the memory-efficient kernel
    (head_dim 256, fp32: no trace, but the masked Gemma 2/3 and Phi-3 rows of the fit split agree to 0.1 %); a
    window no shorter than the sequence builds no mask (``seq``; ``b``: the dtype's bytes). BLOOM's own
    attention is eager whatever sdpa says."""
    from .activations import sdpa_backend, sdpa_dispatch

    if attention == "eager":
        return True
    if sdpa_backend(m, b, attention) == "eager":  # BLOOM: transformers runs its own attention
        return False
    kernel, masked = sdpa_dispatch(m, b, attention, seq, mask_dropped)
    return kernel in ("cudnn", "math", "efficient") or (kernel == "flash" and not masked)


def _unmodelled_fp32_accumulation(job: Job) -> bool:
    """fp32 gradient accumulation the ledger does not model yet: ZeRO-1 other than BF16_Optimizer (fp16, or
    offloaded: DeepSpeedZeroOptimizer's grad_accum attribute); BF16_Optimizer (bf16, ZeRO-1, no offload), ZeRO-2
    on the GPU and ZeRO-2 offloaded (its fp32 compact partition, zero12.Zero12 ``compact``) are modelled."""
    from .states import fp32_accumulation

    t, z = job.training, job.training.zero
    if not fp32_accumulation(job):
        return False
    offload = z.offload_optimizer != "none"
    return z.stage == 1 and (t.dtype != "bf16" or offload)


#: Optimizer steps the ledger runs: all three that verify measures (memplan.verify ``--steps`` default). Two looked
#: enough once (the third step allocates what the second does, tensor for tensor), but the cache a step leaves is
#: not always the one it found: a ZeRO-1 llama-3.2-1b cut to 3 layers at 256 tokens (tests/test_ledger_program.py)
#: reserves 0.49 GiB more in its third step's backward than in its second with the same events; expandable segments
#: and garbage collection drift the same way (llama1b-z3-s4k-w8-expandable's trace: +1.0 GiB in step 2), and so do
#: the frees the GPU's progress completes (estimator.gpu_time; lone2-s1-026's H100 trace: +0.98 GiB in step 2's
#: forward, which the timed replay of three steps reproduces to the byte).
LEDGER_STEPS = 3


def ledger_summary(job: Job, skipped=(), timeline: bool = True, card_bytes: int | None = None, gpu=None,
                   emulated: bool = False):
    """The job's ledger replayed and summarized (estimator.summary.LedgerSummary): built with its gradient
    accumulation folded where that is exact (estimator/fold.py), whole otherwise; timed on ``gpu`` (a
    memplan.gpus.GpuSpec, the reference GPU when None: estimator.gpu_time), as rank 0 emulated over torch's fake
    process group when ``emulated`` (memplan.verify's default: its collectives' copies cost the host)."""
    from .fold import folded
    from .program import build_ledger
    from .summary import allocator_config, summarize

    config = allocator_config(job, card_bytes)
    steps = LEDGER_STEPS
    if job.layout.pp > 1:  # the first and the last stage, each as verify emulates it; the most loaded one's
        from .pipeline import PIPELINE_STEPS, build_pipeline_ledger

        return max((summarize(job, build_pipeline_ledger(job, k, PIPELINE_STEPS, skipped), card_bytes, timeline,
                              gpu=gpu, emulated=emulated) for k in (0, job.layout.pp - 1)),
                   key=lambda x: x.peak_allocated_bytes)
    short = folded(job, lambda j, n, sk: build_ledger(j, steps=n, skipped=sk), steps, tuple(skipped), config)
    if short is None:
        return summarize(job, build_ledger(job, steps=steps, skipped=skipped), card_bytes, timeline, gpu=gpu,
                         emulated=emulated)
    return summarize(job, short[0], card_bytes, timeline, sim=short[1], gpu=gpu, emulated=emulated)


def ledger_trace(job: Job) -> dict | None:
    """The job's predicted ledger and its replay as Chrome trace-event JSON (memplan.allocator.chrome: counter
    tracks for allocated and reserved, one slice per tensor), or None when the ledger does not model the job.
    With gradient accumulation folded (estimator/fold.py) the trace shows the micro-steps actually built."""
    if not ledger_supported(job):
        return None
    from ..allocator import simulate
    from ..allocator.chrome import chrome_trace
    from .fold import folded
    from .program import build_ledger
    from .summary import allocator_config

    config = allocator_config(job)
    steps = LEDGER_STEPS
    if job.layout.pp > 1:  # the most loaded of the first and the last stage
        from .pipeline import PIPELINE_STEPS, build_pipeline_ledger

        runs = []
        for k in (0, job.layout.pp - 1):
            L = build_pipeline_ledger(job, k, PIPELINE_STEPS)
            runs.append((L, simulate(L, config), k))
        L, sim, stage = max(runs, key=lambda r: max(p.peak_allocated_bytes for p in r[1].phases))
        trace = chrome_trace(L, sim)
        trace["otherData"].update(job=job.model.name, pipeline_stage=stage, micro_steps=job.training.grad_accum,
                                  optimizer_steps=PIPELINE_STEPS)
        return trace
    short = folded(job, lambda j, n, sk: build_ledger(j, steps=n, skipped=sk), steps, (), config)
    L, sim = short if short is not None else (build_ledger(job, steps=steps), None)
    trace = chrome_trace(L, sim or simulate(L, config))
    built = sum(1 for m in L.marks if m.label.startswith("step0.") and m.label.endswith(".forward"))
    trace["otherData"].update(job=job.model.name, micro_steps_built=built,
                              micro_steps=job.training.grad_accum, optimizer_steps=steps)
    return trace


def _ledger_quick(job: Job, skipped, gpu=None, emulated: bool = False) -> QuickPeak:
    s = ledger_summary(job, skipped, timeline=False, gpu=gpu, emulated=emulated)
    st = model_states(job, rank_share(job))
    rpn = _ranks_per_node(job)
    return QuickPeak(s.peak_allocated_bytes, s.peak_reserved_bytes, s.peak_reserved_bytes + non_torch_bytes(job),
                     st.host_bytes * rpn, st.nvme_bytes * rpn, s.peak_phase, s.peak_reserved_behind_bytes)


def quick_peak(job: Job, rank0: bool = False, stepped: bool = True, skipped=None, gpu=None) -> QuickPeak:
    """Peak allocated, reserved, device total, host and NVMe per node, and the peak phase.

    ``rank0``: rank 0's figures instead of the most loaded rank's, as an emulated verify measures them (the
    ledger is rank 0's; its replay then also counts the fake process group's copies);
    ``stepped=False``: before the first successful optimizer step (see build_phases); ``skipped``: the indices
    of the measured steps the fp16 loss scaler skipped (the ledger models them); ``gpu``: the GPU it runs on (a
    memplan.gpus.GpuSpec; None: the reference GPU), which sets how far it runs behind the host
    (estimator.gpu_time)."""
    if ledger_supported(job):
        return _ledger_quick(job, (() if stepped else range(3)) if skipped is None else skipped, gpu, rank0)
    phases, st = phases_and_states(job, rank0, stepped)
    # the host and NVMe figures are the most loaded rank's, as in the ledger's path
    return _summary(job, phases, model_states(job, rank_share(job)) if rank0 else st)


def screen_peak(job: Job) -> QuickPeak:
    """The phase-list model alone (estimator/phases.py: closed forms per phase, microseconds a job): what
    `plan` screens its thousands of candidates with before quick_peak confirms the ones it shows
    (memplan.plan.confirm). Not the estimate: for the jobs the ledger models, quick_peak is."""
    return _summary(job, *phases_and_states(job))


_BYTES, _FIRST = itemgetter(1), itemgetter(0)  # a part's bytes; a (bytes, name, parts) triple's bytes


def _summary(job: Job, phases, st) -> QuickPeak:
    """The headline numbers of already built phases and the first stage's model states."""
    peak, name, parts = max(((sum(map(_BYTES, parts)), name, parts) for name, parts in phases), key=_FIRST)
    reserved = reserved_bytes(job, peak, parts)
    rpn = _ranks_per_node(job)
    return QuickPeak(peak, reserved, reserved + non_torch_bytes(job), st.host_bytes * rpn, st.nvme_bytes * rpn, name)


def measurement_notes(job: Job) -> tuple[str, ...]:
    """What in this job's figure rests on no measurement in benchmarks/accuracy/ (said in the output)."""
    t, z, lay = job.training, job.training.zero, job.layout
    notes = []
    in_ledger = ledger_supported(job)
    if not in_ledger:
        notes.append("this job is outside the allocation ledger (phase model): the caching allocator is not "
                     "simulated, so reserved memory is likely under what torch will reserve; a fit near the card's "
                     "size is unproven (benchmarks/accuracy: python -m memplan.accuracy)")
    if t.model_impl == "megatron":  # Megatron's GPT: its own notes (memplan.megatron.notes)
        from ..megatron import measurement_notes as megatron_notes

        notes += megatron_notes(job)
    if z.stage == 3 and in_ledger and z.overlap:
        notes.append("ZeRO-3: DeepSpeed frees gathered parameters and reduced gradients with record_stream, so the "
                     "caching allocator reuses them only once the GPU has caught up; peak reserved times that on "
                     "the --gpu (H200 when none is named) alone and with the host measured in benchmarks/timing "
                     "(estimator/gpu_time.py). A busier or slower GPU falls further behind and reserves more, up "
                     "to peak_reserved_gpu_behind_bytes (a whole phase behind); allocated memory is not affected")
    if "nvme" in (z.offload_optimizer, z.offload_param):
        notes.append("NVMe offload is modelled from DeepSpeed's code but not measured (no NVMe rows)")
    if t.checkpointing == "selective":
        notes.append("selective checkpointing is modelled (Korthikanti et al. 2022), not measured: transformers "
                     "offers full-layer checkpointing only")
    if lay.tp > 1 and (z.stage == 3 or t.checkpointing == "selective" or lay.pp > 1):
        notes.append("tp > 1 is measured as DeepSpeed AutoTP with ZeRO 0-2; this combination is modelled only")
    if lay.tp > 1 and lay.tp_sequence_parallel:
        notes.append("Megatron-style sequence parallelism (--tp-sequence-parallel) is modelled (Korthikanti et "
                     "al. 2022), not measured: DeepSpeed AutoTP, the measured tp, keeps activations whole")
    elif lay.tp > 1:
        notes.append("tp is modelled as DeepSpeed AutoTP (measured: replicated hidden states, vocabulary-parallel "
                     "loss); for Megatron-style sequence parallelism pass --tp-sequence-parallel")
    if lay.pp > 1 and (t.checkpointing != "none" or t.attention == "eager" or job.model.family not in (
            "llama", "mistral", "qwen2", "qwen3", "gpt2")):
        notes.append("pp is measured for Llama- and GPT-2-style stacks without checkpointing; this job is modelled")
    if lay.world > 1:
        notes.append("CUDA context and NCCL buffers are documented constants, not measured "
                     "(outside torch's allocator)")
    if t.dtype == "fp16":
        notes.append("fp16: the loss scaler may skip the first steps; until one succeeds no optimizer state exists "
                     "(the estimate is the steady state)")
    if t.lora is not None:
        from ..peftconfig import check_adapter_options, parameter_wrapper_targets

        try:
            check_adapter_options(job.model.family, t.lora.targets, t.lora.dropout)
        except ValueError as err:
            notes.append(f"this adapter does not start: {err} (memplan check reports it as an error)")
        if parameter_wrapper_targets(job.model.family, t.lora.targets) and z.stage == 3:
            notes.append("peft adapts the router and the fused experts through lora.ParamWrapper here: under "
                         "ZeRO-3 their parametrised expert weights are not modelled yet (the figure is low)")
    return tuple(notes)


def _ledger_estimate(job: Job, gpu=None, emulated: bool = False) -> Estimate:
    s = ledger_summary(job, gpu=gpu, emulated=emulated)
    st = model_states(job, rank_share(job))
    rpn = _ranks_per_node(job)
    return Estimate(
        job=job, peak_phase=s.peak_phase, components=s.components, timeline=s.timeline,
        peak_reserved_bytes=s.peak_reserved_bytes, peak_reserved_gpu_behind_bytes=s.peak_reserved_behind_bytes,
        non_torch_bytes=non_torch_bytes(job), host_bytes_per_node=st.host_bytes * rpn,
        nvme_bytes_per_node=st.nvme_bytes * rpn,
        notes=measurement_notes(job),
    )


def estimate_job(job: Job, gpu=None, emulated: bool = False) -> Estimate:
    """The full typed estimate: the breakdown at the peak and the timeline of phases; ``gpu`` (a
    memplan.gpus.GpuSpec, the reference GPU when None) is the GPU the job runs on (estimator.gpu_time);
    ``emulated``: rank 0 as memplan.verify emulates it on one GPU (the fake process group's copies timed)."""
    if ledger_supported(job):
        return _ledger_estimate(job, gpu, emulated)
    phases, st = phases_and_states(job)
    q = _summary(job, phases, st)
    timeline = tuple(
        Phase(name=name, parts=tuple(Part(name=p[0], bytes=p[1], detail=p[2]) for p in parts if p[1]))
        for name, parts in phases
    )
    peak_phase = next(ph for ph in timeline if ph.name == q.peak_phase)
    merged: dict[str, int] = {}
    details: dict[str, str] = {}
    for p in peak_phase.parts:
        merged[p.name] = merged.get(p.name, 0) + p.bytes
        details.setdefault(p.name, p.detail)
    components = tuple(Part(name=k, bytes=v, detail=details[k]) for k, v in merged.items())
    return Estimate(
        job=job, peak_phase=peak_phase.name, components=components, timeline=timeline,
        peak_reserved_bytes=q.peak_reserved_bytes, non_torch_bytes=q.device_total_bytes - q.peak_reserved_bytes,
        host_bytes_per_node=q.host_bytes_per_node, nvme_bytes_per_node=q.nvme_bytes_per_node,
        notes=measurement_notes(job),
    )
