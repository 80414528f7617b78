"""Run a megatron-core matrix: `python -m memplan.verify.megatron_runner MATRIX.jsonl --out DIR`.

Each matrix line is one memplan.megatron.harness.MegatronCase (JSON). Every case runs as its own
`python -m memplan.verify.megatron_worker TASK.json` process (peak counters are per process), several at once
while their predicted peaks fit in --gpu-budget-gib; finished rows are appended to DIR/rows.jsonl, each with
its measured phases, memplan's prediction and the comparison. Resumable: names already in DIR/rows.jsonl are
skipped. --deadline S starts nothing after S seconds and kills what still runs then (not recorded).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ..megatron.harness import MegatronCase, predict
from ..units import GiB


def read_matrix(path: str) -> list[MegatronCase]:
    """The cases of a matrix file (one JSON object a line; blank lines and # comments skipped)."""
    cases = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            cases.append(MegatronCase.model_validate_json(line))
    return cases


def compare(row: dict) -> list[dict]:
    """Predicted against measured: the peak, each phase, and the median per-layer forward delta."""
    out = []
    pred = row.get("predicted") or {}
    measured = {p["name"]: p["peak_allocated_bytes"] for p in row.get("phases", [])}
    for name, value in [("peak", row.get("peak_allocated_bytes"))] + list(measured.items()):
        if value and pred.get(name):
            out.append({"what": name, "predicted_bytes": pred[name], "measured_bytes": value,
                        "error_pct": round(100 * (pred[name] - value) / value, 3)})
    deltas = sorted(d for d in (row.get("layer_forward_delta_bytes") or [])[1:] if d is not None)
    if deltas and row.get("predicted_layer_bytes"):
        med = deltas[len(deltas) // 2]
        out.append({"what": "layer forward delta (median, layers 1..)", "predicted_bytes":
                    row["predicted_layer_bytes"], "measured_bytes": med,
                    "error_pct": round(100 * (row["predicted_layer_bytes"] - med) / med, 3)})
    return out


def _done(rows_path: Path) -> set[str]:
    if not rows_path.exists():
        return set()
    return {json.loads(x)["name"] for x in rows_path.read_text().splitlines() if x.strip()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m memplan.verify.megatron_runner", description=__doc__)
    ap.add_argument("matrix")
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", help="tasks, worker logs and torch's compile cache (default OUT/work)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--gpu-budget-gib", type=float, default=120.0)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--deadline", type=float, default=270.0, help="seconds; nothing starts after it")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per case")
    ap.add_argument("--only", default="", help="comma-separated case names")
    ap.add_argument("--trace", action="store_true",
                    help="record each case's allocation trace (WORK/<name>/trace.json.gz, memplan.allocator.trace)")
    ns = ap.parse_args(argv)
    out = Path(ns.out)
    work = Path(ns.work) if ns.work else out / "work"
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)  # --work elsewhere leaves OUT uncreated (the first device run died so)
    rows_path = out / "rows.jsonl"
    only = {x for x in ns.only.split(",") if x}
    cases = [c for c in read_matrix(ns.matrix) if (not only or c.name in only) and c.name not in _done(rows_path)]
    cases.sort(key=lambda c: -predict(c)["peak"])
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(work / "inductor"))}
    start = time.monotonic()
    running: list[tuple[MegatronCase, subprocess.Popen, float, float]] = []
    budget = ns.gpu_budget_gib * GiB
    while cases or running:
        now = time.monotonic() - start
        for item in list(running):
            case, proc, began, _ = item
            if proc.poll() is not None or now > ns.deadline + ns.timeout or time.monotonic() - began > ns.timeout:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                running.remove(item)
                _collect(case, work, rows_path, proc.returncode)
        used = sum(x[3] for x in running)
        while cases and now < ns.deadline and len(running) < ns.workers:
            need = predict(cases[0])["peak"] * 1.1 + 2 * GiB
            if running and used + need > budget:
                break
            case = cases.pop(0)
            running.append((case, _launch(case, ns.device, work, env, ns), time.monotonic(), need))
            used += need
        if not running and (not cases or now >= ns.deadline):
            break
        time.sleep(0.5)
    print(f"rows: {rows_path} ({len(_done(rows_path))} done)")
    return 0


def _launch(case: MegatronCase, device: str, work_root: Path, env: dict, ns) -> subprocess.Popen:
    work = work_root / case.name
    work.mkdir(parents=True, exist_ok=True)
    task = {"case": case.model_dump(), "device": device, "out": str(work / "row.json"),
            "command": ["python", "-m", "memplan.verify.megatron_runner", ns.matrix, "--out", ns.out,
                        "--device", device, "--only", case.name] + (["--trace"] if ns.trace else [])}
    if ns.trace and device == "cuda":
        task["trace"] = str(work / "trace.json.gz")
    (work / "task.json").write_text(json.dumps(task))
    log = open(work / "worker.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([sys.executable, "-m", "memplan.verify.megatron_worker", str(work / "task.json")],
                            stdout=log, stderr=subprocess.STDOUT, env=env)


def _collect(case: MegatronCase, work: Path, rows_path: Path, rc: int | None) -> None:
    path = work / case.name / "row.json"
    if path.exists():
        row = json.loads(path.read_text())
    else:
        row = {"schema": 1, "name": case.name, "case": case.model_dump(), "status": "error" if rc else "timeout",
               "error": f"worker exited {rc} without a row (see {work / case.name}/worker.log)", "phases": []}
    row["logs"] = [str(work / case.name / "worker.log")]
    if row.get("status") != "ok":  # the log's end, since the work folder may not come back
        log = work / case.name / "worker.log"
        row["log_tail"] = log.read_text(errors="replace")[-3000:] if log.exists() else None
    row["comparison"] = compare(row)
    with open(rows_path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(main())
