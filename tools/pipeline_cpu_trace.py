"""A memplan pipeline Job (layout.pp > 1) run under DeepSpeed 0.19.8 on the CPU, one stage's allocation trace written
out: the real allocation order of the PipelineEngine for the estimator's pipeline ledger (tests/test_pipeline_trace.py).

Usage: python tools/pipeline_cpu_trace.py JOB.json OUT.json STAGE [STEPS]

The run is what `memplan verify --device cpu` does for one emulated rank of a pipeline job (memplan.verify.pipeline):
DS_ACCELERATOR=cpu, torch's fake process group of ``layout.world`` ranks with this process as the first rank of
STAGE's pipeline (0 for the first stage, world − 1 for the last, as verify's runner emulates them), the stage's
PipelineModule built on the device in the training dtype, deepspeed.initialize, then STEPS ``train_batch`` calls,
each instruction a phase (InstructionPhases' names). OUT.json is tools/deepspeed_cpu_trace.py's format:
{"events": [[bytes, addr, op, frames, phase, kernel], ...]}.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import deepspeed_cpu_trace as base


class Marks:
    """InstructionPhases' recorder: each phase a MARK record_function, as the tool's event projection reads."""

    def begin(self, name: str) -> None:
        from torch.profiler import record_function

        with record_function(f"MARK.{name}"):
            pass

    def end(self) -> None:
        pass


def setup(world: int, rank: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29513"))
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    import deepspeed

    deepspeed.init_distributed()
    from memplan.verify.emulation import keep_collectives_finite

    keep_collectives_finite()


def main(argv: list[str]) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from memplan.specs import Job
    from memplan.verify import hfbuild, pipeline
    from memplan.verify.cputrace import profiler_events

    with open(argv[0]) as fh:
        job = Job.model_validate(json.load(fh))
    stage = int(argv[2])
    steps = int(argv[3]) if len(argv) > 3 else 2
    lay = job.layout
    setup(lay.world, 0 if stage == 0 else lay.world - 1)
    base.annotate()
    torch.manual_seed(0)
    task = {"hf_config": hfbuild.hf_config_dict(job.model), "num_layers": job.model.num_layers, "mode": "emulated"}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        engine, _module, config = pipeline.initialize(task, job, "cpu")
        pipeline.train(engine, config, job, Marks(), steps, "cpu")
    with open(argv[1], "w") as fh:
        json.dump({"events": base.events(profiler_events(prof)), "stage": int(engine.stage_id)}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
