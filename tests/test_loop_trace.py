"""The estimator's training loops (memplan.estimator.loop) against real allocation traces, tensor by tensor.

GPU: every committed allocation trace of memplan.verify's DeepSpeed loop (benchmarks/accuracy/traces, H200,
torch 2.11, DeepSpeed 0.19.8) holds, per phase, the position ids and input ids the worker makes, the scalars of
engine.backward (loss / gas, the loss scaler's product, the gradient seed) and the logits the loop keeps or
drops, in the order the ledger of the row's job has them. CPU: the worker runs on the CPU under torch's profiler
(tests/_loop_trace.py) — the DeepSpeed loop with ``loss`` and ``outputs``, and the real transformers Trainer,
whose device batches (accelerate's send_to_device, copying as a move to the GPU does) and label count
(Trainer._get_num_items_in_batch) are held against the TrainerLoop's. A tensor is compared by kind, size, phase
and identity: each free must release the same tensor (the n-th allocation of its kind) on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memplan.accuracy import job_of_row, skipped_steps
from memplan.allocator.trace import ledger_from_trace, read_trace
from memplan.estimator import ledger_supported
from memplan.estimator.program import build_ledger

ROOT = Path(__file__).resolve().parents[1]
TRACES = sorted((ROOT / "benchmarks" / "accuracy" / "traces").glob("trace-*.json.gz"))
TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1000, "max_position_embeddings": 512}


def identities(events) -> list[tuple]:
    """(phase, kind, +bytes or -bytes, n): n numbers the allocations of each kind; a free names its tensor's n."""
    counts: dict[str, int] = {}
    alive: dict[object, tuple[str, int]] = {}
    out = []
    for phase, kind, key, nbytes in events:
        if nbytes > 0:
            n = counts[kind] = counts.get(kind, -1) + 1
            alive[key] = (kind, n)
            out.append((phase, kind, nbytes, n))
        elif key in alive:
            kind, n = alive.pop(key)
            out.append((phase, kind, nbytes, n))
    return out


def ledger_events(L, kind_of) -> list[tuple]:
    """The ledger's events whose tensor ``kind_of(name, bytes)`` names, with their phase (mark spans)."""
    out = []
    for label, a, z in L.phase_spans():
        for i in range(a, z):
            ev = L.events[i]
            tid = ev if ev >= 0 else ~ev
            kind = kind_of(L.names[tid], L.sizes[tid])
            if kind:
                out.append((label, kind, tid, L.sizes[tid] if ev >= 0 else -L.sizes[tid]))
    return out


# -- GPU traces of the DeepSpeed loop -------------------------------------------------------------------------
def _rows() -> dict[str, dict]:
    from memplan.accuracy import iter_rows

    return {r["name"]: r for r in iter_rows(ROOT / "benchmarks" / "accuracy") if r.get("split") != "check"}


#: trace frames (memplan.allocator.trace names) → kind: the worker's tensors and engine.backward's scalars
TRACE_KINDS = {"memplan/verify/worker.py:train": "inputs", "deepspeed/runtime/engine.py:backward": "engine",
               "runtime/fp16/loss_scaler.py:scale_loss": "scale"}
#: where the logits are allocated: the lm_head's nn.Linear, or DeepSpeed's ZeRO-3 linear function
LOGITS_FRAMES = ("transformers/models/llama/modeling_llama.py:forward", "runtime/zero/linear.py:forward",
                 "transformers/models/deepseek_v3/modeling_deepseek_v3.py:forward")
LEDGER_KINDS = {"loop.position_ids": "inputs", "loop.input_ids": "inputs", "engine.loss_over_gas": "engine",
                "grad.root": "engine", "engine.scaled_loss": "scale", "lm_head": "logits"}


@pytest.mark.parametrize("path", TRACES, ids=[p.name.split(".")[0] for p in TRACES])
def test_deepspeed_loop_matches_the_gpu_trace(path):
    row = _rows().get(path.name.split(".")[0])
    if row is None:
        pytest.skip("the trace of a check-split job: held out (issue 13), never studied")
    trace = read_trace(str(path))
    phases = trace["extra"]["phases"]
    job = job_of_row(row)
    if not ledger_supported(job):
        pytest.skip("a job the ledger does not model yet (estimator.ledger_supported): its trace is for finding the "
                    "tensors the phase lists miss")
    t = job.training
    from memplan.units import dtype_bytes

    logits = t.micro_batch * t.seq_len // job.layout.sp * job.model.vocab_size * dtype_bytes(t.dtype)  # [B, S, V]

    def real_kind(name, nbytes):
        # the lm_head's output: made in the family's *ForCausalLM.forward (or ZeRO-3's linear function)
        family_forward = name.startswith("transformers/models/") and name.endswith(".py:forward")
        if (name in LOGITS_FRAMES or family_forward) and nbytes == logits:
            return "logits"
        return TRACE_KINDS.get(name)

    real = identities(before_last_phase(ledger_events(ledger_from_trace(trace), real_kind), phases))
    L = build_ledger(job, steps=row.get("steps", 3), skipped=skipped_steps(row))
    predicted = identities(before_last_phase(ledger_events(L, lambda name, nbytes: LEDGER_KINDS.get(name)), phases))
    assert len(real) >= 3  # the positions, the first input ids, the first logits at least
    assert predicted == real


# -- CPU traces of the worker ---------------------------------------------------------------------------------
def _flags(tmp: Path, loop: str, ga: int) -> list[str]:
    model = tmp / "tiny-llama.json"
    model.write_text(json.dumps(TINY))
    ds = tmp / "ds.json"
    ds.write_text(json.dumps({  # "auto" for the Trainer (it fills them), the same values for the DeepSpeed loop
        "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto" if loop == "hf-trainer" else 4096,
                              "overlap_comm": False},
        "bf16": {"enabled": "auto" if loop == "hf-trainer" else True},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto" if loop == "hf-trainer" else 5e-5, "torch_adam": True}},
        **({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto", "gradient_clipping": "auto"} if loop == "hf-trainer" else
           {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": ga, "train_batch_size": 2 * ga,
            "gradient_clipping": 1.0})}))
    return ["--model", str(model), "--ds-config", str(ds), "--loop", loop, "--gpus", "1", "--micro-batch", "2",
            "--grad-accum", str(ga), "--seq", "40", "--steps", "2", "--dtype", "bf16", "--attention", "sdpa"]


def _record(tmp: Path, flags: list[str]) -> dict:
    out = tmp / "events.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "_loop_trace.py"), str(out), *flags], check=False,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["status"] == "ok", got["error"]
    return got


def _job(flags: list[str]):
    from memplan.verify import command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return command.job_and_options(parser.parse_args(flags))[0]


def cpu_events(got: dict, kind_of) -> list[tuple]:
    """The recorded events ``kind_of(event)`` names, a tensor allocated and freed inside one op (a CPU kernel's
    temporary) dropped."""
    events, opened = [], {}
    for e in got["events"]:
        if e["bytes"] > 0:
            kind = kind_of(e)
            if kind:
                opened[e["addr"]] = (len(events), e["outer"])
                events.append((e["phase"], kind, e["addr"], e["bytes"]))
        elif e["addr"] in opened:
            at, outer = opened.pop(e["addr"])
            if outer >= 0 and e["outer"] == outer:
                events[at] = None
                continue
            events.append((e["phase"], events[at][1], e["addr"], e["bytes"]))
    return [e for e in events if e is not None]


def before_last_phase(events: list[tuple], phases: list[str]) -> list[tuple]:
    """The events of every phase but the last: the last phase's span runs on after the loop (what the worker
    frees as it returns, which the ledger leaves out: nothing is measured there)."""
    keep = set(phases[:-1])
    return [e for e in events if e[0] in keep]


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["loss", "outputs"])
def test_deepspeed_loop_matches_the_cpu_trace(tmp_path, loop):
    flags = _flags(tmp_path, loop, ga=2)
    got = _record(tmp_path, flags)
    logits = 2 * 40 * TINY["vocab_size"] * 2

    def real_kind(e):
        if e["outer_op"] == "aten::randint" or (e["outer_op"] == "aten::arange" and e["gap"]):
            return "inputs"
        if e["bytes"] == logits and e["phase"].endswith("forward") and not e["gap"]:
            return "logits"
        return None

    kinds = {"loop.position_ids": "inputs", "loop.input_ids": "inputs", "lm_head": "logits"}
    real = identities(before_last_phase(cpu_events(got, real_kind), got["phases"]))
    L = build_ledger(_job(flags), steps=2)
    predicted = identities(before_last_phase(ledger_events(L, lambda n, b: kinds.get(n)), got["phases"]))
    assert [e for e in real if e[1] == "logits" and e[2] < 0]  # the loop's choice is seen
    assert predicted == real


@pytest.mark.slow
def test_trainer_loop_matches_the_cpu_trace(tmp_path):
    """Three micro-steps a window: the list of batches dies last item first, the loop variable's batch last."""
    flags = _flags(tmp_path, "hf-trainer", ga=3)
    got = _record(tmp_path, flags)
    assert got["phases"][:7] == ["init", "step0.micro0.forward", "step0.micro0.backward", "step0.micro1.forward",
                                 "step0.micro1.backward", "step0.micro2.forward", "step0.micro2.backward"]

    def real_kind(e):
        if "memplan.device_copy" in e["tags"]:
            return "batch"
        if "memplan.num_items" in e["tags"] and e["outer"] >= 0:  # wrapped Python numbers have no op
            return "count"
        return None

    kinds = {"trainer.batch.input_ids": "batch", "trainer.batch.labels": "batch", "trainer.labels_ne": "count",
             "trainer.labels_count": "count", "trainer.num_items_in_batch": "count"}
    real = identities(before_last_phase(cpu_events(got, real_kind), got["phases"]))
    L = build_ledger(_job(flags), steps=2)
    predicted = identities(before_last_phase(ledger_events(L, lambda n, b: kinds.get(n)), got["phases"]))
    assert sum(1 for e in real if e[1] == "batch" and e[2] < 0) == 6  # the first window's batches die
    assert predicted == real
    assert [label for label, _, _ in L.phase_spans()] == got["phases"]
