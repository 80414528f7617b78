"""The parent side of a measurement: run worker processes, enforce the timeout, assemble the report row.

No torch here. `measure_job` returns one row (a JSON-ready dict) whatever happens: a failed launch, an OOM or
a timeout is a status in the row, never an exception.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..dsconfig_emit import to_ds_config
from ..errors import InputError
from ..specs import Job
from . import compare, hfbuild, worker
from .envinfo import write_json_atomic

SCHEMA_VERSION = 1

#: exported to every worker: NVLink SHARP / multicast off (the lent machines cannot use it; docs/emulation.md)
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def default_name(job: Job) -> str:
    """A file-safe name for a job: model, seq, micro-batch, ZeRO, world, sp and what differs from defaults."""
    t, lay = job.training, job.layout
    parts = [Path(job.model.name).stem, f"seq{t.seq_len}", f"mb{t.micro_batch}", f"z{t.zero.stage}", f"g{lay.world}"]
    if lay.sp > 1:
        parts.append(f"sp{lay.sp}")
    if t.grad_accum > 1:
        parts.append(f"ga{t.grad_accum}")
    if t.zero.offload_optimizer != "none":
        parts.append(f"oo{t.zero.offload_optimizer}")
    if t.zero.offload_param != "none":
        parts.append(f"op{t.zero.offload_param}")
    parts += [t.dtype, t.attention, t.optimizer]
    if t.checkpointing != "none":
        parts.append(f"ckpt{t.checkpointing}")
    if t.loop == "hf-trainer":
        parts.append("hftrainer")
    return re.sub(r"[^A-Za-z0-9._-]+", "_", "-".join(parts))


def local_gpu_count() -> int:
    """GPUs on this node, from nvidia-smi -L (0 when there is none)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def _spawn(cmd: list[str], log_path: Path, timeout_s: float, env: dict[str, str]) -> int | None:
    """Run ``cmd`` in its own process group with output to ``log_path``; None when it timed out (killed)."""
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None


def run_worker(task: dict[str, Any], work: Path, timeout_s: float, world: int) -> list[dict[str, Any]]:
    """One depth of one job: the worker (or torchrun of workers) → the rank rows it wrote."""
    work.mkdir(parents=True, exist_ok=True)
    for old in work.glob("rank*.json"):
        old.unlink()
    task = {**task, "out_dir": str(work)}
    write_json_atomic(str(work / "task.json"), task)
    module = [sys.executable, "-m", "memplan.verify.worker", str(work / "task.json")]
    if task["mode"] == "real":
        module = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
                  "-m", "memplan.verify.worker", str(work / "task.json")]
    env = {**os.environ, **CHILD_ENV}
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # the job's allocator settings, nothing inherited
    alloc_conf = Job.model_validate(task["job"]).training.allocator.alloc_conf()
    if alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    if task["device"] == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    log = work / "worker.log"
    t0 = time.perf_counter()
    code = _spawn(module, log, timeout_s, env)
    first_ok = code == 0 and (work / "rank0.json").exists() and json.loads((work / "rank0.json").read_text())["status"] == "ok"
    if task["mode"] == "emulated" and task["job"]["layout"]["pp"] > 1 and first_ok:
        # pipeline: the first stage is rank 0; the last stage (it holds the logits) is emulated as rank world-1
        write_json_atomic(str(work / "task.json"), {**task, "emulated_rank": world - 1, "meta_pass": False})
        code = _spawn(module, log, max(1.0, timeout_s - (time.perf_counter() - t0)), env)
    rows = [json.loads(p.read_text()) for p in sorted(work.glob("rank*.json"))]
    if code is None and any(r.get("status") not in ("ok", None) for r in rows):
        return rows  # e.g. one real rank OOMed and the others hung in a collective until the timeout
    if code is None:
        return [{"status": "timeout", "error": f"measured: timeout after {timeout_s:.0f} s", "rank": 0,
                 "wall_s": round(time.perf_counter() - t0, 3), "phases": [], "timeline": []}]
    if not rows:
        return [{"status": "error", "error": f"worker exited with code {code} without a result; see {log}",
                 "rank": 0, "wall_s": round(time.perf_counter() - t0, 3), "phases": [], "timeline": []}]
    return rows


def _most_loaded(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The failed rank if any failed, else the rank with the highest peak allocated."""
    failed = [r for r in rows if r.get("status") != "ok"]
    if failed:
        return failed[0]
    return max(rows, key=lambda r: r.get("peak_allocated_bytes") or 0)


def _per_rank(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    keys = ("rank", "status", "peak_allocated_bytes", "peak_reserved_bytes", "init_peak_allocated_bytes")
    extra = ("peak_phase", "pp_stage", "stage_params", "tp_rank", "dp_rank", "rank_params")  # where run
    return [{k: r.get(k) for k in keys} | {k: r[k] for k in extra if k in r}
            for r in sorted(rows, key=lambda r: r.get("rank", 0))]


def extrapolate(p_k: int | None, p_2k: int | None, k: int, full: int) -> int | None:
    """P(L) = P(K) + (L − K)·(P(2K) − P(K))/K: linear in the layer count through the two measured depths."""
    if p_k is None or p_2k is None:
        return None
    return round(p_k + (full - k) * (p_2k - p_k) / k)


def _extrapolated_row(low: dict[str, Any], high: dict[str, Any], k: int, full: int) -> dict[str, Any]:
    """The full-depth row from the K- and 2K-layer rows: every peak and every phase peak extrapolated."""
    out = dict(high)
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "init_peak_allocated_bytes",
                "init_peak_reserved_bytes"):
        out[key] = extrapolate(low.get(key), high.get(key), k, full)
    by_name = {p["name"]: p for p in low.get("phases", [])}
    phases = []
    for p in high.get("phases", []):
        q = by_name.get(p["name"], {})
        phases.append({**p, **{key: extrapolate(q.get(key), p.get(key), k, full) for key in
                               ("peak_allocated_bytes", "peak_reserved_bytes", "allocated_end_bytes")}})
    out["phases"] = phases
    train = [p for p in phases if p["name"] != "init"]
    out["peak_phase"] = max(train, key=lambda p: p["peak_allocated_bytes"] or 0)["name"] if train else None
    out["timeline"] = []  # layer labels of a K-layer model do not extrapolate
    return out


def _depths(job: Job, layers: int | None) -> list[int | None]:
    if layers is None:
        return [None]
    full = job.model.num_layers
    if layers < 1 or 2 * layers > full:
        raise InputError("--layers", f"{layers} must be between 1 and half the model's depth ({full} layers)")
    return [layers, 2 * layers]


def measure_job(job: Job, *, name: str | None = None, command: Sequence[str] = (), out_dir: str = "reports/verify",
                steps: int = 3, layers: int | None = None, launch: bool = False, device: str = "cuda",
                timeout_s: float = 600.0, hf: dict[str, Any] | None = None, trace: str | None = None
                ) -> dict[str, Any]:
    """Measure ``job`` as the protocol in memplan.verify says and return the report row (predicted included).

    ``hf``: the Trainer's inputs for ``--loop hf-trainer`` (memplan.hf.job.verify_task): the worker runs a
    real transformers.Trainer with them; the row records them and memplan's filled DeepSpeed config.
    ``trace``: record the allocator's real event history and write it as Chrome trace-event JSON there."""
    t0 = time.perf_counter()
    name = name or default_name(job)
    mode = "real" if launch else "emulated"
    row: dict[str, Any] = {"schema": SCHEMA_VERSION, "name": name, "job": job.model_dump(mode="json"),
                           "command": list(command), "mode": mode, "device": device, "steps": steps,
                           "ds_config": None, "layers": None}
    runs: list[dict[str, Any]] = []
    try:
        row["ds_config"] = hf["ds_config"] if hf else to_ds_config(job)
        if hf:
            row["training_args"], row["ds_config_given"] = hf["training_args"], hf["deepspeed"]
        depths = _depths(job, layers)
        worker.check_supported(job, mode)
        if launch and device == "cuda" and local_gpu_count() < job.layout.world:
            raise _Refused(f"--launch needs {job.layout.world} GPUs on this node (found {local_gpu_count()})")
        task = {"name": name, "job": row["job"], "hf_config": hfbuild.hf_config_dict(job.model), "steps": steps,
                "device": device, "mode": mode, "hf": hf, "trace": trace is not None}
        for depth in depths:
            work = Path(out_dir) / "work" / name / (f"layers{depth}" if depth else "full")
            rows = run_worker({**task, "num_layers": depth, "meta_pass": depth in (None, layers)}, work,
                              timeout_s, job.layout.world)
            runs.append({"num_layers": depth or job.model.num_layers, "rows": rows, "log": str(work / "worker.log")})
            if _most_loaded(rows).get("status") != "ok":
                break
    except (InputError, ValueError, _Refused, worker.Unsupported) as exc:
        runs = [{"num_layers": job.model.num_layers, "log": None, "rows": [
            {"status": "unsupported" if isinstance(exc, (_Refused, worker.Unsupported)) else "error", "error": str(exc), "rank": 0,
             "phases": [], "timeline": []}]}]
    row.update(_assemble(job, runs, layers))
    if trace is not None:
        row.update(_chrome_trace(runs, trace))
    row["wall_s"] = round(time.perf_counter() - t0, 3)
    row.update(compare.predicted_and_comparison(job, row))
    return row


def _chrome_trace(runs: list[dict[str, Any]], path: str) -> dict[str, Any]:
    """The measured allocation trace of the (last depth's) most loaded rank as Chrome trace-event JSON at
    ``path`` (memplan.allocator.chrome), beside the compact trace the worker wrote."""
    loaded = _most_loaded(runs[-1]["rows"]) if runs else {}
    source = loaded.get("trace_file")
    if not source:
        return {"trace": None, "trace_error": loaded.get("trace_error") or "no trace was recorded"}
    try:
        from ..allocator.chrome import chrome_trace
        from ..allocator.trace import ledger_from_trace, read_trace

        ledger = ledger_from_trace(read_trace(source))
        write_json_atomic(path, chrome_trace(ledger, None))
    except Exception as exc:  # noqa: BLE001 - the measurement stands without its picture
        return {"trace": None, "trace_source": source, "trace_error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    return {"trace": path, "trace_source": source}


class _Refused(Exception):
    """The job cannot be run here as asked (reported as status "unsupported")."""


def _assemble(job: Job, runs: list[dict[str, Any]], layers: int | None) -> dict[str, Any]:
    """The measured part of the row from the runs at each depth."""
    loaded = [_most_loaded(r["rows"]) for r in runs]
    first = runs[0]["rows"][0]
    out: dict[str, Any] = {
        "env": first.get("env"), "attention_backend": first.get("attention_backend"),
        "meta_params": first.get("meta_params"), "analytic_params": first.get("analytic_params"),
        "per_rank": _per_rank(runs[-1]["rows"]) if len(runs[-1]["rows"]) > 1 else None,
        "most_loaded_rank": loaded[-1].get("rank"), "logs": [r["log"] for r in runs],
    }
    failed = next((r for r in loaded if r.get("status") != "ok"), None)
    if layers is not None and failed is None:
        full = _extrapolated_row(loaded[0], loaded[1], layers, job.model.num_layers)
        out["layers"] = {
            "method": "full-width model measured at K and 2K layers; every peak extrapolated linearly in the "
                      "layer count: P(L) = P(K) + (L-K)*(P(2K)-P(K))/K",
            "full_layers": job.model.num_layers,
            "measured": [{"num_layers": r["num_layers"], **{k: m.get(k) for k in (
                "peak_allocated_bytes", "peak_reserved_bytes", "init_peak_allocated_bytes", "peak_phase")},
                "phases": m.get("phases")} for r, m in zip(runs, loaded)],
        }
        chosen = full
    else:
        chosen = failed or loaded[-1]
    keys = ("status", "error", "phases", "peak_allocated_bytes", "peak_reserved_bytes", "peak_phase",
            "init_peak_allocated_bytes", "init_peak_reserved_bytes", "timeline", "oom_phase",
            "skipped_steps", "skipped_step_indices", "global_steps", "process_gpu_bytes", "torch_reserved_end_bytes", "trace_file",
            "trainable_params", "frozen_params")
    out.update({k: chosen.get(k) for k in keys})
    trainer = ("trainer_note", "trainer_ds_config", "auto_fill_check", "trainer_optimizer", "trainer_scheduler")
    out.update({k: chosen[k] for k in trainer if k in chosen})  # --loop hf-trainer (verify/trainer.py)
    if "training_args" in chosen:
        out["trainer_training_args"] = chosen["training_args"]
    if failed is not None and layers is not None:
        out["error"] = f"{failed.get('error')} (at {runs[loaded.index(failed)]['num_layers']} layers)"
    return out
