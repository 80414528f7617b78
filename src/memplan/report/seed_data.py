"""The figures behind the seed report, each from a library call (check, estimate, plan, a verify row).

Paths are relative to the repository root (the seed's files and the committed verify report).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from ..result import Estimate
from ..specs import Job

SEED_DIR = Path("examples/seed-176b")
#: the committed verify report the evidence rests on (a verbatim copy of a benchmarks/accuracy row)
VERIFY_ROW = Path("reports/verify/seed176b-z3-offopt-fp16-s4k-w8-layers1.json")
VERIFY_SOURCE = Path("benchmarks/accuracy/rows-h200-1.jsonl")
CHECK_ARGV = ["--ds-config", str(SEED_DIR / "ds_config_ulysses.json"), "--launch-file", str(SEED_DIR / "launch.sh"),
              "--model", str(SEED_DIR / "176b_config.json"), "--gpus", "8", "--target", "24GiB", "--json"]
PLAN_ARGV = ["--model", "176b", "--seq", "32768", "--gpus", "8", "--gpu", "a100-80g", "--target", "24GiB"]
TARGET_BYTES = 24 * 2**30
A100 = "a100-80g"


def _parse(add_arguments, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="memplan")
    add_arguments(parser)
    return parser.parse_args(argv)


@dataclass(frozen=True)
class CheckResult:
    findings: tuple  # memplan.check.findings.Finding, sorted by severity
    estimate: Estimate | None
    estimate_of: str


def run_check() -> CheckResult:
    """`memplan check` on the seed's files, as a library call (what `run` does, without printing)."""
    from ..check.command import add_arguments, collect, estimate_for
    from ..check.findings import sort_findings
    from ..check.launch import parse_launch, read_launch_file
    from ..dsconfig import load_ds_config
    from ..presets import load_model

    args = _parse(add_arguments, CHECK_ARGV)
    from ..inputs import read_json_object

    cfg = load_ds_config(args.ds_config)
    launch = parse_launch(read_launch_file(args.launch_file), "--launch-file")
    model = load_model(args.model)
    raw = read_json_object(args.model, "--model", "json", "config.json")
    findings, ctx = collect(cfg, launch, model, raw, args.gpus, args.seq)
    est, label, more = estimate_for(ctx, model, args)
    return CheckResult(tuple(sort_findings(findings + more)), est, label)


def seed_job(**changes) -> Job:
    """The nearest valid variant of the launch: bare `memplan estimate` (ZeRO-3, sp 8, fp16, offload optimizer
    cpu, micro-batch 1, seq 32768, 8 GPUs, sdpa), with training ``changes``."""
    from ..options import add_job_arguments, job_from_args
    from .series import variant

    job = job_from_args(_parse(add_job_arguments, []))
    out = variant(job, training=changes) if changes else job
    if out is None:
        raise InputError("--seed", f"the seed's job refuses {changes}")
    return out


def estimate_on_a100(job: Job) -> Estimate:
    from ..api import estimate
    from ..gpus import resolve_gpu

    gpu = resolve_gpu(A100)
    return estimate(job, target_bytes=TARGET_BYTES, gpu_name=gpu.name, gpu_bytes=gpu.memory_bytes)


def run_plan(dtype: str = "bf16"):
    """`memplan plan` for the seed (library call): (PlanResult, the assumptions' notes)."""
    from ..plan.command import add_arguments, space_from_args
    from ..plan.search import search

    args = _parse(add_arguments, PLAN_ARGV + ["--dtype", dtype])
    space, notes = space_from_args(args)
    return search(space), notes


@dataclass(frozen=True)
class Depth:
    """One measured depth of the reduced-depth verify, with today's prediction for it."""

    layers: int
    measured_bytes: int
    predicted_bytes: int


@dataclass(frozen=True)
class Evidence:
    row: dict
    depths: tuple[Depth, ...]  # the measured depths, K and 2K layers
    full_layers: int
    measured_full_bytes: int  # the row's extrapolation: P(K) + (L-K)·slope
    predicted_full_bytes: int  # the estimator at full depth (rank 0, as an emulated verify measures)

    @property
    def measured_slope_bytes(self) -> int:
        a, b = self.depths[0], self.depths[-1]
        return (b.measured_bytes - a.measured_bytes) // (b.layers - a.layers)

    @property
    def predicted_slope_bytes(self) -> int:
        a, b = self.depths[0], self.depths[-1]
        return (b.predicted_bytes - a.predicted_bytes) // (b.layers - a.layers)


def load_evidence(path: Path = VERIFY_ROW) -> Evidence:
    """The committed verify report, compared at each measured depth as memplan.accuracy does (rank 0)."""
    from ..accuracy import compare_rows
    from ..estimator import quick_peak
    from ..inputs import read_json_object
    from .series import job_of_row

    try:
        row = read_json_object(path, "--seed", "memplan", "verify report")
    except InputError as err:
        raise InputError("--seed", f"{err.message}; allowed: run from the repository root") from None
    comparisons = compare_rows([row])
    layers = [m["num_layers"] for m in row["layers"]["measured"]]
    depths = tuple(Depth(n, c.measured_bytes, c.predicted_bytes) for n, c in zip(layers, comparisons))
    job = job_of_row(row)
    predicted_full = quick_peak(job, rank0=True).peak_allocated_bytes
    return Evidence(row, depths, row["layers"]["full_layers"], row["peak_allocated_bytes"], predicted_full)
