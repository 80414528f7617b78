"""Speed of `memplan plan`: candidates evaluated per second, and the seed's default search end to end.

Run: python benchmarks/plan/bench_plan.py   (prints a Markdown table to paste into README.md)

- throughput: search(space, prune=False) evaluates every valid candidate (the screen, estimator.screen_peak, the
  perf model and a Candidate each) and confirms the shown rows with the ledger (memplan.plan.confirm); evaluated /
  wall seconds, best of REPEATS.
- screened/s: the same search without the confirmation (peak_fn=default_screen_fn(), no exact_fn): what the
  candidates themselves cost; confirm s: the whole search's seconds less the screened search's, and the ledger
  runs it made (a cost per plan, CONFIRM_LIMIT × top runs at most, not per candidate).
- seed search: the default (pruned) search of `memplan plan --model 176b --seq 32768 --gpus 8 --gpu a100-80g
  --target 24GiB`, in process (best of REPEATS) and as a fresh `memplan plan` process (best of REPEATS).
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time

from memplan.plan.hardware import resolve_hardware
from memplan.plan.search import default_screen_fn, search
from memplan.plan.space import PlanSpace, default_global_batch
from memplan.presets import load_model

REPEATS = 5
SEED_ARGV = ["plan", "--model", "176b", "--seq", "32768", "--gpus", "8", "--gpu", "a100-80g", "--target", "24GiB"]
SCENARIOS = {  # name: (model, seq, world, gpu, target GiB)
    "seed 176b/32k/8xA100": ("176b", 32768, 8, "a100-80g", 24),
    "llama-3-8b/8k/64xH100": ("llama-3-8b", 8192, 64, "h100-80g", 76),
    "llama-3-70b/4k/256xH200": ("llama-3-70b", 4096, 256, "h200", 130),
}


def _space(model: str, seq: int, world: int, gpu: str, target_gib: int) -> PlanSpace:
    hw, _ = resolve_hardware(gpu)
    return PlanSpace(model=load_model(model), seq_len=seq, global_batch=default_global_batch(seq, world), world=world,
                     hardware=hw, target_bytes=target_gib * 2**30, host_ram_bytes_per_node=hw.host_ram_bytes_per_node,
                     nvme_bytes_per_node=hw.nvme_bytes_per_node)


def _best(fn) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(REPEATS):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def _cli_seconds() -> float:
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "memplan.cli", *SEED_ARGV, "--json"], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    print(f"python {platform.python_version()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, {platform.platform()}")
    print("\n| scenario | valid candidates | evaluated/s (no pruning) | screened/s | confirm s (ledger runs) "
          "| pruned search s | evaluated (pruned) | feasible |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, args in SCENARIOS.items():
        space = _space(*args)
        full_s, full = _best(lambda s=space: search(s, prune=False))
        screen_s, screened = _best(lambda s=space: search(s, peak_fn=default_screen_fn(), prune=False))
        pruned_s, pruned = _best(lambda s=space: search(s))
        print(f"| {name} | {full.searched} | {full.evaluated / full_s:,.0f} | {screened.evaluated / screen_s:,.0f} "
              f"| {full_s - screen_s:.2f} ({full.confirmed}) | {pruned_s:.3f} | {pruned.evaluated} | {pruned.feasible} |")
    print(f"\nseed `memplan {' '.join(SEED_ARGV)}` as a fresh process: {_cli_seconds():.2f} s (best of {REPEATS})")


if __name__ == "__main__":
    main()
