"""The measured accuracy matrix: verify rows under benchmarks/accuracy/ held against the estimator.

Each row is one `memplan verify` report (JSON lines, one object a line) with the Job, the environment,
the exact command and the measured peaks. A row measured at reduced depth (``layers``) is compared at
each depth it was measured at, with the model cut to that many layers.

Rows drawn by memplan.verify.sample carry ``"split"``: "fit" (the model may be tuned on them) or "check"
(held out: the README quotes it); hand-written rows have none and report as HAND_WRITTEN. `by_group` gives
median and worst |error| per split or per loop. `python -m memplan.accuracy [--split fit|check] [--loop L]
[PATH ...]` prints the table (default: benchmarks/accuracy/).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .specs import Job

#: the split of a row that carries none (the hand-written matrices)
HAND_WRITTEN = "hand-written"
SPLITS = ("fit", "check")
#: the two models of estimator.quick_peak (Comparison.model)
LEDGER, PHASES = "ledger", "phases"


@dataclass(frozen=True)
class Comparison:
    """One measured job against its estimate."""

    name: str
    measured_bytes: int
    predicted_bytes: int
    measured_phase: str | None
    predicted_phase: str
    split: str = HAND_WRITTEN
    loop: str = "loss"
    measured_reserved_bytes: int | None = None  # torch.cuda.max_memory_reserved() (None: not recorded)
    predicted_reserved_bytes: int | None = None
    #: which model predicted it: LEDGER (the allocation ledger replayed through memplan.allocator) or PHASES
    #: (the phase lists, for jobs estimator.ledger_supported does not cover yet)
    model: str = "ledger"
    #: the caching allocator took its retry path while the row was measured (its phases' num_alloc_retries):
    #: a cudaMalloc failed because the processes sharing the GPU held the rest, and the cached blocks released
    #: then make the measured reserved a lower bound of what the job reserves alone
    reserved_lower_bound: bool = False
    #: the job frees with record_stream (ZeRO-3) and was measured on a GPU other processes shared (the batch's
    #: shared_gpu): they slowed the GPU, so it fell further behind the host than it does alone and its deferred
    #: frees completed later; the measured reserved is an upper bound of the job's own (benchmarks/accuracy/README.md,
    #: "ZeRO-3 jobs run alone"), and only a prediction above it is judged
    reserved_upper_bound: bool = False
    #: the job trains adapters on a frozen base (TrainingSpec.lora)
    adapters: bool = False
    #: the GPU-behind bound of peak reserved (estimator.gpu_behind; None where nothing is freed with record_stream)
    predicted_reserved_behind_bytes: int | None = None

    @property
    def error(self) -> float:
        """Signed relative error of the peak allocated prediction: (predicted − measured) / measured."""
        return (self.predicted_bytes - self.measured_bytes) / self.measured_bytes

    @property
    def reserved_error(self) -> float | None:
        """Signed relative error of the peak reserved prediction (None where the row recorded no reserved)."""
        if not self.measured_reserved_bytes or self.predicted_reserved_bytes is None:
            return None
        err = (self.predicted_reserved_bytes - self.measured_reserved_bytes) / self.measured_reserved_bytes
        # a lower bound judges only a prediction below it (an under that a lone run would make larger still), an
        # upper bound only one above it
        if (self.reserved_lower_bound and err >= 0) or (self.reserved_upper_bound and err < 0):
            return None
        return err

    @property
    def behind_error(self) -> float | None:
        """Signed relative error of the GPU-behind bound of peak reserved (None where it or the measurement is
        missing); a bound, so only its negative side is a failure."""
        if not self.measured_reserved_bytes or self.predicted_reserved_behind_bytes is None:
            return None
        return (self.predicted_reserved_behind_bytes - self.measured_reserved_bytes) / self.measured_reserved_bytes


def iter_rows(folder: Path) -> Iterator[dict]:
    """Every row of every rows*.jsonl file under ``folder`` (or of the file ``folder``), in file order."""
    from .inputs import read_json_lines

    paths = [folder] if folder.is_file() else sorted(folder.glob("rows*.jsonl"))
    for path in paths:
        for _, row in read_json_lines(path, "rows"):
            yield row


def job_of_row(row: dict) -> Job:
    """The row's Job, with a preset model resolved again from its preset (the config that really ran), so
    that fields the ModelSpec gained since the row was measured are filled from the same config.json."""
    from .errors import InputError
    from .presets import load_model

    raw = row.get("job") or {}
    training = raw.get("training", {}) if isinstance(raw, dict) else None
    if isinstance(training, dict) and "loop" not in training:
        # rows measured before verify ran other loops: its worker kept only the loss (``loss = engine(...).loss``)
        raw = {**raw, "training": {**training, "loop": "loss"}}
    job = Job.model_validate(raw)
    if isinstance(training, dict) and "layer_backward_hooks" not in training and _timeline_hooked(job):
        job = job.model_copy(update={"training": job.training.model_copy(update={"layer_backward_hooks": "first"})})
    try:
        model = load_model(job.model.name)
    except InputError:
        return job
    return job.model_copy(update={"model": model.model_copy(update={"num_layers": job.model.num_layers})})


def _timeline_hooked(job: Job) -> bool:
    """Whether verify's worker put full backward hooks on the decoder layers in the row's first micro-step: a row
    whose job has no layer_backward_hooks key was measured by a verify that marked the backward with
    register_full_backward_hook (TimelineHooks in verify/worker.py ``train`` before the key existed), wherever its
    DeepSpeed loops marked the backward (verify.phases.backward_marks) without pipeline parallelism."""
    from .verify.phases import backward_marks

    t = job.training
    return (t.loop != "hf-trainer" and t.model_impl == "transformers" and job.layout.pp == 1
            and backward_marks(t))


def _measured_points(row: dict) -> Iterator[tuple[str, Job, int, int | None, str | None]]:
    """(name, job, peak allocated, peak reserved, peak phase) of each depth the row measured."""
    job = job_of_row(row)
    layers = row.get("layers")
    if layers and layers.get("measured"):
        for m in layers["measured"]:
            cut = job.model.model_copy(update={"num_layers": m["num_layers"]})
            yield (f"{row['name']}@{m['num_layers']}L", job.model_copy(update={"model": cut}),
                   m["peak_allocated_bytes"], m.get("peak_reserved_bytes"), m.get("peak_phase"))
    else:
        yield row["name"], job, row["peak_allocated_bytes"], row.get("peak_reserved_bytes"), row.get("peak_phase")


def row_gpu(row: dict):
    """The memplan.gpus preset of the GPU the row ran on (its environment's device name; the reference GPU when
    it names none)."""
    from .gpus import gpu_of_device

    return gpu_of_device((row.get("env") or {}).get("gpu"))


def shared_gpu(row: dict) -> bool:
    """Whether other measuring processes shared the row's GPU (memplan.verify.batch records it; rows before it
    did were all measured that way)."""
    return bool((row.get("batch") or {}).get("shared_gpu", True))


@functools.lru_cache(maxsize=4096)
def point_peak(job: Job, rank0: bool, stepped: bool, skipped: tuple[int, ...] | None, gpu):
    """estimator.quick_peak of one measured point, remembered for the process: the estimator is a pure function
    of these arguments (a frozen Job and GpuSpec), and the same point is asked for again by every reader of the
    matrix (the accuracy table, calibrate, the report's evidence, the tests), at up to seconds a ZeRO-3 job."""
    from .estimator import quick_peak

    return quick_peak(job, rank0=rank0, stepped=stepped, skipped=skipped, gpu=gpu)


def compare_rows(rows) -> list[Comparison]:
    """Estimate every successfully measured point of ``rows`` (on the GPU each ran on)."""
    from .estimator import ledger_supported

    out = []
    for row in rows:
        if row.get("status") != "ok":
            continue
        for name, job, measured, reserved, phase in _measured_points(row):
            never_stepped = row.get("skipped_steps", 0) >= row.get("steps", 3)
            q = point_peak(job, row.get("mode", "emulated") == "emulated", not never_stepped, skipped_steps(row),
                           row_gpu(row))
            out.append(Comparison(name, measured, q.peak_allocated_bytes, phase, q.peak_phase,
                                  split=str(row.get("split") or HAND_WRITTEN), loop=job.training.loop,
                                  measured_reserved_bytes=reserved, predicted_reserved_bytes=q.peak_reserved_bytes,
                                  model=LEDGER if ledger_supported(job) else PHASES,
                                  reserved_lower_bound=allocator_retried(row),
                                  reserved_upper_bound=(shared_gpu(row) and q.peak_reserved_behind_bytes is not None),
                                  adapters=job.training.lora is not None,
                                  predicted_reserved_behind_bytes=q.peak_reserved_behind_bytes))
    return out


def allocator_retried(row: dict) -> bool:
    """Whether any measured phase of the row counted a caching-allocator retry (num_alloc_retries > 0)."""
    return any(((p.get("stats") or {}).get("num_alloc_retries") or 0) > 0
               for p in row.get("phases") or () if isinstance(p, dict))


def false_fits(rows) -> list[tuple[str, int, int]]:
    """(name, predicted device total, the card's bytes) of every measured OOM the estimate calls a fit on the
    card it ran on (``env.gpu_total_bytes``): the worst bug this tool can have."""
    out = []
    for row in rows:
        card = (row.get("env") or {}).get("gpu_total_bytes")
        if row.get("status") != "oom" or not card:
            continue
        job = job_of_row(row)
        q = point_peak(job, row.get("mode", "emulated") == "emulated", True, None, row_gpu(row))
        if q.device_total_bytes <= card:
            out.append((row["name"], q.device_total_bytes, card))
    return out


def skipped_steps(row: dict) -> tuple[int, ...]:
    """The indices of the measured optimizer steps the fp16 loss scaler skipped: the row's own record, or (rows
    measured before verify recorded which) the first ``skipped_steps`` of them."""
    if row.get("skipped_step_indices") is not None:
        return tuple(row["skipped_step_indices"])
    count = int(row.get("skipped_steps") or 0)
    steps = int(row.get("steps") or 3)
    if not count or count >= steps:
        return tuple(range(min(count, steps)))
    # older rows: the first step that succeeded is the one whose end holds more than its backward's end (the
    # optimizer created its states); the steps before it were skipped, the remaining skips came last
    ends = {p["name"]: p.get("allocated_end_bytes") or 0 for p in row.get("phases") or []}
    micro = int((row.get("job") or {}).get("training", {}).get("grad_accum", 1)) - 1
    first = next((s for s in range(steps) if ends.get(f"step{s}.micro{micro}.step", 0)
                  > ends.get(f"step{s}.micro{micro}.backward", 0)), 0)
    skipped = list(range(first))
    skipped += list(range(steps - (count - len(skipped)), steps)) if count > len(skipped) else []
    return tuple(sorted(set(skipped)))


def summary(comparisons: list[Comparison]) -> tuple[float, float]:
    """(median |error|, worst |error|) of peak allocated."""
    errs = [abs(c.error) for c in comparisons]
    return statistics.median(errs), max(errs)


def reserved_summary(comparisons: list[Comparison]) -> tuple[int, float, float, float]:
    """(points with a reserved figure, median |error|, worst |error|, worst under-prediction ≥ 0) of peak
    reserved; (0, 0, 0, 0) when none has one."""
    errs = [e for e in (c.reserved_error for c in comparisons) if e is not None]
    if not errs:
        return 0, 0.0, 0.0, 0.0
    return len(errs), statistics.median(abs(e) for e in errs), max(abs(e) for e in errs), max(0.0, -min(errs))


def behind_summary(comparisons: list[Comparison]) -> tuple[int, float, float, float]:
    """(points with a GPU-behind bound and a measured reserved, median error, worst over, worst under ≥ 0)."""
    errs = [e for e in (c.behind_error for c in comparisons) if e is not None]
    if not errs:
        return 0, 0.0, 0.0, 0.0
    return len(errs), statistics.median(errs), max(0.0, max(errs)), max(0.0, -min(errs))


def by_group(comparisons: Iterable[Comparison], key: str) -> dict[str, tuple[int, float, float]]:
    """{split, loop or model: (points, median |error|, worst |error|)} of peak allocated; ``key``: "split",
    "loop" or "model"."""
    groups: dict[str, list[Comparison]] = {}
    for c in comparisons:
        groups.setdefault(getattr(c, key), []).append(c)
    return {k: (len(v), *summary(v)) for k, v in sorted(groups.items())}


def select(comparisons: Iterable[Comparison], split: str | None = None, loop: str | None = None) -> list[Comparison]:
    """The comparisons of one split and/or one loop."""
    return [c for c in comparisons if (split is None or c.split == split) and (loop is None or c.loop == loop)]


def table_lines(comparisons: list[Comparison]) -> list[str]:
    """The accuracy table, worst first, then the whole and per-split / per-loop summaries."""
    from .units import GiB

    head = (f"{'job':48} {'split':12} {'loop':10} {'measured GiB':>12} {'predicted GiB':>13} {'error':>8} "
            f"{'reserved GiB':>12} {'error':>8}  ")
    lines = [head + "phase (meas / pred)"]
    for c in sorted(comparisons, key=lambda c: abs(c.error), reverse=True):
        rerr = c.reserved_error
        lines.append(f"{c.name:48} {c.split:12} {c.loop:10} {c.measured_bytes / GiB:12.3f} "
                     f"{c.predicted_bytes / GiB:13.3f} {c.error:+8.2%} {(c.measured_reserved_bytes or 0) / GiB:12.3f} "
                     f"{'' if rerr is None else format(rerr, '+8.2%'):>8}  {c.measured_phase} / {c.predicted_phase}")
    if not comparisons:
        return lines + ["0 points"]
    median, worst = summary(comparisons)
    n, rmed, rworst, under = reserved_summary(comparisons)
    lines.append(f"{len(comparisons)} points: median |error| {median:.2%}, worst {worst:.2%}; reserved ({n} "
                 f"points): median {rmed:.2%}, worst {rworst:.2%}, most under {under:.2%}")
    n, bmed, bover, bunder = behind_summary(comparisons)
    if n:
        lines.append(f"GPU-behind bound of reserved (ZeRO-3's record_stream frees at the next synchronization, {n} "
                     f"points): median {bmed:+.2%}, most over {bover:.2%}, most under {bunder:.2%}")
    for key in ("split", "loop", "model"):
        groups: dict[str, list[Comparison]] = {}
        for c in comparisons:
            groups.setdefault(getattr(c, key), []).append(c)
        for name, group in sorted(groups.items()):
            med, wst = summary(group)
            n, rmed, rworst, under = reserved_summary(group)
            lines.append(f"  {key} {name}: {len(group)} points, median |error| {med:.2%}, worst {wst:.2%}; "
                         f"reserved median {rmed:.2%}, worst {rworst:.2%}, most under {under:.2%}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Print the accuracy table of committed (or given) verify rows, optionally one split / loop only."""
    p = argparse.ArgumentParser(prog="python -m memplan.accuracy", description=main.__doc__)
    p.add_argument("paths", nargs="*", help="rows*.jsonl files or folders (default: benchmarks/accuracy/)")
    p.add_argument("--split", choices=(*SPLITS, HAND_WRITTEN), help="only rows of this split")
    p.add_argument("--loop", choices=("outputs", "loss", "hf-trainer"), help="only rows of this loop")
    args = p.parse_args(argv)
    paths = [Path(x) for x in args.paths] or [Path(__file__).resolve().parents[2] / "benchmarks" / "accuracy"]
    for path in paths:
        if not path.exists():
            sys.stderr.write(f"memplan: error: paths: {str(path)[:80]!r} does not exist; allowed: rows*.jsonl "
                             "files or folders\n")
            return 2
    comparisons = select(compare_rows(r for path in paths for r in iter_rows(path)), args.split, args.loop)
    print("\n".join(table_lines(comparisons)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
