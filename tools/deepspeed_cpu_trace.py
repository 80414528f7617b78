"""A memplan Job run under DeepSpeed 0.19.8 on the CPU, its allocation trace written out: the real allocation order
of rank 0 for the engine-side ledger comparison (tests/test_engine_trace.py, memplan.estimator.engine_check).

Usage: python tools/deepspeed_cpu_trace.py JOB.json OUT.json [STEPS]

JOB.json is a memplan Job (Job.model_dump()); its model must have a config.json (a path or a preset) or be a
Llama-style spec memplan.verify.hfbuild can synthesize. The run is what `memplan verify --device cpu` does on rank 0
of an emulated job: DS_ACCELERATOR=cpu, torch's fake process group of ``layout.world`` ranks, the config
memplan.dsconfig_emit.to_ds_config(job) emits, the model built by memplan.verify.hfbuild.build_model (under
deepspeed.zero.Init for ZeRO-3), deepspeed.initialize, then STEPS optimizer steps of the job's loop ("loss":
``loss = engine(...).loss``; "outputs": the output object kept until the next forward). Everything from the model
build on runs under torch's profiler (profile_memory=True). DeepSpeed's optimizer, coordinator and engine methods
are wrapped in record_function so each event names the DeepSpeed frames it happened in.

OUT.json: {"events": [[bytes, addr, op, frames, phase, kernel], ...]} — +bytes an allocation, −bytes a free; op the
innermost aten op (or annotation); frames the DeepSpeed methods around it, outermost first, "/"-joined; phase the
verify phase ("init", "step0.micro0.forward", …); kernel the index of the outermost enclosing device kernel whose
internal temporaries differ between CPU and CUDA (memplan.verify.cputrace.DEVICE_KERNELS), -1 for none.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

#: DeepSpeed classes whose methods name the frames (prefix: class)
ANNOTATED = {
    "z12": ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer"),
    "z3": ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3"),
    "coord": ("deepspeed.runtime.zero.partitioned_param_coordinator", "PartitionedParameterCoordinator"),
    "engine": ("deepspeed.runtime.engine", "DeepSpeedEngine"),
    "bf16opt": ("deepspeed.runtime.bf16_optimizer", "BF16_Optimizer"),
    "fp16opt": ("deepspeed.runtime.fp16.fused_optimizer", "FP16_Optimizer"),
    "init": ("deepspeed.runtime.zero.partition_parameters", "Init"),
    "cpuadam": ("deepspeed.ops.adam.cpu_adam", "DeepSpeedCPUAdam"),
}


def annotate() -> None:
    """Wrap every method of the ANNOTATED classes in record_function("<prefix>.<name>")."""
    import importlib

    from torch.profiler import record_function

    for prefix, (module, name) in ANNOTATED.items():
        cls = getattr(importlib.import_module(module), name)
        for attr, fn in list(vars(cls).items()):
            if not inspect.isfunction(fn) or attr.startswith("__"):
                continue

            def wrap(fn=fn, label=f"{prefix}.{attr}"):
                @functools.wraps(fn)
                def wrapped(*a, **k):
                    with record_function(label):
                        return fn(*a, **k)
                return wrapped
            setattr(cls, attr, wrap())


def setup(world: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29513"))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    import deepspeed

    deepspeed.init_distributed()
    from memplan.verify.emulation import keep_collectives_finite

    keep_collectives_finite()


def inputs(job, steps: int) -> list:
    """The input ids of every micro-step, made before recording (the ledger has no input tensors)."""
    import torch

    from memplan.verify import hfbuild

    vocab = hfbuild.make_config(hfbuild.hf_config_dict(job.model)).get_text_config().vocab_size
    generator = torch.Generator().manual_seed(0)
    t = job.training
    return [torch.randint(0, vocab, (t.micro_batch, t.seq_len), generator=generator)
            for _ in range(steps * t.grad_accum)]


def run(job, steps: int, ids_list: list) -> None:
    """Build, initialize and train ``job`` as memplan verify does (phases marked by record_function)."""
    import deepspeed
    from torch.profiler import record_function

    from memplan.dsconfig_emit import to_ds_config
    from memplan.verify import hfbuild

    t = job.training
    ds_config = to_ds_config(job)
    config = hfbuild.make_config(hfbuild.hf_config_dict(job.model), job.model.num_layers)
    model = hfbuild.build_model(config, job, ds_config, "cpu")
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=ds_config)
    outputs = None
    for s in range(steps):
        for m in range(t.grad_accum):
            ids = ids_list[s * t.grad_accum + m]
            with record_function(f"MARK.step{s}.micro{m}.forward"):
                pass
            if t.loop == "outputs":
                outputs = engine(input_ids=ids, labels=ids)
                loss = outputs.loss
            else:
                loss = engine(input_ids=ids, labels=ids).loss
            with record_function(f"MARK.step{s}.micro{m}.backward"):
                pass
            engine.backward(loss)
            del loss
            with record_function(f"MARK.step{s}.micro{m}.step"):
                pass
            engine.step()
    del outputs


def events(trace: list[dict]) -> list[list]:
    """[bytes, addr, op, frames, phase, kernel] of every memory event of a chrome trace, in time order."""
    from memplan.verify.cputrace import DEVICE_KERNELS

    ops = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in trace
                 if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation"))
    marks = sorted((e["ts"], e["name"][5:]) for e in trace if e.get("name", "").startswith("MARK."))
    mem = sorted((e for e in trace if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    prefixes = tuple(f"{p}." for p in ANNOTATED)
    out, active, nxt = [], [], 0  # a sweep over time: the ops that enclose the current event
    for e in mem:
        ts, nbytes = e["ts"], int(e["args"]["Bytes"])
        while nxt < len(ops) and ops[nxt][0] <= ts:
            active.append(nxt)
            nxt += 1
        active = [k for k in active if ops[k][1] >= ts]
        inner = [(k, ops[k]) for k in active]
        frames = "/".join(o[2] for _, o in inner if o[2].startswith(prefixes))
        op = min(inner, key=lambda ko: ko[1][1] - ko[1][0])[1][2] if inner else "?"
        phase = next((label for at, label in reversed(marks) if at <= ts), "init")
        kernels = [k for k, o in inner if any(d in o[2] for d in DEVICE_KERNELS)]
        kernel = max(kernels, key=lambda k: ops[k][1] - ops[k][0]) if kernels else -1
        out.append([nbytes, int(e["args"]["Addr"]), op, frames, phase, kernel])
    return out


def main(argv: list[str]) -> int:
    from memplan.specs import Job

    with open(argv[0]) as fh:
        job = Job.model_validate(json.load(fh))
    steps = int(argv[2]) if len(argv) > 2 else 2
    import torch
    from torch.profiler import ProfilerActivity, profile

    from memplan.verify.cputrace import profiler_events

    setup(job.layout.world)
    annotate()
    torch.manual_seed(0)
    ids_list = inputs(job, steps)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run(job, steps, ids_list)
    trace = profiler_events(prof)
    with open(argv[1], "w") as fh:
        json.dump({"events": events(trace)}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
