"""Development aid: how far the GPU runs behind the host in a measured job, from CUDA's own timestamps.

ZeRO-3's deferred frees (record_stream) complete only once the GPU has run what was queued before them, so peak
reserved depends on the GPU's lag behind the host (memplan.estimator.gpu_time replays it). This runs one committed
verify row's job again, emulated on this GPU exactly as memplan.verify's worker does (worker.measure, in process),
under torch.profiler with CUDA activity only (CUPTI: kernels, copies and the runtime calls that launched them; no
CPU op recording, whose cost would slow the host), and writes a small JSON summary per phase:

- ``launch_delay_ms``: for every kernel, copy and memset, its start on the GPU less the start of the runtime call
  that queued it (correlation id): the GPU's lag at that launch; quantiles, max, and the lag at ten points of the
  phase;
- ``busy_ms``: the summed durations per stream (the stream's handle as CUPTI names it) and ``kernels`` per stream;
- ``host_blocked_ms``: runtime calls that make the host wait (cudaStreamSynchronize, cudaEventSynchronize,
  cudaDeviceSynchronize, cudaMemcpy without Async, cudaStreamWaitEvent is not one) and the longest ones;
- ``top``: the kernels that took the most time.

Phases are found by a marker: each memplan.verify phase start launches one ``torch.cuda._sleep(1)`` (a kernel
named ``spin_kernel``) after the harness's synchronization.

Usage (on the GPU machine, deepspeed importable): python tools/kernel_timeline.py ROWS.jsonl NAME OUT.json [--raw F]
"""
from __future__ import annotations

import gzip
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

BLOCKING = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")
MARKER = "spin_kernel"


def _row(path: str, name: str) -> dict:
    for line in Path(path).read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            if r.get("name") == name:
                return r
    raise SystemExit(f"{name}: not in {path}")


def run(rows: str, name: str, raw: str | None) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from memplan.accuracy import job_of_row
    from memplan.verify import hfbuild, worker
    from memplan.verify.phases import Recorder

    row = _row(rows, name)
    job = job_of_row(row)
    begin = Recorder.begin

    def marked(self, label):
        begin(self, label)
        torch.cuda._sleep(1)

    Recorder.begin = marked
    train = worker.train
    holder = {}

    def profiled(*a, **k):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            train(*a, **k)
        holder["prof"] = prof

    worker.train = profiled
    out_dir = tempfile.mkdtemp()
    task = {"name": name, "job": job.model_dump(mode="json"), "hf_config": hfbuild.hf_config_dict(job.model),
            "steps": row.get("steps", 3), "device": "cuda", "mode": "emulated", "hf": None, "trace": False,
            "num_layers": None, "meta_pass": False, "out_dir": out_dir}
    measured = worker.measure(task)
    if "prof" not in holder:
        return {"name": name, "status": measured.get("status"), "error": measured.get("error")}
    path = os.path.join(out_dir, "trace.json")
    holder["prof"].export_chrome_trace(path)
    trace = json.loads(Path(path).read_text())
    if raw:
        with gzip.open(raw, "wt") as fh:
            json.dump(trace, fh)
    labels = [p["name"] for p in measured["phases"] if p["name"] != "init"]
    return {"name": name, "status": measured["status"], "phases_measured": measured["phases"],
            "unmatched_kernels": unmatched(trace["traceEvents"]),
            "summary": summarize(trace["traceEvents"], labels)}


def kernel_kind(e: dict) -> str:
    """The timing model's kernel kind a profiled kernel belongs to, from its name (memplan.estimator.timing)."""
    name = e["name"].lower()
    if e.get("cat") == "gpu_memcpy":
        return "host_link" if "dtoh" in name or "htod" in name else "copy"
    if e.get("cat") == "gpu_memset":
        return "memory"
    if any(k in name for k in ("flash", "fmha", "cudnn", "attention", "mem_eff")):
        return "attention"
    if any(k in name for k in ("gemm", "nvjet", "xmma", "cutlass", "cublas", "sm90_", "sm80_")):
        return "gemm"
    return "memory"


#: the trace's host-side API calls: cuBLASLt and cuDNN launch through the driver API (cuLaunchKernelEx, "cuda_driver")
API = ("cuda_runtime", "cuda_driver")


def launch_calls(events: list[dict]) -> dict[int, dict]:
    """Correlation id → the runtime or driver call that launched a GPU activity."""
    return {e["args"]["correlation"]: e for e in events if e.get("cat") in API and "correlation" in e.get("args", {})}


def unmatched(events: list[dict]) -> int:
    """GPU activities whose launching call is not in the trace (summarize leaves them out of every phase)."""
    calls = launch_calls(events)
    return sum(1 for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
               and e.get("args", {}).get("correlation") not in calls)


def summarize(events: list[dict], labels: list[str]) -> list[dict]:
    runtime = launch_calls(events)
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    marks = [runtime[e["args"]["correlation"]]["ts"] for e in gpu
             if e.get("cat") == "kernel" and MARKER in e["name"] and e["args"].get("correlation") in runtime]
    marks.sort()
    bounds = list(zip(marks, marks[1:] + [float("inf")]))
    out = []
    api = [e for e in events if e.get("cat") in API]
    blocking = [e for e in events if e.get("cat") == "cuda_runtime" and e["name"].startswith(BLOCKING)
                and not e["name"].startswith("cudaMemcpyAsync")]
    for label, (t0, t1) in zip(labels, bounds):
        mine = [e for e in gpu if (c := runtime.get(e["args"].get("correlation"))) and t0 <= c["ts"] < t1]
        delays = [(runtime[e["args"]["correlation"]]["ts"], e["ts"] - runtime[e["args"]["correlation"]]["ts"])
                  for e in mine]
        busy: dict[str, float] = {}
        by_kind: dict[str, float] = {}
        count: dict[str, int] = {}
        names: dict[str, list] = {}
        for e in mine:
            s = str(e["args"].get("stream"))
            busy[s] = busy.get(s, 0.0) + e["dur"]
            count[s] = count.get(s, 0) + 1
            kind = kernel_kind(e)
            by_kind[kind] = by_kind.get(kind, 0.0) + e["dur"]
            n = names.setdefault(e["name"][:80], [0, 0.0])
            n[0] += 1
            n[1] += e["dur"]
        block = [e for e in blocking if t0 <= e["ts"] < t1]
        calls: dict[str, list] = {}
        for e in api:
            if t0 <= e["ts"] < t1:
                c = calls.setdefault(e["name"], [0, 0.0])
                c[0] += 1
                c[1] += e["dur"]
        d = [x for _, x in delays]
        points = [delays[int(i * (len(delays) - 1) / 9)] for i in range(10)] if delays else []
        out.append({
            "phase": label,
            "launches": len(mine),
            "host_span_ms": round((max(c for c, _ in delays) - t0) / 1e3, 2) if delays else 0.0,
            "gpu_end_ms": round((max(e["ts"] + e["dur"] for e in mine) - t0) / 1e3, 2) if mine else 0.0,
            "launch_delay_ms": {
                "median": round(statistics.median(d) / 1e3, 3) if d else 0.0,
                "p90": round(sorted(d)[int(0.9 * (len(d) - 1))] / 1e3, 3) if d else 0.0,
                "max": round(max(d) / 1e3, 3) if d else 0.0,
                "along": [[round((c - t0) / 1e3, 1), round(x / 1e3, 2)] for c, x in points],
            },
            "busy_ms": {s: round(v / 1e3, 2) for s, v in busy.items()},
            "kernels": count,
            "busy_by_kind_ms": {k: round(v / 1e3, 2) for k, v in sorted(by_kind.items())},
            "host_blocked_ms": round(sum(e["dur"] for e in block) / 1e3, 2),
            "api_calls": {k: [v[0], round(v[1] / 1e3, 2)] for k, v in sorted(calls.items(), key=lambda x: -x[1][1])[:10]},
            "host_blocked_longest": sorted(([e["name"], round(e["dur"] / 1e3, 2), round((e["ts"] - t0) / 1e3, 1)]
                                            for e in block), key=lambda x: -x[1])[:8],
            "top": sorted(([k, v[0], round(v[1] / 1e3, 2)] for k, v in names.items()), key=lambda x: -x[2])[:12],
        })
    return out


def main(argv: list[str]) -> int:
    raw = argv[argv.index("--raw") + 1] if "--raw" in argv else None
    rows, name, out = argv[:3]
    result = run(rows, name, raw)
    Path(out).write_text(json.dumps(result, indent=1))
    print(name, result.get("status"), "phases", len(result.get("summary", [])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
