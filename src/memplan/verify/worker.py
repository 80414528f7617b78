"""One measurement process: `python -m memplan.verify.worker TASK.json` (see memplan.verify for the protocol).

TASK.json (written by memplan.verify.runner): name, job (Job.model_dump()), hf_config, num_layers (None:
the full depth), steps, device ("cuda" or "cpu"), mode ("emulated" or "real"), out_dir. Each rank writes
its row to out_dir/rank<r>.json atomically; tracebacks go to stderr, which the parent sends to a log file.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from typing import Any

from ..dsconfig_emit import to_ds_config
from ..specs import Job
from . import autotp, hfbuild, pipeline, trainer
from .envinfo import environment, write_json_atomic
from .phases import Meter, Recorder, TimelineHooks, backward_marks


class Unsupported(Exception):
    """The job asks for something this harness cannot measure faithfully."""


def check_supported(job: Job, mode: str = "emulated") -> None:
    """Refuse what the transformers + DeepSpeed path cannot run as the estimator models it."""
    t, lay = job.training, job.layout
    if t.checkpointing == "selective":
        raise Unsupported("selective checkpointing: transformers only offers full-layer checkpointing")
    reason = autotp.unsupported_reason(job, mode) if lay.tp > 1 else None
    reason = reason or (pipeline.unsupported_reason(job) if lay.pp > 1 else None)
    if reason:
        raise Unsupported(reason)
    if t.layer_backward_hooks != "none" and t.loop == "hf-trainer":
        raise Unsupported("layer_backward_hooks with the hf-trainer loop: this harness adds them in its DeepSpeed loop")
    if lay.sp > 1 and job.model.family == "gpt2":
        raise Unsupported("Ulysses sp > 1 on gpt2: DeepSpeed's UlyssesSPAttentionHF fails on transformers' GPT-2")
    if lay.sp > 1 and t.attention == "eager":
        raise Unsupported("Ulysses sp > 1 with eager attention: DeepSpeed refuses it (needs a 4D mask)")


def setup_distributed(task: dict[str, Any], world: int) -> tuple[int, int]:
    """(rank, local_rank): torch's fake process group for emulated ranks, NCCL/gloo under torchrun."""
    import torch
    import torch.distributed as dist

    if task["mode"] == "emulated":
        from torch.testing._internal.distributed.fake_pg import FakeStore

        rank = int(task.get("emulated_rank", 0))  # pp: the last stage is emulated as rank world - 1
        os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))
        if task["device"] == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    else:
        local = int(os.environ["LOCAL_RANK"])
        if task["device"] == "cuda":
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if task["device"] == "cuda" else "gloo")
    import deepspeed

    deepspeed.init_distributed()
    if task["mode"] == "emulated":
        from .emulation import keep_collectives_finite

        keep_collectives_finite()
    return dist.get_rank(), int(os.environ["LOCAL_RANK"])


def attention_context(job: Job):
    """sdpa restricted to FlashAttention for --attention flash; nothing otherwise."""
    if job.training.attention != "flash":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.FLASH_ATTENTION)


def initialize(task: dict[str, Any], job: Job, device: str):
    """Build the model and wrap it: (engine, model, sp_rank). Runs inside the "init" phase."""
    import deepspeed

    ds_config = to_ds_config(job)
    config = hfbuild.make_config(task["hf_config"], task.get("num_layers"))
    model = hfbuild.build_model(config, job, ds_config, device)
    mpu, sp_rank = None, 0
    if job.layout.sp > 1:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        mpu = UlyssesSPAttentionHF.register_with_transformers(
            model_name_or_path=model, core_attn_implementation=hfbuild.ATTN_IMPLEMENTATION[job.training.attention],
            sequence_parallel_size=job.layout.sp, micro_batch_size=job.training.micro_batch,
            seq_length=job.training.seq_len, seq_length_is_variable=False)
        sp_rank = mpu.get_sequence_parallel_rank()
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA / frozen groups: as users pass them
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=ds_config, mpu=mpu)
    return engine, model, sp_rank


def train(engine, model, job: Job, rec: Recorder, steps: int, device: str, sp_rank: int) -> None:
    """`steps` optimizer steps of grad_accum micro-steps; forward / backward / step are separate phases.

    The loop is the job's (``TrainingSpec.loop``): ``outputs`` is DeepSpeed's tutorial loop, ``outputs =
    engine(...); engine.backward(outputs.loss); engine.step()``, so the output object (its logits) stays alive
    until the next forward returns and rebinds the name; ``loss`` keeps only the loss tensor of the forward."""
    import torch

    t = job.training
    shard = t.seq_len // job.layout.sp
    vocab = model.config.get_text_config().vocab_size
    positions = torch.arange(sp_rank * shard, (sp_rank + 1) * shard, device=device).unsqueeze(0).expand(t.micro_batch, -1)
    extra = {"position_ids": positions} if job.layout.sp > 1 else {}
    # backward marks: the job's own full backward hooks where it asks for them, else tensor hooks that hold nothing
    marks = "tensor" if backward_marks(t) else "none"
    keep_outputs = t.loop == "outputs"
    outputs = None
    with attention_context(job):
        for s in range(steps):
            for m in range(t.grad_accum):
                hooks = None
                first = s == m == 0  # the timeline's micro-step
                module_hooks = t.layer_hooks_in(s * t.grad_accum + m)
                if first or module_hooks:
                    hooks = TimelineHooks(rec, hfbuild.decoder_layers(model), hfbuild.final_modules(model) if first
                                          else [], "module" if module_hooks else marks)
                ids = torch.randint(0, vocab, (t.micro_batch, shard), device=device)
                rec.begin(f"step{s}.micro{m}.forward")
                if keep_outputs:
                    outputs = engine(input_ids=ids, labels=ids, **extra)  # the previous outputs die here
                    loss = outputs.loss
                else:
                    loss = engine(input_ids=ids, labels=ids, **extra).loss
                rec.end()
                rec.begin(f"step{s}.micro{m}.backward")
                engine.backward(loss)
                rec.end()
                del loss
                if hooks:
                    hooks.remove()
                rec.begin(f"step{s}.micro{m}.step")
                before = int(getattr(engine, "skipped_steps", 0))
                engine.step()
                rec.end()
                if m == t.grad_accum - 1 and int(getattr(engine, "skipped_steps", 0)) > before:
                    rec.skipped.append(s)  # the fp16 loss scaler skipped this optimizer step
                del ids
    del outputs


def parameter_counts(model) -> dict[str, int]:
    """Trainable and frozen parameters of the built model (ZeRO-3: the full sizes, ds_numel)."""
    counts = {"trainable_params": 0, "frozen_params": 0}
    for p in model.parameters():
        counts["trainable_params" if p.requires_grad else "frozen_params"] += int(getattr(p, "ds_numel", p.numel()))
    return counts


def _is_oom(exc: BaseException) -> bool:
    import torch

    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]


def measure(task: dict[str, Any]) -> dict[str, Any]:
    """Run the task in this process and return this rank's row (never raises for a failed measurement)."""
    t0 = time.perf_counter()
    job = Job.model_validate(task["job"])
    row: dict[str, Any] = {"status": "ok", "error": None, "rank": 0, "mode": task["mode"],
                           "num_layers": task.get("num_layers") or job.model.num_layers, "phases": [], "timeline": []}
    rec = None
    try:
        check_supported(job, task["mode"])
        rank, local = setup_distributed(task, job.layout.world)
        row["rank"] = rank
        device = f"cuda:{local}" if task["device"] == "cuda" else "cpu"
        rec = Recorder(Meter(device), trace=bool(task.get("trace")) and task["device"] == "cuda")
        rec.start_trace()
        rec.begin("init")
        if job.layout.pp > 1:
            engine, model, config = pipeline.initialize(task, job, device)
            rec.end()
            row.update(pipeline.stage_note(engine))
            pipeline.train(engine, config, job, rec, task["steps"], device)
        elif job.training.loop == "hf-trainer":  # a real transformers.Trainer (verify/trainer.py)
            reason = trainer.unsupported_reason(task, job)
            if reason:
                raise Unsupported(reason)
            engine = trainer.run(task, job, rec, device, row)
        else:
            engine, model, sp_rank = initialize(task, job, device)
            rec.end()
            row.update(parameter_counts(model))
            if job.layout.tp > 1:
                autotp.seed_batches()  # every rank of a TP group draws the same token batches
                row.update(autotp.tp_note(engine))
            train(engine, model, job, rec, task["steps"], device, sp_rank)
        # steps the loss scaler / overflow check skipped: until one succeeds no optimizer state exists
        row["skipped_steps"] = int(getattr(engine, "skipped_steps", 0))
        row["skipped_step_indices"] = list(rec.skipped)
        row["global_steps"] = int(getattr(engine, "global_steps", 0))
    except Unsupported as exc:
        row.update(status="unsupported", error=str(exc))
    except Exception as exc:  # noqa: BLE001 - every failure is a result, logged in full to stderr
        traceback.print_exc()
        where = rec.current if rec else "setup"
        if _is_oom(exc):
            label = rec.last_label() if rec else None
            row.update(status="oom", error=f"measured: OOM in {where}" + (f" ({label})" if label else ""),
                       oom_phase=where)
        else:
            row.update(status="error", error=f"{_one_line(exc)} (in {where})")
    if rec:
        row.update(phases=rec.phases, timeline=rec.timeline, **rec.summary())
        row.update(rec.finish(task["out_dir"], row["rank"]))
    try:
        row["env"] = environment(task["device"])
    except Exception as exc:  # noqa: BLE001 - a broken CUDA must not lose the row
        row["env"] = {"error": _one_line(exc)}
    row["attention_backend"] = _attention_note(job)
    if row["rank"] == 0 and task.get("meta_pass", True):
        row.update(_meta_counts(task, job))
    row["wall_s"] = round(time.perf_counter() - t0, 3)
    return row


def _attention_note(job: Job) -> str:
    impl = hfbuild.ATTN_IMPLEMENTATION[job.training.attention]
    if job.training.attention == "flash":
        return "sdpa with torch's FLASH_ATTENTION backend forced (flash-attn package not used)"
    return impl


def _meta_counts(task: dict[str, Any], job: Job) -> dict[str, Any]:
    """The meta-device parameter count of the full-depth model against memplan's analytic count."""
    out: dict[str, Any] = {"meta_params": None, "analytic_params": None}
    try:
        out["meta_params"] = hfbuild.meta_param_count(task["hf_config"])
        out["analytic_params"] = hfbuild.analytic_param_count(job.model)
    except Exception as exc:  # noqa: BLE001 - a side measurement; the row notes why it is missing
        traceback.print_exc()
        out["meta_error"] = _one_line(exc)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as fh:
        task = json.load(fh)
    row = measure(task)
    write_json_atomic(os.path.join(task["out_dir"], f"rank{row['rank']}.json"), row)
    if task["mode"] == "real":
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
