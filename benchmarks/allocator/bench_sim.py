"""Speed of memplan.allocator.simulate on a synthetic, realistic ledger (run: python bench_sim.py [--events N]).

The ledger imitates a decoder-only training job: a few huge tensors (16-bit parameters, fp32 master weights and
Adam states, flat gradient buffers), then micro-steps where every layer's forward allocates the same handful of
activation sizes (some freed at once, the saved ones freed in reverse order during backward), backward's
temporaries and gradient slices, and a reduce bucket on a second stream. Prints events/s for each allocator
configuration; the README records the results.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from memplan.allocator import AllocatorConfig, simulate
from memplan.ledger import Ledger

MiB = 2**20


def job_ledger(target_events: int, layers: int = 32, hidden: int = 4096, tokens: int = 4096, seed: int = 0) -> Ledger:
    """A ledger of about ``target_events`` events (see the module docstring)."""
    rnd = random.Random(seed)
    led = Ledger()
    params = [led.alloc(f"param.{i}", 2 * hidden * hidden * 12, "params_16bit") for i in range(layers)]
    led.alloc("embed", 2 * 50_000 * hidden, "params_16bit")
    for name in ("master", "exp_avg", "exp_avg_sq"):
        led.alloc(name, 4 * hidden * hidden * 12 * layers // 8, "optimizer_states")
    act = 2 * tokens * hidden
    step = 0
    while len(led.events) < target_events:
        led.mark(f"step{step}.forward")
        saved: list[int] = []
        for layer in range(layers):
            for k in range(6):
                saved.append(led.alloc(f"L{layer}.saved{k}", act * (1 + (k == 3) * 3), "activations"))
            for k in range(8):  # temporaries freed at once: norm outputs, softmax buffers, bias adds
                t = led.alloc(f"L{layer}.tmp{k}", act // (1 + k % 4) + rnd.randrange(0, 4) * 512, "activations")
                led.free(t)
            s = led.alloc(f"L{layer}.small", 4 * tokens, "activations")  # a small-pool tensor
            led.free(s)
        logits = led.alloc("logits", 4 * tokens * 50_000 // 4, "activations")
        led.mark(f"step{step}.backward")
        led.free(logits)
        bucket = None
        for layer in reversed(range(layers)):
            for k in range(4):
                g = led.alloc(f"L{layer}.grad_tmp{k}", act, "activations")
                led.free(g)
            for _ in range(6):
                led.free(saved.pop())
            if layer % 4 == 0:
                if bucket is not None:
                    led.free(bucket)
                bucket = led.alloc(f"bucket{layer}", 2 * hidden * hidden * 12 * 4 // 8, "grad_bucket", stream=1)
        if bucket is not None:
            led.free(bucket)
        step += 1
    assert params
    return led


def bench(led: Ledger, config: AllocatorConfig, repeat: int = 7) -> tuple[float, float]:
    """(events per wall-clock second, events per CPU second of this process), best of ``repeat`` replays. CPU time
    is the steadier figure on a shared machine."""
    wall = cpu = float("inf")
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        simulate(led, config)
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    return len(led.events) / wall, len(led.events) / cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=50_000)
    args = ap.parse_args()
    led = job_ledger(args.events)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{len(led.events)} events; python {platform.python_version()}; {platform.machine()}; "
          f"{os.cpu_count()} CPUs; load average {load:.1f}")
    for label, cfg in [("default", AllocatorConfig()),
                       ("expandable_segments:True", AllocatorConfig(expandable_segments=True)),
                       ("max_split_size_mb:128", AllocatorConfig(max_split_size_bytes=128 * MiB)),
                       ("roundup_power2_divisions:4", AllocatorConfig(roundup_power2_divisions=4))]:
        r = simulate(led, cfg)
        wall, cpu = bench(led, cfg)
        print(f"{label:28s} {wall:>10,.0f} events/s wall {cpu:>10,.0f} events/s CPU   peak reserved "
              f"{r.peak_reserved_bytes / 2**30:6.2f} GiB, allocated {r.peak_allocated_bytes / 2**30:6.2f} GiB")


if __name__ == "__main__":
    main()
