"""The estimator's engine side against the real allocation order of DeepSpeed 0.19.8 on the CPU.

Each case is a tiny Llama job; tools/deepspeed_cpu_trace.py runs it as `memplan verify --device cpu` does (fake
process group, DS_ACCELERATOR=cpu, the emitted DeepSpeed config, zero.Init for ZeRO-3, two optimizer steps) under
torch's profiler, and the engine's events (memplan.estimator.engine_check) must match the ledger's CPU run
(build_ledger(cpu_run=True)) event for event: sizes, order and which tensor each free releases.

What a CPU run cannot show, and the ledger models from DeepSpeed's and torch's code instead: pinned memory
(pin_memory is a no-op on the CPU accelerator), host→GPU copies (``t.to(device)`` of a host tensor is the tensor
itself there: offload_param's partition copies, partition_grads' GPU staging under offload_optimizer), the host
temporaries of CUDA's converting copies, streams, and cuBLAS workspaces.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

from memplan.estimator import engine_check, model_check
from memplan.hfconfig import model_from_config
from memplan.specs import Job, Layout, TrainingSpec, ZeroSpec

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "deepspeed_cpu_trace.py"
STEPS = 2

#: small ZeRO-3 knobs: several reduce buckets and sub-groups, no prefetch, few persistent parameters
KNOBS = {"reduce_bucket_size": 300_000, "sub_group_size": 400_000, "stage3_prefetch_bucket_size": 0,
         "stage3_param_persistence_threshold": 1000, "stage3_max_reuse_distance": 300_000}

CASES = {
    "z3-sgd": {"optimizer": "sgd", "zero": {"stage": 3}},
    "z3-offload-optimizer-ga2": {"optimizer": "cpu_adam", "grad_accum": 2,
                                 "zero": {"stage": 3, "offload_optimizer": "cpu"}},
    "z3-offload-param-sgd": {"optimizer": "sgd", "zero": {"stage": 3, "offload_param": "cpu"}},
    "z3-offload-all-w1": {"optimizer": "cpu_adam", "world": 1,
                          "zero": {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}},
    "z3-offload-all-knobs-w4": {"optimizer": "cpu_adam", "world": 4, "grad_accum": 2,
                                "zero": {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu", **KNOBS}},
    "z3-knobs-w4": {"optimizer": "sgd", "world": 4, "grad_accum": 2, "zero": {"stage": 3, **KNOBS}},
    "z1-bf16-optimizer-ga2": {"optimizer": "sgd", "grad_accum_dtype": "fp32", "grad_accum": 2, "zero": {"stage": 1}},
    "z2-sgd": {"optimizer": "sgd", "zero": {"stage": 2}},
    # fp32 accumulation at stage 2: the compact fp32 partition, no grads_in_partition, slices bound for another
    # rank merged (use_multi_rank_bucket_allreduce)
    "z2-fp32-accumulation-ga2-w4": {"optimizer": "sgd", "grad_accum": 2, "grad_accum_dtype": "fp32", "world": 4,
                                    "zero": {"stage": 2, "reduce_bucket_size": 300_000}},
    # no ZeRO, a basic optimizer that is not a FusedAdam: FP16_UnfusedOptimizer (DDP_BFLOAT16 in bf16), an fp32
    # copy per parameter, per-parameter fp32 grads at the step
    "z0-unfused-sgd-ga2": {"optimizer": "sgd", "grad_accum": 2, "zero": {"stage": 0}},
    # a recompute under ZeRO-3 gathers every module's weight again, and the checkpoint keeps each gathered storage
    # (x.detach() of the saved weight) until its node has run in backward; torch recomputes at the first unpack
    # of a saved tensor, after the PreBackwardFunction of the region's last module has gathered its weight
    "z3-checkpointing": {"optimizer": "cpu_adam", "checkpointing": "full",
                         "zero": {"stage": 3, "offload_optimizer": "cpu"}},
    # from the second micro-step the recorded trace (recompute included) decides what __params_to_release keeps
    "z3-checkpointing-knobs-ga2-w4": {"optimizer": "cpu_adam", "checkpointing": "full", "world": 4, "grad_accum": 2,
                                      "zero": {"stage": 3, "offload_optimizer": "cpu", **KNOBS}},
}


#: a prefetch bucket smaller than one MLP weight and a max_live of about one: which parameter each fetch prefetches
#: depends on every fetch_sub_module call of the trace, parameter-less modules' included
PREFETCH = {"optimizer": "cpu_adam", "checkpointing": "full", "world": 4, "grad_accum": 2,
            "zero": {"stage": 3, "offload_optimizer": "cpu", "stage3_prefetch_bucket_size": 15_000,
                     "stage3_max_live_parameters": 300_000, "stage3_max_reuse_distance": 300_000,
                     "stage3_param_persistence_threshold": 1000}}


def tiny_job(optimizer: str, zero: dict, world: int = 2, **training) -> Job:
    spec = model_from_config(dict(model_check.TINY["llama"]), "tiny", "tiny test config")
    return Job(model=spec, training=TrainingSpec(seq_len=64, optimizer=optimizer, zero=ZeroSpec(**zero), loop="loss",
                                                 **training), layout=Layout(world=world))


def _run(job: Job, folder: Path) -> tuple[int, str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    job_file, out = folder / "job.json", folder / "trace.json"
    job_file.write_text(job.model_dump_json())
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, str(TOOL), str(job_file), str(out), str(STEPS)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900, check=False)
    return done.returncode, done.stderr[-3000:], out


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """Every case's CPU trace, recorded by concurrent tool processes (most of each is import time)."""
    from concurrent.futures import ThreadPoolExecutor

    root = tmp_path_factory.mktemp("traces")
    with ThreadPoolExecutor(max_workers=4) as pool:
        cases = {**CASES, "z3-prefetch": PREFETCH}
        futures = {name: pool.submit(_run, tiny_job(**kw), root / name) for name, kw in cases.items()}
        return {name: f.result() for name, f in futures.items()}


def assert_engine_matches(job: Job, trace) -> None:
    rc, err, out = trace
    assert rc == 0, err
    real = engine_check.real_events(json.loads(out.read_text())["events"])
    predicted = engine_check.predicted_events(job, STEPS)
    at = engine_check.first_mismatch(real, predicted)
    assert at is None, (f"event {at} of {len(real)} real / {len(predicted)} predicted:\n"
                        + engine_check.describe(real, predicted, at))


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_engine_events_match_cpu_trace(case, traces):
    assert_engine_matches(tiny_job(**CASES[case]), traces[case])


@pytest.mark.slow
def test_zero3_prefetch_matches_cpu_trace(traces):
    """DeepSpeedZeRoOffload hooks every module: the parameter-less ones (rotary_emb, each decoder layer, self_attn,
    mlp, act_fn, and the base model's output in backward: Net.container) are fetch_sub_module calls too, each a
    step of the trace and a prefetch."""
    assert_engine_matches(tiny_job(**PREFETCH), traces["z3-prefetch"])


def test_projection_keeps_engine_tensors_and_their_frees():
    """engine_check.real_events: engine allocations kept with their frees wherever they happen, the model's
    own tensors and small bookkeeping left out (rows as tools/deepspeed_cpu_trace.py writes them)."""
    rows = [
        [4096, 1, "aten::empty", "", "init", -1],  # a parameter built by transformers
        [8192, 2, "aten::mm", "engine.forward", "step0.micro0.forward", -1],  # an activation
        [1024, 3, "aten::empty", "engine.forward/coord.fetch_sub_module", "step0.micro0.forward", -1],
        [712, 4, "aten::empty", "engine.forward/coord.reset_step", "step0.micro0.forward", -1],
        [-1024, 3, "LinearFunctionForZeroStage3Backward", "engine.backward", "step0.micro0.backward", -1],
        [-8192, 2, "?", "engine.backward", "step0.micro0.backward", -1],
        [-712, 4, "coord.reset_step", "engine.forward/coord.reset_step", "step0.micro0.forward", -1],
        [256, 5, "aten::empty", "z3.step", "step0.micro0.step", -1],
    ]
    assert [e[0] for e in engine_check.real_events(rows)] == [4096, 1024, -1024]


#: a Mixtral MoE block is a ZeRO-3 leaf module by DeepSpeed's default (zero_optimization.leaf_module): one gather of
#: the router's and the experts' parameters around the block, the experts' gathered weights kept alive by
#: grouped_mm's saved transposed views, the block's grads reduced together by its full backward hook
MOE_CASES = {"z3-moe-leaf": {}, "z3-moe-leaf-checkpointing": {"checkpointing": "full"}}


def _moe_job(folder: Path, **training) -> Job:
    config = dict(model_check.TINY["mixtral"], hidden_size=128, intermediate_size=256, num_local_experts=8)
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    spec = model_from_config(config, str(path), "tiny test config")
    return Job(model=spec, training=TrainingSpec(seq_len=64, optimizer="adamw", zero=ZeroSpec(stage=3),
                                                 loop="outputs", **training), layout=Layout(world=2))


def _until(events_rows: list[list], phase: str) -> list[list]:
    """The trace's rows before ``phase`` begins."""
    end = next((i for i, row in enumerate(events_rows) if row[4] == phase), len(events_rows))
    return events_rows[:end]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(MOE_CASES))
def test_moe_leaf_module_matches_cpu_trace_through_the_first_backward(case, tmp_path):
    """Event for event through step 0's forward and backward (the CPU run's bf16 step then overflows on the fake
    process group and skips, which a GPU run does not: the comparison stops at the step)."""
    from memplan.estimator.program import build_ledger

    job = _moe_job(tmp_path, **MOE_CASES[case])
    rc, err, out = _run(job, tmp_path / case)
    assert rc == 0, err
    real = engine_check.real_events(_until(json.loads(out.read_text())["events"], "step0.micro0.step"))
    L = build_ledger(job, 1, cpu_run=True)
    stop = next(m.at for m in L.marks if m.label == "step0.micro0.step")
    # the ledger's phase mark falls after the backward's leftover release, DeepSpeed's inside engine.step: the
    # predicted events may run past the real ones by that release alone
    predicted = engine_check.engine_events(L, L.events[:stop])
    assert 0 <= len(predicted) - len(real) <= 1 and all(n < 0 for n, _ in predicted[len(real):])
    predicted = predicted[:len(real)]
    at = engine_check.first_mismatch(real, predicted)
    assert at is None, (f"event {at} of {len(real)} real / {len(predicted)} predicted:\n"
                        + engine_check.describe(real, predicted, at))


#: frozen parameters under ZeRO-3 (issue 14), on GPT-2's Conv1D (addmm saves the weight, never the bias) and Llama's
#: linears (LinearFunctionForZeroStage3 saves input, weight and bias); weights above the persistence threshold,
#: biases under it. With checkpointing a recompute's frozen gathers are held by the backward module active then
#: (ds_recompute_parameters) until its backward release, trained ones kept by the pack hook's detach until their
#: node runs; lora_A, read by peft's lora.Linear before its own forward, becomes the container's external
#: parameter; the fp32 adapters gather in a flat buffer of their own (one per communication dtype).
#: (TINY config, training fields, LoRA targets or None, dropout, compare from); a MoE case stops at the first step
#: (the CPU run's bf16 step overflows on the fake process group and skips: test_moe_leaf_module_...)
FROZEN_CASES = {
    "gpt2-full-checkpointing": ("gpt2", {"checkpointing": "full", "loop": "loss"}, None, 0.0, "init"),
    "gpt2-lora-checkpointing": ("gpt2", {"checkpointing": "full"}, ("c_attn",), 0.05, "step0.micro0.forward"),
    "gpt2-lora": ("gpt2", {}, ("c_attn", "c_fc"), 0.0, "step0.micro0.forward"),
    "llama-lora-checkpointing": ("llama", {"checkpointing": "full", "loop": "loss"}, ("all-linear",), 0.0,
                                 "step0.micro0.forward"),
    # frozen experts: grouped_mm's saved transposed view keeps a gathered expert past its owner's release
    "mixtral-lora-checkpointing": ("mixtral", {"checkpointing": "full"}, ("q_proj",), 0.0, "step0.micro0.forward"),
    "deepseek-lora-checkpointing": ("deepseek_v3", {"checkpointing": "full"}, ("kv_a_proj_with_mqa",), 0.05,
                                    "step0.micro0.forward"),
}


def _frozen_job(folder: Path, tiny: str, training: dict, targets, dropout: float) -> Job:
    from memplan.specs import LoraSpec

    path = folder / "config.json"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(model_check.TINY[tiny]))
    spec = model_from_config(dict(model_check.TINY[tiny]), str(path), "tiny test config")
    lora = LoraSpec(rank=8, targets=targets, dropout=dropout) if targets else None
    zero = ZeroSpec(stage=3, stage3_param_persistence_threshold=1000)
    return Job(model=spec, training=TrainingSpec(seq_len=64, optimizer="sgd", zero=zero, lora=lora,
                                                 **{"loop": "outputs", **training}), layout=Layout(world=8))


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(FROZEN_CASES))
def test_frozen_parameters_match_cpu_trace(case, tmp_path):
    """Event for event over two optimizer steps, from the model build (from the first forward with LoRA: peft's
    adapters are made on the host and moved, which a CPU run cannot tell apart)."""
    from memplan.estimator.program import build_ledger

    tiny, training, targets, dropout, start = FROZEN_CASES[case]
    moe = "mixtral" in tiny
    job = _frozen_job(tmp_path, tiny, training, targets, dropout)
    rc, err, out = _run(job, tmp_path / case)
    assert rc == 0, err
    rows = json.loads(out.read_text())["events"]
    if moe:
        rows = _until(rows, "step0.micro0.step")
    first = next(i for i, row in enumerate(rows) if row[4] == start)
    real = engine_check.real_events(rows)[len(engine_check.real_events(rows[:first])):]
    L = build_ledger(job, 1 if moe else STEPS, cpu_run=True)
    mark = next(m.at for m in L.marks if m.label == start)
    stop = next((m.at for m in L.marks if m.label == "step0.micro0.step"), None) if moe else None
    predicted = engine_check.engine_events(L, L.events[mark:stop])
    if moe:  # the ledger's step mark falls after the backward's leftover release, DeepSpeed's inside engine.step
        assert 0 <= len(predicted) - len(real) <= 1 and all(n < 0 for n, _ in predicted[len(real):])
        predicted = predicted[:len(real)]
    at = engine_check.first_mismatch(real, predicted)
    assert at is None, (f"event {at} of {len(real)} real / {len(predicted)} predicted:\n"
                        + engine_check.describe(real, predicted, at))
