"""Measure torch's real CUDA caching allocator for memplan.allocator's tests (run on a GPU machine).

    PYTHONPATH=src python3 benchmarks/allocator/gpu_validate.py run --out DIR

writes to DIR:
- ``env.json``: torch version and commit, the GPU, and which PYTORCH_CUDA_ALLOC_CONF strings torch accepts;
- ``scenarios.json.gz``: op sequences (hand-worked toy cases and seeded random ones) run under several
  allocator configurations, with memory_allocated / memory_reserved after every op, the peaks at every
  reset_peak_memory_stats, num_alloc_retries and the op that ran out of memory;
- ``snapshots.json.gz``: raw ``torch.cuda.memory._snapshot()`` dicts of small runs (default and expandable
  segments, a record_stream free, empty_cache, an OOM, a ring buffer that overflowed), for the converter's tests;
- ``tiny_train_raw.json.gz``: the raw snapshot of 3 training steps of a tiny Llama, with phase markers;
- ``trace_llama1b_*.json.gz``: compact traces (memplan.allocator.trace) of 3 steps of a 1.1B Llama, default and
  expandable segments, with torch's own per-phase peaks in ``extra``.

``gpu_validate.py counterexample --out DIR`` writes ``counterexample.json``: one random sequence (with and without
its empty_cache calls) under the default allocator and under expandable segments, where the latter reserve more.

Each configuration runs in its own process (the allocator reads PYTORCH_CUDA_ALLOC_CONF once).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

MiB = 2**20
HERE = Path(__file__).resolve()
CONFIGS = ["", "expandable_segments:True", "max_split_size_mb:64", "roundup_power2_divisions:4",
           "max_split_size_mb:40,max_non_split_rounding_mb:30", "expandable_segments:True,max_split_size_mb:64",
           "garbage_collection_threshold:0.5", "large_segment_size_mb:40"]
#: the per-process memory fraction (in bytes) every scenario of a configuration runs under, when it names none
CONFIG_LIMITS = {"garbage_collection_threshold:0.5": 1024 * MiB + 3 * MiB}
CONF_PROBES = ["large_segment_size_mb:40", "max_split_size_mb:19", "max_split_size_mb:20", "max_non_split_rounding_mb:10",
               "roundup_power2_divisions:3", "roundup_power2_divisions:[64:8,256:4,>:1]", "expandable_segments:true",
               "expandable_segments:True", "garbage_collection_threshold:0.5", "per_process_memory_fraction:0.5",
               "throw_on_cudamalloc_oom:True", "pinned_reserve_segment_size_mb:64", "graph_capture_record_stream_reuse:True",
               "foo:1", "backend:native", "pinned_free_catch_all:True", "release_lock_on_cudamalloc:True",
               "pinned_num_register_threads:3", "max_split_size_mb:100 , expandable_segments:False"]


def toy_scenarios() -> list[dict]:
    """The hand-worked cases of tests/test_allocator_sim.py, as op lists: (a key nbytes stream) (f key) (e) (p)."""
    s = []

    def add(name, ops, limit_mib=None, physical=False):
        s.append({"name": name, "ops": ops, "limit_bytes": None if limit_mib is None else int(limit_mib * MiB),
                  "physical": physical})

    ops = [["a", k, 16 * MiB, 0] for k in range(8)] + [["f", k] for k in range(8)]
    add("8x16_then_4x32", ops + [["a", 10 + k, 32 * MiB, 0] for k in range(4)])
    ops = [["a", k, 32 * MiB, 0] for k in range(4)] + [["f", k] for k in range(4)]
    add("4x32_then_8x16", ops + [["a", 10 + k, 16 * MiB, 0] for k in range(8)])
    add("pool_boundary", [["a", 0, MiB, 0], ["a", 1, MiB + 1, 0]])
    add("5mib_twice", [["a", 0, 5 * MiB, 0], ["a", 1, 5 * MiB, 0]])
    add("split_thresholds", [["a", 0, 19 * MiB, 0], ["a", 1, int(18.5 * MiB), 0], ["a", 2, 12 * MiB, 0], ["f", 2],
                             ["a", 3, int(11.5 * MiB), 0], ["a", 4, MiB - 512, 0], ["a", 5, 1, 0]])
    add("two_streams", [["a", 0, 16 * MiB, 0], ["f", 0], ["a", 1, 16 * MiB, 1], ["f", 1], ["a", 2, 16 * MiB, 0]])
    add("expandable_growth", [["a", 0, 4096, 0], ["a", 1, 5 * MiB, 0], ["a", 2, 30 * MiB, 0], ["f", 1],
                              ["a", 3, 4 * MiB, 0], ["a", 4, 50 * MiB, 0], ["f", 2], ["e"], ["a", 5, 8 * MiB, 0]])
    add("max_split", [["a", 0, 64 * MiB, 0], ["f", 0], ["a", 1, 30 * MiB, 0], ["a", 2, 50 * MiB, 0], ["f", 2],
                      ["a", 3, 40 * MiB, 0]])
    add("empty_cache_partial", [["a", 0, 5 * MiB, 0], ["a", 1, 15 * MiB, 0], ["a", 2, 5 * MiB, 0], ["f", 0],
                                ["f", 2], ["e"], ["a", 3, 2 * MiB, 0], ["p"], ["f", 1], ["e"]])
    for physical in (False, True):
        tag = "physical" if physical else "fraction"
        limit = 62 if physical else 61  # physical: a multiple of the driver's 2 MiB granularity
        add(f"retry_then_oom_{tag}", [["a", 0, 30 * MiB, 0], ["f", 0], ["a", 1, 40 * MiB, 0], ["a", 2, 30 * MiB, 0]],
            limit_mib=limit, physical=physical)
        add(f"expandable_oom_{tag}", [["a", 0, 5 * MiB, 0], ["a", 1, 25 * MiB, 0], ["f", 1], ["a", 2, 45 * MiB, 0],
                                      ["a", 3, 30 * MiB, 0]], limit_mib=limit, physical=physical)
    add("garbage_collection", [["a", 0, 30 * MiB, 0], ["f", 0], ["a", 1, 32 * MiB, 0], ["f", 1], ["a", 2, 34 * MiB, 0],
                               ["f", 2], ["a", 3, 36 * MiB, 0], ["a", 4, 38 * MiB, 0], ["a", 5, 5 * MiB, 0]],
        limit_mib=201)
    return s


def fuzz_ops(seed: int, n_ops: int = 300) -> list:
    """A seeded random op list: popular sizes and odd ones across the pool and split boundaries, 1–3 streams."""
    rnd = random.Random(seed)
    n_streams = rnd.choice([1, 1, 2, 3])
    edges = [1, 511, 512, 513, MiB - 512, MiB, MiB + 1, 2 * MiB, 10 * MiB - 1, 10 * MiB, int(19.5 * MiB), 20 * MiB,
             21 * MiB, 64 * MiB, 65 * MiB]

    def draw():
        r = rnd.random()
        if r < 0.2:
            return rnd.choice(edges)
        if r < 0.5:
            return rnd.randint(1, MiB)
        if r < 0.8:
            return rnd.randint(MiB, 12 * MiB)
        return rnd.randint(12 * MiB, 160 * MiB)

    popular = [draw() for _ in range(6)]
    ops, live, key = [], [], 0
    for _ in range(n_ops):
        r = rnd.random()
        if live and (r < 0.42 or len(live) > 50):
            k = live.pop(rnd.randrange(max(0, len(live) - 6), len(live)) if rnd.random() < 0.7 else
                         rnd.randrange(len(live)))
            ops.append(["f", k])
        elif r < 0.45:
            ops.append(["e"])
        elif r < 0.48:
            ops.append(["p"])
        else:
            n = rnd.choice(popular) if rnd.random() < 0.6 else draw()
            ops.append(["a", key, n, rnd.randrange(n_streams)])
            live.append(key)
            key += 1
    ops += [["f", k] for k in live] + [["e"]]
    return ops


def run_ops(torch, sc: dict, streams: list) -> dict:
    """Run one op list; returns allocated/reserved after each op, peaks at each reset, retries, OOM."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.reset_accumulated_memory_stats()
    filler = free_left = None
    if sc.get("limit_bytes"):
        if sc.get("physical"):
            import cupy
            free, _ = cupy.cuda.runtime.memGetInfo()
            filler = cupy.cuda.runtime.malloc((free - sc["limit_bytes"]) // (2 * MiB) * (2 * MiB))
            free_left = cupy.cuda.runtime.memGetInfo()[0]
        else:
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(sc["limit_bytes"] / total)
    live, after, peaks, oom_at = {}, [], [], None
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=1_000_000)
    try:
        for i, op in enumerate(sc["ops"]):
            if op[0] == "a":
                with torch.cuda.stream(streams[op[3]]):
                    live[op[1]] = torch.empty(op[2], dtype=torch.uint8, device="cuda")
            elif op[0] == "f":
                del live[op[1]]
            elif op[0] == "e":
                torch.cuda.empty_cache()
            elif op[0] == "p":
                peaks.append([torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()])
                torch.cuda.reset_peak_memory_stats()
            after.append([torch.cuda.memory_allocated(), torch.cuda.memory_reserved()])
    except torch.OutOfMemoryError:
        oom_at = i
    peaks.append([torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()])
    stats = torch.cuda.memory_stats()
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    segment_addresses = [e["addr"] for e in trace if e["action"] in ("segment_alloc", "segment_map")]
    alloc_addresses = [e["addr"] for e in trace if e["action"] == "alloc"]
    live.clear()
    torch.cuda.empty_cache()
    if filler is not None:
        import cupy
        cupy.cuda.runtime.free(filler)
    if sc.get("limit_bytes") and not sc.get("physical"):
        torch.cuda.set_per_process_memory_fraction(1.0)
    return {**sc, "after": after, "peaks": peaks, "oom_at": oom_at, "num_alloc_retries": stats["num_alloc_retries"],
            "num_ooms": stats["num_ooms"], "free_left": free_left, "segment_addresses": segment_addresses,
            "alloc_addresses": alloc_addresses}


def worker_scenarios(conf: str, out: str) -> None:
    import torch
    streams = [torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream()]
    scs = toy_scenarios() + [{"name": f"fuzz{seed}", "ops": fuzz_ops(seed)} for seed in range(60)]
    res = []
    for sc in scs:
        if not sc.get("limit_bytes") and conf in CONFIG_LIMITS:
            sc = {**sc, "limit_bytes": CONFIG_LIMITS[conf], "physical": False}
        try:
            res.append(run_ops(torch, sc, streams))
        except Exception as e:  # noqa: BLE001 - keep going: one broken scenario must not lose the rest
            res.append({**sc, "error": repr(e)})
    Path(out).write_text(json.dumps({"conf": conf, "results": res}))


def _snap(torch) -> dict:
    snap = torch.cuda.memory._snapshot()
    return json.loads(json.dumps(snap, default=lambda o: list(o) if isinstance(o, tuple) else str(o)))


def worker_counterexample(conf: str, out: str) -> None:
    """fuzz_ops(2230, 200), with and without its empty_cache and reset ops: in the second, expandable segments
    reserve more than the default allocator by more than a page per pool and stream."""
    import torch
    streams = [torch.cuda.current_stream(), torch.cuda.Stream(), torch.cuda.Stream()]
    ops = fuzz_ops(2230, 200)
    scs = [{"name": "fuzz2230x200", "ops": ops},
           {"name": "fuzz2230x200_allocs_and_frees", "ops": [op for op in ops if op[0] in "af"]}]
    Path(out).write_text(json.dumps({"conf": conf, "results": [run_ops(torch, sc, streams) for sc in scs]}))


def counterexample(outdir: Path) -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    res = []
    for conf in ("", "expandable_segments:True"):
        dest = outdir / "tmp.json"
        subprocess.run([sys.executable, str(HERE), "worker", "counterexample", conf, str(dest)], check=True,
                       env={**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf}, timeout=300)
        res.append(json.loads(dest.read_text()))
        dest.unlink()
    (outdir / "counterexample.json").write_text(json.dumps(res))


def worker_snapshots(conf: str, out: str) -> None:
    """Small recorded runs whose raw snapshots the converter's tests read."""
    import torch
    res = {}
    side = torch.cuda.Stream()
    torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
    a = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
    b = torch.empty(1000, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(side):
        c = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
    a.record_stream(side)  # a's free completes only once side's work is done (at a later malloc)
    del a
    d = torch.empty(MiB, dtype=torch.uint8, device="cuda")
    del b, c
    torch.cuda.empty_cache()
    e = torch.empty(40 * MiB, dtype=torch.uint8, device="cuda")
    del d, e
    res["basic"] = _snap(torch)
    torch.cuda.memory._record_memory_history(enabled=None)
    torch.cuda.empty_cache()
    if "expandable" not in conf:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(61 * MiB / total)
        torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
        x = torch.empty(30 * MiB, dtype=torch.uint8, device="cuda")
        del x
        y = torch.empty(40 * MiB, dtype=torch.uint8, device="cuda")
        try:
            torch.empty(30 * MiB, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            pass
        res["oom"] = _snap(torch)
        del y
        torch.cuda.memory._record_memory_history(enabled=None)
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
        torch.cuda.memory._record_memory_history(max_entries=40, stacks="python")
        keep = [torch.empty((k + 1) * 4096, dtype=torch.uint8, device="cuda") for k in range(30)]
        for k in range(0, 30, 2):
            keep[k] = None
        keep += [torch.empty(3 * MiB, dtype=torch.uint8, device="cuda") for _ in range(10)]
        res["ringbuffer"] = _snap(torch)
        torch.cuda.memory._record_memory_history(enabled=None)
        del keep
    Path(out).write_text(json.dumps(res))


def worker_train(conf: str, out: str, size: str) -> None:
    """3 training steps of a Llama with phase markers; writes the raw snapshot (tiny) or a compact trace (1b)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    def memplan_phase_marker(label: str) -> None:
        t = torch.empty(512, dtype=torch.uint8, device="cuda")
        del t

    if size == "tiny":
        cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=1000, use_cache=False)
        batch, seq = 2, 128
    else:
        cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                          num_key_value_heads=4, vocab_size=32000, use_cache=False)
        batch, seq = 4, 1024
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")
    phases, torch_peaks = [], []

    def phase(label: str) -> None:
        if phases:
            torch_peaks.append([torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()])
        torch.cuda.reset_peak_memory_stats()
        phases.append(label)
        memplan_phase_marker(label)

    for step in range(3):
        phase(f"step{step}.forward")
        loss = model(input_ids=ids, labels=ids).loss
        phase(f"step{step}.backward")
        loss.backward()
        del loss
        phase(f"step{step}.optimizer")
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch_peaks.append([torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()])
    snap = _snap(torch)
    torch.cuda.memory._record_memory_history(enabled=None)
    extra = {"phases": phases, "torch_phase_peaks": torch_peaks, "conf": conf, "model": size,
             "torch": torch.__version__, "git": torch.version.git_version,
             "memory_stats": {k: v for k, v in torch.cuda.memory_stats().items() if "all" in k or "num_" in k}}
    if size == "tiny":
        Path(out).write_text(json.dumps({"snapshot": snap, "extra": extra}))
    else:
        from memplan.allocator.trace import compact_trace, write_trace
        try:
            write_trace(out, compact_trace(snap, max_entries=2_000_000), extra)
        except Exception:  # noqa: BLE001 - keep the raw snapshot to debug the converter with
            with gzip.open(out, "wt") as f:
                json.dump({"snapshot": snap, "extra": extra}, f)


def probe_confs() -> dict:
    import torch
    out = {}
    for s in CONF_PROBES:
        try:
            torch.cuda.memory._set_allocator_settings(s)
            out[s] = {"accepted": True, "settings": _snap(torch).get("allocator_settings")}
        except Exception as e:  # noqa: BLE001 - torch raises RuntimeError or ValueError, both are answers here
            out[s] = {"accepted": False, "error": f"{type(e).__name__}: {e}"}
    return out


def run(outdir: Path) -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    tmp = outdir / "tmp"
    tmp.mkdir(exist_ok=True)
    me = [sys.executable, str(HERE)]
    t0 = time.time()
    env_info = subprocess.run(me + ["env", "--out", str(outdir)], check=False, capture_output=True, text=True,
                              timeout=120)
    print(env_info.stdout[-2000:], env_info.stderr[-2000:])
    jobs = [(f"scen{i}", ["scenarios", conf]) for i, conf in enumerate(CONFIGS)]
    jobs += [("snap0", ["snapshots", ""]), ("snap1", ["snapshots", "expandable_segments:True"])]
    jobs += [("tiny", ["train", "", "tiny"]), ("l1b0", ["train", "", "1b"]),
             ("l1b1", ["train", "expandable_segments:True", "1b"])]
    for name, args in jobs:
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": args[1]}
        dest = tmp / f"{name}.json"
        r = subprocess.run(me + ["worker", args[0], args[1], str(dest)] + args[2:], check=False, env=env,
                           capture_output=True, text=True, timeout=400)
        print(f"{name}: rc={r.returncode} {time.time() - t0:.0f}s", r.stderr[-3000:] if r.returncode else "")
    scen = [json.loads((tmp / f"scen{i}.json").read_text()) for i in range(len(CONFIGS)) if (tmp / f"scen{i}.json").exists()]
    with gzip.open(outdir / "scenarios.json.gz", "wt") as f:
        json.dump(scen, f)
    snaps = {n: json.loads((tmp / f"{n}.json").read_text()) for n in ("snap0", "snap1") if (tmp / f"{n}.json").exists()}
    with gzip.open(outdir / "snapshots.json.gz", "wt") as f:
        json.dump(snaps, f)
    if (tmp / "tiny.json").exists():
        with gzip.open(outdir / "tiny_train_raw.json.gz", "wt") as f:
            f.write((tmp / "tiny.json").read_text())
    for n, dest in (("l1b0", "trace_llama1b_default.json.gz"), ("l1b1", "trace_llama1b_expandable.json.gz")):
        if (tmp / f"{n}.json").exists():
            (tmp / f"{n}.json").replace(outdir / dest)
    for p in tmp.iterdir():
        p.unlink()
    tmp.rmdir()
    print(f"done in {time.time() - t0:.0f}s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cmd", choices=["run", "env", "worker", "counterexample"])
    ap.add_argument("rest", nargs="*")
    ap.add_argument("--out", default="out")
    a = ap.parse_args()
    if a.cmd == "run":
        run(Path(a.out))
    elif a.cmd == "counterexample":
        counterexample(Path(a.out))
    elif a.cmd == "env":
        import torch
        props = torch.cuda.get_device_properties(0)
        info = {"torch": torch.__version__, "git": torch.version.git_version, "cuda": torch.version.cuda,
                "gpu": props.name, "total_memory": props.total_memory, "python": sys.version,
                "conf_probes": probe_confs()}
        out = Path(a.out) / "env.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(info, indent=1))
        print(json.dumps({k: v for k, v in info.items() if k != "conf_probes"}))
    else:
        task, conf, dest, *more = a.rest
        {"scenarios": worker_scenarios, "snapshots": worker_snapshots, "counterexample": worker_counterexample,
         "train": lambda c, d: worker_train(c, d, more[0])}[task](conf, dest)


if __name__ == "__main__":
    main()
