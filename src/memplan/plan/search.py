"""`search(space) -> PlanResult`: every valid configuration, its memory (the estimator's fast path) and its
step time (perf.step_time); the feasible ones ranked by step time, the closest misses kept for the report.

Speed: layouts, ZeRO sections and attention implementations are validated once (one Job each, by the Job
validator: space.job_problem) and candidate Jobs are assembled with `model_construct`. Pruning, in memory-saving order:
- micro-batches ascend; once one misses the target, larger ones are skipped (activations only grow) — except
  the largest (fewest micro-steps), which is evaluated too: a single micro-step drops ZeRO-2's second
  gradient buffer, so memory need not grow all the way;
- checkpointing goes full → selective → none; if the smallest micro-batch misses under one, the ones that keep
  more activations are skipped;
- host RAM / NVMe needs do not depend on the micro-batch, checkpointing or attention: one miss skips the rest
  of that ZeRO / offload combination.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import NamedTuple

from ..optimizers import optimizer_run
from ..specs import Job, Layout, TrainingSpec, ZeroSpec
from .candidate import Candidate, PlanResult, make_candidate, with_time
from .perf import ModelCosts, model_costs
from .space import ATTENTION_ORDER, CHECKPOINTING_ORDER, OFFLOAD_ORDER, PlanSpace, divisors, job_problem

PeakFn = Callable[[Job], "object"]


def default_peak_fn(gpu=None) -> PeakFn:
    """The estimator's figure for one job: memplan.estimator.quick_peak (no typed breakdown; the allocation
    ledger where it models the job), timed on ``gpu`` (a memplan.gpus.GpuSpec; None: the reference GPU)."""
    from ..estimator import quick_peak
    from ..estimator.pipeline import steady_state_job

    def peak(job: Job, **kw):  # a pipeline candidate through its steady state (pipeline.steady_state_job)
        return quick_peak(steady_state_job(job), gpu=gpu, **kw)

    return peak


def default_screen_fn() -> PeakFn:
    """What every candidate is screened with: memplan.estimator.screen_peak (the phase-list model)."""
    from ..estimator import screen_peak

    return screen_peak


class _Combo(NamedTuple):
    """A valid layout with a valid ZeRO section: everything but checkpointing, attention and micro-batch."""

    layout: Layout
    training: TrainingSpec  # a template: seq, dtype, optimizer and ZeRO section set


def _replace(template, **changes):
    """A copy of a constructed spec with some fields changed, without validation (pydantic's __copy__ then a
    __dict__ update, what model_copy(update=...) does): only for values space.*_problem already checked."""
    out = template.__copy__()
    out.__dict__.update(changes)
    return out


def _count(invalid: dict[str, int], problem: str) -> None:
    invalid[problem] = invalid.get(problem, 0) + 1


def _training(space: PlanSpace, pp: int, zero: ZeroSpec, attention: str = "sdpa") -> TrainingSpec:
    """The training template of a combination (validated): DeepSpeed's optimizer for the offload, Megatron's GPT
    as --emit writes it for a megatron plan (memplan.check.megatron_model.megatron_spec)."""
    extra = {}
    if space.model_impl == "megatron":
        from ..check.megatron_model import megatron_spec

        extra = {"model_impl": "megatron", "megatron": megatron_spec(space.model, pp)}
    return TrainingSpec(seq_len=space.seq_len, dtype=space.dtype, zero=zero, attention=attention,
                        optimizer=optimizer_run("adamw", zero.offload_optimizer), lora=space.lora,
                        freeze=space.freeze, **extra)


def _validated(space: PlanSpace, layout: Layout, zero: dict, attention: str = "sdpa") -> Job:
    """The Job of a combination, validated in full (raises pydantic's ValidationError: space.job_problem)."""
    return Job(model=space.model, training=_training(space, layout.pp, ZeroSpec(**zero), attention),
               layout=Layout(**layout.__dict__))


def _layouts(space: PlanSpace, invalid: dict[str, int]) -> Iterator[Layout]:
    max_tp, max_pp, max_sp = space.caps()
    for tp in divisors(space.world):
        for pp in divisors(space.world // tp):
            for sp in divisors(space.world // (tp * pp)):
                if tp > max_tp or pp > max_pp or sp > max_sp:
                    continue
                layout = Layout.model_construct(world=space.world, gpus_per_node=space.gpus_per_node, tp=tp, pp=pp,
                                                sp=sp, tp_sequence_parallel=False)
                problem = job_problem(partial(_validated, space, layout, {}))
                if problem is None and space.global_batch % layout.dp:
                    problem = "global batch not divisible by dp"
                if problem:
                    _count(invalid, problem)
                    continue
                yield layout


def _combos(space: PlanSpace, invalid: dict[str, int]) -> Iterator[_Combo]:
    devices = [d for d in OFFLOAD_ORDER if d in space.offload_devices]
    for layout in _layouts(space, invalid):
        for stage in space.zero_stages:
            for oo in devices:
                for op in devices:
                    # overlap_comm written out as DeepSpeed resolves it, as the emitted config says it
                    zero = ZeroSpec.model_construct(stage=stage, offload_optimizer=oo, offload_param=op,
                                                    overlap_comm=stage == 3)
                    problem = job_problem(partial(_validated, space, layout, zero.__dict__))
                    if problem:
                        _count(invalid, problem)
                        continue
                    yield _Combo(layout, _training(space, layout.pp, zero))


def attentions(space: PlanSpace, combo: _Combo) -> list[str]:
    """The attention implementations of the space the Job validator accepts for this combination (Megatron has
    no sdpa path: its unfused CoreAttention is memplan's eager)."""
    out = []
    for a in ATTENTION_ORDER:
        if a not in space.attention or (space.model_impl == "megatron" and a == "sdpa"):
            continue
        zero = combo.training.zero.__dict__
        if job_problem(partial(_validated, space, combo.layout, zero, a)):
            continue
        out.append(a)
    return out


class _Evaluator:
    """Builds a candidate Job and runs the estimator and the perf model on it."""

    def __init__(self, space: PlanSpace, peak_fn: PeakFn, confirming: bool = False):
        self.space, self.peak_fn, self.confirming = space, peak_fn, confirming
        self.costs: ModelCosts = model_costs(space.model, space.seq_len)
        training = TrainingSpec.model_construct(seq_len=space.seq_len, dtype=space.dtype)
        self.job_template = Job.model_construct(model=space.model, training=training, layout=Layout.model_construct())
        self.count = 0
        self._attentions: dict[int, list[str]] = {}

    def attentions(self, combo: _Combo) -> list[str]:
        """attentions(space, combo), once per sp degree (what decides it besides the space's fixed facts)."""
        key = combo.layout.sp
        if key not in self._attentions:
            self._attentions[key] = attentions(self.space, combo)
        return self._attentions[key]

    def job(self, combo: _Combo, checkpointing: str, attention: str, micro: int) -> Job:
        accum = self.space.global_batch // (combo.layout.dp * micro)
        training = _replace(combo.training, micro_batch=micro, grad_accum=accum, checkpointing=checkpointing,
                            attention=attention)
        return _replace(self.job_template, training=training, layout=combo.layout)

    def __call__(self, combo: _Combo, checkpointing: str, attention: str, micro: int) -> Candidate:
        self.count += 1
        job = self.job(combo, checkpointing, attention, micro)
        cand = make_candidate(self.space, job, self.peak_fn(job), self.costs, timed=False)
        return cand._replace(confirmed=False) if self.confirming else cand

    def maybe(self, cand: Candidate) -> bool:
        """A screened miss the confirmation may still find fitting (memplan.plan.confirm.is_maybe)."""
        from .confirm import is_maybe

        return self.confirming and is_maybe(self.space, cand)


def _micro_batches(space: PlanSpace, dp: int) -> list[int]:
    per_replica = space.global_batch // dp
    return [m for m in divisors(per_replica) if m <= space.max_micro_batch]


def _micro_chain(combo: _Combo, ckpt: str, attention: str, micros: list[int], evaluate: _Evaluator,
                 prune: bool) -> tuple[list[Candidate], int]:
    """Micro-batches ascending for one (combo, checkpointing, attention): (evaluated, skipped).

    A host RAM / NVMe miss stops the chain at once (the caller skips the rest of the combination). A target
    miss skips the larger micro-batches except the largest.
    """
    out: list[Candidate] = []
    for j, micro in enumerate(micros):
        cand = evaluate(combo, ckpt, attention, micro)
        out.append(cand)
        rest = micros[j + 1:]
        if cand.fits or not prune or not rest or evaluate.maybe(cand):
            continue
        if _budget_miss(cand):
            return out, len(rest)
        out.append(evaluate(combo, ckpt, attention, rest[-1]))
        return out, len(rest) - 1
    return out, 0


def _budget_miss(cand: Candidate) -> bool:
    return "host RAM" in cand.misses or "NVMe" in cand.misses


def _search_combo(space: PlanSpace, combo: _Combo, evaluate: _Evaluator, prune: bool) -> tuple[list[Candidate], int]:
    """All candidates of one combination, pruned as the module docstring says: (evaluated, skipped)."""
    micros = _micro_batches(space, combo.layout.dp)
    if not micros:
        return [], 0
    attentions = evaluate.attentions(combo)
    ckpts = [c for c in CHECKPOINTING_ORDER if c in space.checkpointing]
    out: list[Candidate] = []
    skipped = 0
    for ai, attention in enumerate(attentions):
        for ci, ckpt in enumerate(ckpts):
            cands, chain_skipped = _micro_chain(combo, ckpt, attention, micros, evaluate, prune)
            out += cands
            skipped += chain_skipped
            first = cands[0]
            if not prune or first.fits or evaluate.maybe(first):
                continue
            later_ckpts = (len(ckpts) - ci - 1) * len(micros)
            if _budget_miss(first):
                later_attentions = (len(attentions) - ai - 1) * len(ckpts) * len(micros)
                return out, skipped + later_ckpts + later_attentions
            skipped += later_ckpts  # the smallest micro-batch missed: keeping more activations cannot fit
            break
    return out, skipped


def search(space: PlanSpace, peak_fn: PeakFn | None = None, prune: bool = True, keep_closest: int = 20,
           top: int = 10, exact_fn: PeakFn | None = None) -> PlanResult:
    """Every valid configuration of ``space``; the feasible ones by step time (ties: less device memory).

    Without ``peak_fn`` every candidate is screened (default_screen_fn) and the first ``top`` rows are
    confirmed by the estimator (``exact_fn``, default_peak_fn; memplan.plan.confirm); a given ``peak_fn`` is
    taken as the estimator itself (nothing to confirm) unless ``exact_fn`` is given too."""
    if peak_fn is None:
        from ..gpus import timing_gpu

        peak_fn, exact_fn = default_screen_fn(), exact_fn or default_peak_fn(timing_gpu(space.hardware.name))
    evaluate = _Evaluator(space, peak_fn, confirming=exact_fn is not None)
    notes: tuple[str, ...] = ()
    if "selective" in space.checkpointing and not _selective_modelled(evaluate):
        space = space.model_copy(update={"checkpointing": tuple(c for c in space.checkpointing if c != "selective")
                                         or ("none",)})
        evaluate.space = space
        notes = (("checkpointing selective skipped: the estimator gives it the same memory as none "
                 "(not modelled yet)"),)
    invalid: dict[str, int] = {}
    feasible: list[Candidate] = []
    misses: list[Candidate] = []
    skipped = 0
    for combo in _combos(space, invalid):
        cands, combo_skipped = _search_combo(space, combo, evaluate, prune)
        skipped += combo_skipped
        for cand in cands:
            (feasible if cand.fits or evaluate.maybe(cand) else misses).append(cand)
    feasible = [with_time(space, c, evaluate.costs) for c in feasible]
    feasible.sort(key=_rank)
    runs = 0
    if exact_fn is not None:
        from .confirm import confirm

        shown, refused, runs, limited = confirm(space, feasible, exact_fn, top, evaluate.costs,
                                                lambda fits: len(_merge_attention(sorted(fits, key=_rank))))
        done = {id(c.job) for c in shown} | {id(c.job) for c in refused}
        rest = [c for c in feasible if id(c.job) not in done and c.fits]
        misses += refused
        feasible = sorted(shown, key=_rank) + rest
        if limited:
            notes = (*notes, (f"{len(shown)} rows confirmed by the estimator before its limit of {runs} runs; "
                              "the screened rows after them are not shown"))
        from ..estimator.pipeline import steady_state_job

        if any(steady_state_job(c.job) is not c.job for c in shown):
            notes = (*notes, ("pipeline rows were confirmed through their steady state (fewer micro-batches per "
                              "step, the same 1F1B pattern): peak allocated within a few KiB of the whole job's, "
                              "reserved possibly lower; `memplan estimate` on a row builds every micro-batch"))
    n_feasible = len(feasible)
    feasible = _merge_attention(feasible)
    misses.sort(key=lambda c: (_overshoot(space, c), c.device_total_bytes))
    misses = _merge_attention([c if c.step is not None else with_time(space, c, evaluate.costs)
                               for c in misses[:2 * keep_closest]])
    return PlanResult(space=space, candidates=tuple(feasible), closest=tuple(misses[:keep_closest]),
                      searched=evaluate.count + skipped, evaluated=evaluate.count, feasible=n_feasible,
                      invalid=invalid, notes=notes, confirmed=runs)


def _rank(c: Candidate) -> tuple[float, int]:
    return c.step_time_s, c.device_total_bytes


def _selective_modelled(evaluate: _Evaluator) -> bool:
    """Whether the estimator tells selective checkpointing from none (a probe: one layout, micro-batch 1)."""
    s = evaluate.space
    layout = Layout.model_construct(world=s.world, gpus_per_node=s.gpus_per_node)
    if s.global_batch % layout.dp:
        return True  # cannot probe; keep the user's choice
    combo = _Combo(layout, _training(s, 1, ZeroSpec(stage=3)))
    attention = "eager" if s.model_impl == "megatron" else "sdpa"
    peaks = [evaluate.peak_fn(evaluate.job(combo, ckpt, attention, 1)) for ckpt in ("selective", "none")]
    return peaks[0].peak_allocated_bytes != peaks[1].peak_allocated_bytes


def _merge_attention(rows: list[Candidate]) -> list[Candidate]:
    """One row per configuration that differs only in an attention implementation with identical memory and
    step time (flash and sdpa often are): the first in ATTENTION_ORDER stays, the others are named in it."""
    kept: dict[tuple, int] = {}
    out: list[Candidate] = []
    for c in rows:
        key = (c.zero, c.tp, c.pp, c.sp, c.offload_optimizer, c.offload_param, c.checkpointing, c.micro_batch,
               c.device_total_bytes, c.peak_allocated_bytes, c.host_bytes_per_node, c.nvme_bytes_per_node,
               c.step_time_s)
        if key in kept:
            i = kept[key]
            first, second = sorted((out[i], c), key=lambda x: ATTENTION_ORDER.index(x.attention))
            out[i] = first._replace(same_as_attention=(*first.same_as_attention, second.attention))
            continue
        kept[key] = len(out)
        out.append(c)
    return out


def _overshoot(space: PlanSpace, c: Candidate) -> float:
    """How far a miss is from fitting, as the worst ratio of need to budget (1.0 = just fits)."""
    return max(c.device_total_bytes / space.target_bytes, c.host_bytes_per_node / space.host_ram_bytes_per_node,
               c.nvme_bytes_per_node / max(1, space.nvme_bytes_per_node))
