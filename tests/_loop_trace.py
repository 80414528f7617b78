"""Record the CPU allocation events of memplan.verify's worker (its DeepSpeed loop or the real HF Trainer).

``python tests/_loop_trace.py OUT.json FLAGS...`` (FLAGS: memplan verify's job flags) runs
memplan.verify.worker.measure in this process on the CPU (DS_ACCELERATOR=cpu, torch's fake process group) under
torch's profiler (profile_memory) and writes every allocation and free with its phase to OUT.json. The worker
runs unchanged except for what a CPU machine lacks:

- bf16 TrainingArguments need a GPU (transformers' is_torch_bf16_gpu_available): the check is told yes;
- accelerate's DataLoaderShard moves each batch with send_to_device, which on the CPU returns the same tensors;
  here it copies them, as a move to the GPU does, inside a ``memplan.device_copy`` annotation;
- the Trainer's label count (Trainer._get_num_items_in_batch) runs inside a ``memplan.num_items`` annotation.

Phases come from the worker's Recorder (begin/end); an event between one phase's end and the next's begin
belongs to the phase before it, as in the estimator's ledger. Each event: bytes (+ allocation, − free), address,
phase, whether it fell between phases, the innermost profiled op, the memplan.* annotations around it, and the
outermost op around it (its index, -1 when none, and name), so that kernel-internal temporaries can be told
apart.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import socket
import sys
import tempfile


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _patch(record_function) -> None:
    import functools

    import accelerate.data_loader as adl
    import torch
    import transformers
    import transformers.training_args as ta

    from memplan.verify import phases

    ta.is_torch_bf16_gpu_available = lambda *a, **k: True

    def send_to_device(batch, device, non_blocking=False, skip_keys=None):
        with record_function("memplan.device_copy"):
            return type(batch)({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()})

    adl.send_to_device = send_to_device
    count = transformers.Trainer._get_num_items_in_batch

    @functools.wraps(count)
    def num_items(self, *args, **kwargs):
        with record_function("memplan.num_items"):
            return count(self, *args, **kwargs)

    transformers.Trainer._get_num_items_in_batch = num_items
    begin, end = phases.Recorder.begin, phases.Recorder.end

    def phase_begin(self, name):
        with record_function(f"memplan.begin.{name}"):
            pass
        begin(self, name)

    def phase_end(self):
        with record_function(f"memplan.end.{self.current}"):
            pass
        end(self)

    phases.Recorder.begin, phases.Recorder.end = phase_begin, phase_end


def _events(trace: list[dict]) -> list[dict]:
    ops = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in trace
                 if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation"))
    marks = sorted(_named(trace, "memplan.begin.") + _named(trace, "memplan.end."))
    times = [m[0] for m in marks]
    out, phase = [], "init"
    for e in sorted((e for e in trace if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
        ts, args = e["ts"], e["args"]
        k = bisect.bisect_right(times, ts) - 1
        gap = k >= 0 and marks[k][1].startswith("memplan.end.")
        if k >= 0:
            phase = marks[k][1].split(".", 2)[2]
        inner = [(i, o) for i, o in enumerate(ops) if o[0] <= ts <= o[1]]
        aten = [(i, o) for i, o in inner if o[2].startswith("aten::")]
        outer = max(aten, key=lambda io: io[1][1] - io[1][0]) if aten else None
        out.append({"bytes": int(args["Bytes"]), "addr": int(args["Addr"]), "phase": phase, "gap": gap,
                    "op": min(aten, key=lambda io: io[1][1] - io[1][0])[1][2] if aten else "?",
                    "tags": sorted({o[2] for _, o in inner if o[2].startswith("memplan.")}),
                    "outer": outer[0] if outer else -1, "outer_op": outer[1][2] if outer else "?"})
    return out


def _named(trace: list[dict], prefix: str) -> list[tuple]:
    return [(e["ts"], e["name"]) for e in trace if e.get("ph") == "X" and e.get("name", "").startswith(prefix)]


def main(argv: list[str]) -> int:
    out_path, *flags = argv
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ["MASTER_PORT"] = _free_port()
    from torch.profiler import ProfilerActivity, profile, record_function

    from memplan.verify import command, hfbuild, worker
    from memplan.verify.cputrace import profiler_events

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    job, opts = command.job_and_options(parser.parse_args(flags))
    task = {"name": "trace", "job": job.model_dump(mode="json"), "hf_config": hfbuild.hf_config_dict(job.model),
            "steps": opts["steps"], "device": "cpu", "mode": "emulated", "hf": opts["hf"], "trace": False,
            "num_layers": None, "meta_pass": False, "out_dir": tempfile.mkdtemp()}
    _patch(record_function)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        row = worker.measure(task)
    trace = profiler_events(prof)
    with open(out_path, "w") as fh:
        json.dump({"status": row["status"], "error": row["error"], "phases": [p["name"] for p in row["phases"]],
                   "events": _events(trace)}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
