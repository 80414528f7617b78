"""Run a matrix of verify jobs on one GPU: `python -m memplan.verify.batch MATRIX.jsonl --out DIR`.

Each MATRIX line is {"name": ..., "args": [verify/estimate flags]}; the args are parsed by the same code as
`memplan verify`, so a matrix row is exactly a verify command. Jobs run as worker subprocesses, several at
once while their predicted device totals (memplan.api.estimate; 40 GiB when unavailable) fit in
--gpu-budget-gib; a job that OOMed while sharing the GPU is retried alone. Each finished row is appended to
DIR/rows.jsonl (and DIR/<name>.json/.md) and summarised on one line.

Lines drawn by memplan.verify.sample carry more keys: SAMPLE_KEYS (split, seed, index, sampler_version,
sampler_command, needs_gpus, predicted_wall_s, predicted_total_bytes, meta) are copied into the measured row as
they are. A line whose "needs_gpus" exceeds this node's GPUs (--node-gpus, default: nvidia-smi's count), or
whose "requires" names a file this checkout lacks, is skipped with a printed reason and not recorded, so a
later batch on a bigger node or a fuller checkout measures it. Jobs also share the host: --host-budget-gib
caps the summed pinned host memory of rank 0 (memplan's estimate) of the jobs running at once. NVMe-offload
jobs are skipped, with a note, when DeepSpeed's async_io op does not load on this machine (no libaio).

Resumable: names already in DIR/rows.jsonl are skipped (--redo runs them again). --deadline S stops starting
jobs after S seconds and kills what still runs at S without recording it, so a time-boxed call can be
repeated until the matrix is done. DeepSpeed's JIT ops are built once first (TORCH_CUDA_ARCH_LIST=9.0 unless
set; TORCH_EXTENSIONS_DIR chooses the cache, so a built cache can be carried to the next machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..units import GiB
from . import command, report, runner

#: device total assumed for a job when memplan's estimate is unavailable
FALLBACK_TOTAL_BYTES = 40 * GiB
#: keys of a sampled matrix line (memplan.verify.sample) copied into its measured row
SAMPLE_KEYS = ("split", "seed", "index", "sampler_version", "sampler_command", "needs_gpus", "predicted_wall_s",
               "predicted_total_bytes", "meta")


@dataclass
class Item:
    name: str
    args: list[str]
    job: Any = None
    opts: dict = field(default_factory=dict)
    need_bytes: int = FALLBACK_TOTAL_BYTES
    alone: bool = False
    shared: bool = False
    error: str | None = None
    host_bytes: int = 0
    extra: dict = field(default_factory=dict)  # SAMPLE_KEYS of the line, copied into the row


def predicted_needs(job, layers: int | None) -> tuple[int, int]:
    """(device total, rank 0's pinned host bytes) of what will actually run (the 2K-layer model under --layers)."""
    try:
        from ..api import estimate

        if layers:
            job = job.model_copy(update={"model": job.model.model_copy(update={"num_layers": 2 * layers})})
        est = estimate(job)
        return est.device_total_bytes, est.host_bytes_per_node // min(job.layout.world, job.layout.gpus_per_node)
    except Exception:  # noqa: BLE001 - scheduling falls back to a fixed share
        return FALLBACK_TOTAL_BYTES, 0


def predicted_total_bytes(job, layers: int | None) -> int:
    """Predicted device total of what will actually run (the 2K-layer model under --layers)."""
    return predicted_needs(job, layers)[0]


def skip_reason(line: dict[str, Any], node_gpus: int) -> str | None:
    """Why a matrix line cannot run on this node or in this checkout (None: it can)."""
    needs = line.get("needs_gpus") or 1
    if isinstance(needs, int) and needs > node_gpus:
        return f"needs {needs} GPUs (real ranks), this node has {node_gpus}; run it on a larger node"
    missing = [p for p in line.get("requires") or () if not os.path.isfile(str(p))]
    if missing:
        return f"needs {missing[0]}, which this checkout lacks (it comes with the code that runs this line)"
    return None


def parse_item(line: dict[str, Any], out_dir: str) -> Item:
    """A matrix line → Item with its Job (or the one-line reason it is bad)."""
    item = Item(name=str(line.get("name") or ""), args=[str(a) for a in line.get("args", [])],
                extra={k: line[k] for k in SAMPLE_KEYS if k in line})
    parser = argparse.ArgumentParser(prog="memplan verify", exit_on_error=False, add_help=False)
    command.add_arguments(parser)
    try:
        args = parser.parse_args(item.args + ["--out", out_dir] + (["--name", item.name] if item.name else []))
        item.job, item.opts = command.job_and_options(args)
    except (argparse.ArgumentError, ValueError) as exc:
        item.error = str(exc).splitlines()[0]
        return item
    except SystemExit:
        item.error = f"bad flags: {' '.join(item.args)}"
        return item
    item.name = item.name or runner.default_name(item.job)
    item.opts["name"] = item.name
    item.need_bytes, item.host_bytes = predicted_needs(item.job, item.opts.get("layers"))
    return item


def _uses_nvme(item: Item) -> bool:
    z = item.job.training.zero if item.job else None
    return z is not None and "nvme" in (z.offload_optimizer, z.offload_param)


#: prints each builder's status as JSON on its last line (one subprocess: deepspeed is imported once)
_PREBUILD_CODE = """import json
from deepspeed.ops import op_builder
out = {}
for name in NAMES:
    try:
        getattr(op_builder, name)().load()
        out[name] = "ok"
    except Exception as exc:
        out[name] = (type(exc).__name__ + ": " + str(exc))[:300]
print(json.dumps(out))
"""


def prebuild_ops(items: list[Item], device: str) -> dict[str, str]:
    """Build DeepSpeed's JIT ops once, in a subprocess, before any worker needs them: {builder: "ok" or why}.

    AsyncIOBuilder (NVMe offload, DeepSpeed's async_io op) needs libaio on the machine."""
    builders = ["FusedAdamBuilder"]
    if any(i.job and i.job.training.zero.offload_optimizer != "none" for i in items):
        builders.append("CPUAdamBuilder")
    if any(i.job and i.job.training.optimizer == "lion" for i in items):
        builders.append("FusedLionBuilder")
    if any(_uses_nvme(i) for i in items):
        builders.append("AsyncIOBuilder")
    env = {**os.environ, **runner.CHILD_ENV}
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    t0 = time.perf_counter()
    code = _PREBUILD_CODE.replace("NAMES", repr(builders))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    try:
        status = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        why = f"failed (code {out.returncode}): {out.stderr.strip()[-300:]}"
        status = {b: why for b in builders}
    print(f"prebuilt {', '.join(builders)} in {time.perf_counter() - t0:.0f} s: "
          + "; ".join(f"{b} {v}" for b, v in status.items()), flush=True)
    return status


def done_names(rows_path: str) -> set[str]:
    if not os.path.exists(rows_path):
        return set()
    with open(rows_path) as fh:
        return {json.loads(line)["name"] for line in fh if line.strip()}


class Scheduler:
    """Starts jobs while they fit; retries an OOM that happened while sharing, alone."""

    def __init__(self, items: list[Item], args: argparse.Namespace):
        self.pending = deque(items)
        self.args = args
        self.budget = int(args.gpu_budget_gib * GiB)
        host_gib = getattr(args, "host_budget_gib", None)
        self.host_budget = None if host_gib is None else int(host_gib * GiB)
        self.running: dict[str, Item] = {}
        self.cond = threading.Condition()
        self.rows_path = os.path.join(args.out, "rows.jsonl")
        self.t0 = time.monotonic()

    def _remaining(self) -> float:
        return float("inf") if self.args.deadline is None else self.args.deadline - (time.monotonic() - self.t0)

    def _fits(self, item: Item) -> bool:
        if not self.running:
            return True
        if item.alone or any(i.alone for i in self.running.values()) or len(self.running) >= self.args.workers:
            return False
        used = sum(i.need_bytes for i in self.running.values())
        host = sum(i.host_bytes for i in self.running.values())
        if self.host_budget is not None and item.host_bytes and host + item.host_bytes > self.host_budget:
            return False
        return used + item.need_bytes <= self.budget

    def _start(self, item: Item) -> None:
        item.shared = bool(self.running)
        for other in self.running.values():
            other.shared = True
        self.running[item.name] = item
        threading.Thread(target=self._run, args=(item,), daemon=True).start()

    def _run(self, item: Item) -> None:
        timeout = min(item.opts["timeout_s"], self._remaining())
        opts = {**item.opts, "name": item.name, "timeout_s": timeout, "steps": self.args.steps or item.opts["steps"]}
        if self.args.device:
            opts["device"] = self.args.device
        try:
            row = runner.measure_job(item.job, command=["memplan", "verify", *item.args], **opts)
        except Exception as exc:  # noqa: BLE001 - a harness bug must not hang the batch
            row = {"name": item.name, "status": "error", "error": f"harness: {type(exc).__name__}: {exc}",
                   "job": item.job.model_dump(mode="json"), "wall_s": 0.0}
        with self.cond:
            del self.running[item.name]
            self._finish(item, row, deferred=row["status"] == "timeout" and timeout < item.opts["timeout_s"])
            self.cond.notify_all()

    def _finish(self, item: Item, row: dict[str, Any], deferred: bool) -> None:
        if deferred:
            print(f"{item.name}: deferred (deadline reached; rerun the batch to measure it)", flush=True)
            return
        if row["status"] == "oom" and item.shared and not item.alone:
            print(f"{item.name}: OOM while sharing the GPU; retrying alone", flush=True)
            item.alone = True
            self.pending.appendleft(item)
            return
        row.update(item.extra)
        row["batch"] = {"shared_gpu": item.shared, "predicted_total_bytes_for_scheduling": item.need_bytes}
        report.write_report(row, self.args.out)
        with open(self.rows_path, "a") as fh:
            fh.write(report.dumps(row) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        print(report.summary_line(row), flush=True)

    def run(self) -> None:
        with self.cond:
            while self.pending or self.running:
                if self._remaining() > 0:
                    for item in list(self.pending):
                        if self._fits(item):
                            self.pending.remove(item)
                            self._start(item)
                        elif item.alone:
                            break  # keep order: nothing overtakes a job waiting to run alone
                elif not self.running:
                    break
                self.cond.wait(timeout=5)
        for item in self.pending:
            print(f"{item.name}: not started (deadline)", flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m memplan.verify.batch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("matrix", help="JSONL: one {\"name\": ..., \"args\": [...]} per line")
    p.add_argument("--out", required=True, help="folder for rows.jsonl, reports and worker logs")
    p.add_argument("--workers", type=int, default=4, help="jobs at once at most (4)")
    p.add_argument("--gpu-budget-gib", type=float, default=130.0, help="sum of predicted device totals (130)")
    p.add_argument("--host-budget-gib", type=float, default=100.0,
                   help="sum of predicted pinned host memory of the running jobs' rank 0 (100)")
    p.add_argument("--node-gpus", type=int, help="GPUs on this node (default: nvidia-smi -L); lines with a larger "
                   "needs_gpus are skipped")
    p.add_argument("--deadline", type=float, help="seconds: start nothing after, kill and defer what runs")
    p.add_argument("--steps", type=int, help="override every row's --steps")
    p.add_argument("--device", choices=("cuda", "cpu"), help="override every row's --device")
    p.add_argument("--only", help="comma-separated names to run")
    p.add_argument("--redo", action="store_true", help="run names already in rows.jsonl again")
    p.add_argument("--no-prebuild", action="store_true", help="skip building DeepSpeed's JIT ops first")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    with open(args.matrix) as fh:
        lines = [json.loads(x) for x in fh if x.strip()]
    wanted = set(args.only.split(",")) if args.only else None
    done = set() if args.redo else done_names(os.path.join(args.out, "rows.jsonl"))
    node_gpus = args.node_gpus if args.node_gpus is not None else runner.local_gpu_count()
    items = []
    for line in lines:
        if (wanted and line.get("name") not in wanted) or line.get("name") in done:
            continue
        why = skip_reason(line, node_gpus)
        if why:
            print(f"{line.get('name')}: skipped: {why}", flush=True)
            continue
        item = parse_item(line, args.out)
        if item.error:
            print(f"{item.name or line}: bad matrix row: {item.error}", flush=True)
            continue
        items.append(item)
    print(f"{len(items)} jobs to run ({len(done)} already in rows.jsonl)", flush=True)
    if items and not args.no_prebuild:
        built = prebuild_ops(items, args.device or items[0].opts["device"])
        if built.get("AsyncIOBuilder", "ok") != "ok":
            for item in [i for i in items if _uses_nvme(i)]:
                print(f"{item.name}: skipped: NVMe offload needs DeepSpeed's async_io op, which does not load "
                      f"here ({built['AsyncIOBuilder'][:120]})", flush=True)
                items.remove(item)
    Scheduler(items, args).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
