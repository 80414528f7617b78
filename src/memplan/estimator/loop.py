"""The training loop around the engine, as ledger events: what the Python code of each loop allocates on the GPU
and keeps alive between the forward, ``engine.backward`` and ``engine.step`` (TrainingSpec.loop).

``outputs`` and ``loss`` are memplan.verify's DeepSpeed loop (verify/worker.py ``train``): the positions
(``torch.arange(shard)`` on the device, kept for the run), then per micro-step ``ids = torch.randint(...,
device=device)`` (input_ids = labels) before the forward and ``del ids`` after the step;
``outputs`` keeps the model output object (its loss and logits) until the next forward returns and rebinds the
name (the old object's fields die in order: loss, then logits); ``loss`` keeps only ``.loss``, the output object
dying as the forward returns, until ``del loss`` after ``engine.backward``.

``hf-trainer`` is transformers 5.17's Trainer driving DeepSpeed through accelerate 1.15 (verify/trainer.py runs
it): ``Trainer._run_epoch`` fetches one window of ``gradient_accumulation_steps`` batches before its first
micro-step (``get_batch_samples``: accelerate's DataLoaderShard copies each batch to the device with
send_to_device, input_ids then labels, [B, S] int64 each; the window's list keeps them until the next window's
list replaces it, the loop variable ``inputs`` the last one until the next window's first micro-step), counts
the labels (``_get_num_items_in_batch``: ``sum(labels[..., 1:].ne(-100).sum() …)``, then with world > 1
accelerate's gather — ``tensor.clone()[None]``, ``torch.empty(world)`` — and ``.sum()``), and keeps that count
for the window. ``compute_loss`` passes it to the model: ForCausalLMLoss sums (reduction "sum") and divides by
it (fixed_cross_entropy), and ``loss *= world`` (average_tokens_across_devices) runs in place; the output object
dies as compute_loss returns. ``accelerator.backward`` → DeepSpeedEngineWrapper.backward calls
``engine.backward(loss, scale_wrt_gas=False)`` and, at the accumulation boundary only, ``engine.step()``: the
Trainer's phases have a ``…step`` at the boundary micro-step alone. ``training_step`` returns ``loss.detach()``
(the loss's storage), kept as ``tr_loss_step`` until the next micro-step's training_step returns; then
``torch.isnan(tr_loss_step) or torch.isinf(tr_loss_step)`` (isinf = ``abs() == inf``) and ``_tr_loss +=`` in
place. Before deepspeed.initialize ``Accelerator.free_memory`` empties the cache; ``_tr_loss`` (a 0-d fp32) is
made before on_train_begin. The gradient norm the Trainer logs is the engine's (get_global_grad_norm, no
allocation); the optimizer and scheduler wrappers' ``step`` and ``model.zero_grad()`` allocate nothing.

``engine.backward`` (DeepSpeed 0.19.8 runtime/engine.py): ``loss / gradient_accumulation_steps()`` unless
scale_wrt_gas is False, then a ZeRO optimizer's ``scale_if_loss`` (loss_scaler.scale_loss: ``loss * scale``;
BF16_Optimizer, stage 0 in bf16, has none), ``backward()`` from that, the epilogue, and the two scalars dropped
as it returns. Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Callable

from ..ledger import Ledger
from ..specs import Job
from .autograd import Autograd, Tensor

INT64, FP32, BOOL = 8, 4, 1
INPUTS, SCALARS = "inputs", "loop_scalars"


class Loop:
    """What both loops share. A loop's ``run(steps, forward, engine, step)`` calls ``forward()`` (the model's,
    returning its Output), the engine's ``end_backward(ag, boundary)`` and ``step(index, boundary)`` (the
    optimizer step, or the fp16 skip)."""

    def __init__(self, L: Ledger, ag: Autograd, job: Job):
        t, lay = job.training, job.layout
        self.L, self.ag, self.job = L, ag, job
        self.batch, self.seq, self.ga = t.micro_batch, t.seq_len // lay.sp, t.grad_accum
        self.world = lay.world  # the processes accelerate counts (TrainingArguments.world_size)
        self.scaler = t.zero.stage >= 1  # DeepSpeedZeroOptimizer / stage 3 keep a loss_scaler

    def scalar(self, name: str, nbytes: int) -> Tensor:
        return self.ag.empty(name, nbytes, component=SCALARS)

    def engine_backward(self, loss: Tensor, engine, boundary: bool, scale_wrt_gas: bool) -> None:
        """engine.backward(loss): its scalars, backward, the epilogue; the scalars die as it returns."""
        ag = self.ag
        made = []
        if scale_wrt_gas:
            loss = ag.op("engine.loss_over_gas", FP32, (loss,), component=SCALARS)
            made.append(loss)
        if self.scaler:
            loss = ag.op("engine.scaled_loss", FP32, (loss,), component=SCALARS)
            made.append(loss)
        ag.backward(loss, FP32)
        engine.end_backward(ag, boundary)
        for t in reversed(made):
            ag.release(t)


class DeepSpeedLoop(Loop):
    """memplan.verify's worker loop, ``outputs`` or ``loss`` (see the module docstring)."""

    def run(self, steps: int, forward: Callable, engine, step: Callable[[int, bool], None]) -> None:
        L, ag = self.L, self.ag
        keep_outputs = self.job.training.loop == "outputs"
        # ``positions = torch.arange(shard, device=device)…expand(B, -1)``, made whatever sp (passed when sp > 1)
        ag.empty("loop.position_ids", INT64 * self.seq, component=INPUTS)
        kept = None  # the previous micro-step's output object (outputs loop)
        for s in range(steps):
            for m in range(self.ga):
                ids = ag.empty("loop.input_ids", INT64 * self.batch * self.seq, component=INPUTS)
                L.mark(f"step{s}.micro{m}.forward")
                out = forward()
                if kept is not None:  # the name is rebound: the old object's loss, then its logits die
                    ag.release(kept.loss)
                    ag.release(kept.logits)
                    ag.release_leaves(kept.leaves)  # with them the graph
                if keep_outputs:
                    kept = out
                    ag.ref(out.loss)  # ``loss = outputs.loss``
                else:
                    ag.release(out.logits)
                L.mark(f"step{s}.micro{m}.backward")
                boundary = m == self.ga - 1
                self.engine_backward(out.loss, engine, boundary, scale_wrt_gas=True)
                ag.release(out.loss)  # del loss
                if not keep_outputs:
                    ag.release_leaves(out.leaves)  # the graph dies with the loss
                L.mark(f"step{s}.micro{m}.step")
                step(s, boundary)
                ag.release(ids)  # del ids


class TrainerLoop(Loop):
    """transformers' Trainer through accelerate (see the module docstring)."""

    def before_initialize(self) -> None:
        """Trainer._inner_training_loop: accelerator.free_memory() (release_memory: gc, empty_cache)."""
        from ..ledger import EMPTY_CACHE

        self.L.mark("accelerator.free_memory", EMPTY_CACHE)

    def after_initialize(self) -> None:
        """``self._tr_loss = torch.tensor(0.0, device=args.device)``, kept for the whole run."""
        self.scalar("trainer._tr_loss", FP32)

    def _window(self, old: list | None, old_count: Tensor | None) -> tuple[list, Tensor]:
        """get_batch_samples for one window; then the old window's list and count are rebound (freed)."""
        ag, b, s = self.ag, self.batch, self.seq
        batches = [(ag.empty("trainer.batch.input_ids", INT64 * b * s, component=INPUTS),
                    ag.empty("trainer.batch.labels", INT64 * b * s, component=INPUTS)) for _ in range(self.ga)]
        total = None  # builtin sum: temp = result + item; then result, then item, are released
        for _ in range(self.ga):
            ne = ag.empty("trainer.labels_ne", BOOL * b * (s - 1), component=INPUTS)
            item = self.scalar("trainer.labels_count", INT64)
            ag.release(ne)
            new = self.scalar("trainer.num_items_in_batch", INT64)
            ag.release(total)
            ag.release(item)
            total = new
        if self.world > 1:  # accelerator.gather(num_items).sum() (accelerate.utils.operations._gpu_gather)
            clone = self.scalar("trainer.gather.clone", INT64)
            gathered = self.scalar("trainer.gather.output", INT64 * self.world)
            ag.release(clone)
            summed = self.scalar("trainer.num_items_in_batch", INT64)
            ag.release(gathered)
            ag.release(total)
            total = summed
        if old is not None:  # ``batch_samples, num_items_in_batch = ...``: the list dies last item first,
            for ids, labels in reversed(old[:-1]):  # the loop variable ``inputs`` still holds the last
                ag.release(ids)
                ag.release(labels)
            ag.release(old_count)
            ag.release(old[-1][0])  # ``for i, inputs in enumerate(batch_samples)`` rebinds inputs
            ag.release(old[-1][1])
        return batches, total

    def run(self, steps: int, forward: Callable, engine, step: Callable[[int, bool], None]) -> None:
        L, ag = self.L, self.ag
        window, count, tr_loss_step = None, None, None
        for s in range(steps):
            window, count = self._window(window, count)
            for m in range(self.ga):
                L.mark(f"step{s}.micro{m}.forward")
                out = forward()
                loss = ag.op("trainer.loss_over_num_items", FP32, (out.loss,), component=SCALARS)
                ag.release(out.loss)  # fixed_cross_entropy rebinds ``loss``: the summed nll dies
                ag.release(out.logits)  # compute_loss returns: the output object dies
                L.mark(f"step{s}.micro{m}.backward")
                boundary = m == self.ga - 1
                self.engine_backward(loss, engine, boundary, scale_wrt_gas=False)
                ag.release_leaves(out.leaves)  # training_step returns loss.detach(): the graph dies
                if boundary:
                    L.mark(f"step{s}.micro{m}.step")
                    step(s, boundary)
                ag.release(tr_loss_step)  # ``tr_loss_step = self.training_step(...)``: loss.detach() kept
                tr_loss_step = loss
                ag.release(self.scalar("trainer.isnan", BOOL))
                absolute = self.scalar("trainer.isinf.abs", FP32)
                inf = self.scalar("trainer.isinf", BOOL)
                ag.release(absolute)
                ag.release(inf)


def make_loop(L: Ledger, ag: Autograd, job: Job) -> Loop:
    """The job's loop (TrainingSpec.loop)."""
    return (TrainerLoop if job.training.loop == "hf-trainer" else DeepSpeedLoop)(L, ag, job)
