"""The hf-trainer loop measured through a real ``transformers.Trainer`` (worker side; imports torch lazily).

What a user's script does, in its order: ``TrainingArguments(deepspeed=<the JSON, "auto" and all>, ...)``
first (its HfTrainerDeepSpeedConfig becomes the active DeepSpeed config), then the model with
``AutoModelForCausalLM.from_config`` — under ZeRO-3 transformers itself wraps that in
``deepspeed.zero.Init(config_dict_or_path=deepspeed_config())`` (modeling_utils.py ``get_init_context``,
then ``initialize_weights_zero3``), so no zero.Init of memplan's is added; below ZeRO-3 the model is built on
the device in the training dtype, as the worker builds it — then ``Trainer(model, args, train_dataset)`` and
``trainer.train()``, which fills "auto" (trainer_config_finalize), builds the optimizer and scheduler
(deepspeed_optim_sched) and calls deepspeed.initialize through accelerate.

Phases, named as the worker names them, without changing what the Trainer allocates: ``init`` ends in
``on_train_begin`` (after deepspeed.initialize); ``compute_loss`` runs inside ``step{s}.micro{m}.forward``;
the engine's ``backward`` and ``step`` (accelerate's DeepSpeedEngineWrapper.backward calls both, step at the
accumulation boundary only) run inside ``…backward`` and ``…step``. Batches are random tokens (input_ids =
labels), ``world × micro × accum × (steps + 1)`` of them; logging, saving and evaluation are off.

Emulated ranks: torch's fake process group is initialised before TrainingArguments (worker.setup_distributed).
On a CUDA machine accelerate's PartialState adopts it (LOCAL_RANK set, deepspeed.comm already initialised:
num_processes = the fake world). On the CPU accelerate finds no CUDA device and counts one process, so only
world 1 runs there; the row's ``trainer_note`` says which happened.
"""

from __future__ import annotations

import copy
import math
import os
from typing import Any

from ..specs import Job
from . import hfbuild
from .phases import Recorder, TimelineHooks


def unsupported_reason(task: dict[str, Any], job: Job) -> str | None:
    """Why this harness cannot run ``job`` through the Trainer faithfully (None: it can)."""
    lay = job.layout
    if not task.get("hf"):
        return "--loop hf-trainer needs the Trainer's inputs (memplan verify passes them)"
    if lay.tp > 1 or lay.sp > 1:
        return "tp or sp > 1 through transformers' Trainer: not measured by this harness"
    if task["device"] == "cpu" and lay.world > 1:
        return (f"world {lay.world} on the CPU: accelerate counts one process without a CUDA device, so the "
                "Trainer's batch disagrees with DeepSpeed's; run world 1 on the CPU, or on a GPU")
    return None


class ProcessCountError(RuntimeError):
    """accelerate did not adopt the emulated world (the Trainer's batch would disagree with DeepSpeed's)."""


def _training_arguments(task: dict[str, Any], job: Job):
    """TrainingArguments from the task's modelled fields; max_steps = the task's steps; logging/saving/eval off."""
    from transformers import TrainingArguments

    values = dict(task["hf"]["training_args"])
    for key in ("deepspeed", "max_steps", "num_train_epochs"):
        values.pop(key, None)
    return TrainingArguments(
        output_dir=os.path.join(task["out_dir"], "trainer"), deepspeed=copy.deepcopy(task["hf"]["deepspeed"]),
        max_steps=task["steps"], report_to=[], save_strategy="no", logging_strategy="no", eval_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, seed=0, **values)


def _build_model(task: dict[str, Any], job: Job, device: str):
    """from_config as a script calls it after TrainingArguments (see the module docstring)."""
    import torch
    import transformers

    config = hfbuild.make_config(task["hf_config"], task.get("num_layers"))
    kwargs = {"dtype": hfbuild.torch_dtype(job), "attn_implementation": hfbuild.ATTN_IMPLEMENTATION[job.training.attention]}
    if job.training.zero.stage == 3:
        model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)  # transformers' own zero.Init
    else:
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    hfbuild.freeze(model, job)
    if job.training.lora is not None:  # as TRL and peft's examples do: get_peft_model before the Trainer
        model = hfbuild.add_lora(model, job)
    return model


class _RandomTokens:
    """A map-style dataset of random token rows (input_ids and labels), drawn once."""

    def __init__(self, rows: int, seq: int, vocab: int):
        import torch

        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (rows, seq), generator=gen)

    def __len__(self) -> int:
        return self.ids.shape[0]

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


class _Phases:
    """Phase names step{s}.micro{m}.<what>: s = optimizer steps done (TrainerState.global_step)."""

    def __init__(self, rec: Recorder, model):
        self.rec, self.model = rec, model
        self.step, self.micro = -1, -1
        self.engine = None
        self.hooks = None

    def forward(self, global_step: int) -> None:
        self.step, self.micro = (global_step, 0) if global_step != self.step else (self.step, self.micro + 1)
        if self.step == 0 and self.micro == 0:
            self.hooks = TimelineHooks(self.rec, hfbuild.decoder_layers(self.model), hfbuild.final_modules(self.model),
                                       backward="none")
        self.rec.begin(f"step{self.step}.micro{self.micro}.forward")

    def attach(self, engine) -> None:
        """Bracket the engine's backward and step (instance attributes: nothing else changes)."""
        if self.engine is engine:
            return
        self.engine = engine
        backward, step = engine.backward, engine.step

        def phased_backward(*args, **kwargs):
            self.rec.begin(f"step{self.step}.micro{self.micro}.backward")
            out = backward(*args, **kwargs)
            self.rec.end()
            if self.hooks is not None:
                self.hooks.remove()
                self.hooks = None
            return out

        def phased_step(*args, **kwargs):
            self.rec.begin(f"step{self.step}.micro{self.micro}.step")
            out = step(*args, **kwargs)
            self.rec.end()
            return out

        engine.backward, engine.step = phased_backward, phased_step


def _trainer_class():
    import transformers

    class PhasedTrainer(transformers.Trainer):
        """compute_loss and training_step only call super(), inside the recorder's phases."""

        memplan_phases: _Phases

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.memplan_phases.attach(self.accelerator.deepspeed_engine_wrapped.engine)
            return super().training_step(model, inputs, num_items_in_batch)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            self.memplan_phases.forward(self.state.global_step)
            out = super().compute_loss(model, inputs, return_outputs=return_outputs,
                                       num_items_in_batch=num_items_in_batch)
            self.memplan_phases.rec.end()
            return out

    return PhasedTrainer


def _init_callback(rec: Recorder):
    import transformers

    class EndInit(transformers.TrainerCallback):
        """The init phase ends when training begins (deepspeed.initialize has run)."""

        def on_train_begin(self, args, state, control, **kwargs):
            if rec.current == "init":
                rec.end()

    return EndInit()


def _finite_gather() -> None:
    """The Trainer gathers the label count across ranks (Trainer._get_num_items_in_batch → accelerate gather →
    torch.distributed.all_gather_into_tensor). On the fake group the output stays as torch.empty left it; fill
    it with the rank's own value, as memplan.verify.emulation does for deepspeed.comm."""
    import torch.distributed as dist

    gather = dist.all_gather_into_tensor

    def all_gather_into_tensor(output_tensor, input_tensor, *args, **kwargs):
        work = gather(output_tensor, input_tensor, *args, **kwargs)
        n = input_tensor.numel()
        if n and output_tensor.numel() % n == 0:
            output_tensor.view(-1, n).copy_(input_tensor.reshape(1, n).expand(output_tensor.numel() // n, n))
        return work

    dist.all_gather_into_tensor = all_gather_into_tensor


def _json_safe(value):
    """The engine's config as JSON: non-finite floats (accelerate's steps_per_print = inf) as strings."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _fill_check(task: dict[str, Any], job: Job, got: dict) -> list[str]:
    """Keys where memplan's filled config (memplan.hf, computed by the parent) differs from the Trainer's."""
    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
        return out

    mine, theirs = flat(task["hf"]["ds_config"]), flat({k: v for k, v in got.items() if k != "steps_per_print"})
    return [f"{k}: memplan {mine.get(k, '(absent)')!r}, Trainer {theirs.get(k, '(absent)')!r}"
            for k in sorted(set(mine) | set(theirs)) if mine.get(k, "(absent)") != theirs.get(k, "(absent)")]


def run(task: dict[str, Any], job: Job, rec: Recorder, device: str, row: dict[str, Any]):
    """Train ``task["steps"]`` optimizer steps through a real Trainer; fills ``row``; returns the engine.

    Called inside the worker's "init" phase (after unsupported_reason); the phase ends when training begins."""
    t, world = job.training, job.layout.world
    if task["mode"] == "emulated" and world > 1:
        _finite_gather()
    args = _training_arguments(task, job)
    model = _build_model(task, job, device)
    phases = _Phases(rec, model)
    rows = world * t.micro_batch * t.grad_accum * (task["steps"] + 1)
    dataset = _RandomTokens(rows, t.seq_len, model.config.get_text_config().vocab_size)
    trainer = _trainer_class()(model=model, args=args, train_dataset=dataset, callbacks=[_init_callback(rec)])
    trainer.memplan_phases = phases
    processes = trainer.accelerator.num_processes
    row["trainer_note"] = (f"transformers.Trainer, {processes} process(es) as accelerate counts them"
                           + (f" on torch's fake process group of {world} (emulated ranks)" if world > 1 else "")
                           + ("; the model built by transformers' zero.Init (ZeRO-3)" if t.zero.stage == 3 else
                              "; the model built on the device in the training dtype"))
    if processes != world:
        raise ProcessCountError(f"accelerate counts {processes} processes on the fake group, the job has {world}")
    row["training_args"] = _json_safe(args.to_dict())
    with hfbuild_attention(job):
        trainer.train()
    engine = trainer.accelerator.deepspeed_engine_wrapped.engine
    got = copy.deepcopy(engine.config) if isinstance(engine.config, dict) else {}
    row["trainer_ds_config"] = _json_safe(got)
    row["auto_fill_check"] = _fill_check(task, job, got)
    optimizer = getattr(engine, "basic_optimizer", None)
    row["trainer_optimizer"] = type(optimizer).__name__ if optimizer is not None else None
    row["trainer_scheduler"] = (type(engine.lr_scheduler).__name__ if engine.lr_scheduler is not None else
                                f"{type(trainer.lr_scheduler).__name__} (the Trainer's, stepped outside DeepSpeed)")
    return engine


def hfbuild_attention(job: Job):
    """The worker's attention context (sdpa restricted to FlashAttention for --attention flash)."""
    from .worker import attention_context

    return attention_context(job)


__all__ = ["ProcessCountError", "run", "unsupported_reason"]
