"""The pipeline engine's instructions on one stage, as allocation events: ``PipeStage`` holds DeepSpeed 0.19.8's
PipelineEngine pipe buffers (runtime/pipe/engine.py: _exec_load_micro_batch, _exec_recv_activations,
_exec_forward_pass, _exec_send_activations, _exec_recv_grads, _exec_backward_pass, _exec_send_grads) and the
stage's persistent tensors across train_batch calls; estimator/pipeline.py runs the schedule on it. What each
instruction allocates and keeps:

- LoadMicroBatch: the data iterator's ``torch.randint`` ids on the device (the generator frame keeps the last
  ones until it makes the next); the first stage keeps ``ids.clone()`` as its input buffer, the last stage the ids
  themselves as its labels buffer, each until the same buffer id is loaded again.
- RecvActivation (later stages): the first one allocates the receive buffers (the hidden states, and Llama-style
  position ids), kept for the run; each one then keeps ``buffer.clone().detach()`` (the hidden states a leaf
  that requires grad) as the input buffer until SendGrad.
- ForwardPass: ``inputs.clone()`` of the input buffer, the stage's modules in turn (pipeline_stage.py), the
  output kept in the outputs buffer. The last stage computes ForCausalLMLoss on it: ``self.loss`` (kept until the
  next forward replaces it, and its detached storage in ``fwd_outputs`` for the batch), ``total_loss``
  (``zeros_like`` at the first micro-batch) — and its outputs buffer, the logits, is only replaced by the forward
  that reuses the buffer id (_exec_backward_pass returns before clearing it): num_pipe_buffers ≥ 2 logits live.
- SendActivation: the first one's _send_tensor_meta buffer (256 int32 on the device), dropped as it returns.
- RecvGrad (earlier stages): the first one allocates the gradient buffer of the float outputs, kept for the run.
- BackwardPass: the last stage runs ``engine.backward(self.loss)`` (loss / gas, the ZeRO optimizer's
  scale_if_loss); the others ``outputs.backward(gradient=grad_buffer)`` (the buffer is the root's gradient and
  stays referenced, so the first accumulation into it is out of place), then clear the outputs buffer. The backward epilogue's reduction waits for ReduceGrads
  (PipelineEngine.is_gradient_accumulation_boundary is False until ``_force_grad_boundary``).
- SendGrad (later stages): the input buffer (the received hidden states and their .grad) is dropped.
- ReduceGrads: the engine's allreduce_gradients at the boundary (the optimizer's own end of backward); then
  OptimizerStep: the optimizer step.

Several micro-batches are in flight at once on the first stages, each its own autograd graph: each forward gets
its own Autograd (one graph's AccumulateGrad dependencies never count another's edges, as torch's engine computes
dependencies per graph task). Pure: no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..ledger import Ledger
from ..specs import Job
from ..units import dtype_bytes
from . import blocks as B
from . import pipe_schedule as P
from .autograd import Autograd, Tensor
from .causal_lm import causal_lm_loss

if TYPE_CHECKING:
    from .pipeline import Stage

INT64, FP32, INT32 = 8, 4, 4
#: PipelineEngine's TENSOR_META_SIZE: int32 elements of the metadata buffer the first send fills
TENSOR_META_SIZE = 256
INPUTS, SCALARS, PIPE = "inputs", "loop_scalars", "pipe_buffers"


class PipeStage:
    """The engine's pipe buffers and the stage's persistent tensors across train_batch calls."""

    def __init__(self, L: Ledger, job: Job, stage: Stage, engine, forward, on_grad, before_matmul, shape):
        t = job.training
        self.shape = shape
        self.L, self.job, self.stage, self.engine, self.forward_fn = L, job, stage, engine, forward
        self.on_grad, self.before_matmul = on_grad, before_matmul
        self.b = dtype_bytes(t.dtype)
        self.B, self.S, self.ga = t.micro_batch, t.seq_len, t.grad_accum
        self.h = job.model.hidden_size
        self.llama = job.model.family != "gpt2"
        self.scaler = t.zero.stage >= 1  # DeepSpeedZeroOptimizer.scale_if_loss
        n = P.num_pipe_buffers(stage.stages, stage.index, t.grad_accum)
        self.inputs: list = [None] * n
        self.labels: list = [None] * n
        self.outputs: list = [None] * n
        self.graphs: list = [None] * n  # each in-flight micro-batch's Autograd and its leaves
        self.ids: Tensor | None = None  # the data iterator's last ids (its generator frame)
        self.grad_layer: Tensor | None = None
        self.recv_buf: tuple | None = None
        self.loss: Tensor | None = None
        self.loss_graph: tuple | None = None  # the graph self.loss holds (the last forward's)
        self.fwd_outputs: list[Tensor] = []
        self.total_loss: Tensor | None = None
        self.host = Autograd(L)  # plain tensors outside any graph (buffers, inputs, scalars)
        self.sent = False  # first_output_send: the tensor metadata goes with the first send only
        self.cpu_run = False
        self.rotary_key: Tensor | None = None  # StageRotary's cache (pipeline_stage._stage_rotary)
        self.rotary_value: tuple | None = None
        self.rotary_made = False

    # -- instructions ---------------------------------------------------------------------------------
    def load(self, buf: int) -> None:
        h = self.host
        old = self.ids
        self.ids = h.empty("loop.input_ids", INT64 * self.B * self.S, component=INPUTS)
        h.release(old)
        if self.stage.first:
            self._set(self.inputs, buf, h.empty("pipe.inputs.ids_clone", INT64 * self.B * self.S, component=INPUTS))
        if self.stage.last:
            self._set(self.labels, buf, h.ref(self.ids))

    def recv_activation(self, buf: int) -> None:
        h = self.host
        if self.recv_buf is None:  # _recv_tensor_meta → _allocate_or_extend_buffers (emulate_recv_meta)
            hidden = h.empty("pipe.recv_buf.hidden", self.b * self.B * self.S * self.h, component=PIPE)
            pos = (h.empty("pipe.recv_buf.position_ids", INT64 * self.B * self.S, component=PIPE)
                   if self.llama else None)
            self.recv_buf = (hidden, pos)
        hidden = h.empty("pipe.inputs.hidden", self.b * self.B * self.S * self.h, component=PIPE)
        pos = h.empty("pipe.inputs.position_ids", INT64 * self.B * self.S, component=PIPE) if self.llama else None
        self._set(self.inputs, buf, (hidden, pos))

    def forward(self, buf: int) -> None:
        ag = Autograd(self.L, on_param_grad=self.on_grad)
        ag.before_matmul = self.before_matmul
        x = self.inputs[buf]
        if self.stage.first:
            fin = ag.empty("pipe.forward_input", INT64 * self.B * self.S, component=INPUTS)  # inputs.clone()
            ins = (fin,)
        else:
            hidden, pos = x
            hidden.requires_grad = True  # recvd.requires_grad = is_floating_point()
            ag.input_leaf(hidden)  # its AccumulateGrad holds it and keeps its .grad: both live with the graph
            hc = B.clone(ag, hidden, "pipe.forward_input.hidden")
            pc = ag.empty("pipe.forward_input.position_ids", pos.nbytes, component=INPUTS) if pos is not None else None
            ins = (hc, pc)
        out = self.forward_fn(ag, ins, self)
        if self.stage.last:
            # the outputs buffer takes the logits; the previous ones there die, their grad_fn first with the rest
            # of that micro-batch's graph: its AccumulateGrad holds the received hidden states (and their .grad)
            # (unless ``self.loss`` still holds that graph: it is the previous micro-batch's, and dies below)
            old_graph, old_out = self.graphs[buf], self.outputs[buf]
            self.outputs[buf] = out
            if old_graph is not None and old_graph is not self.loss_graph:
                old_graph[0].release_leaves(old_graph[1])
            for t in old_out or ():
                ag.release(t)
            (logits,) = out
            loss = causal_lm_loss(ag, self.job.model, self.shape, logits)
            old, old_lg = self.loss, self.loss_graph
            self.loss = loss
            if old is not None:
                ag.release(old)
            if old_lg is not None and old_lg is old_graph:  # its logits went above: the loss held it last
                old_lg[0].release_leaves(old_lg[1])
            self.fwd_outputs.append(ag.ref(loss))  # self.loss.detach(): the same storage
            if self.total_loss is None:
                self.total_loss = self.host.empty("pipe.total_loss", FP32, component=SCALARS)  # zeros_like
        else:
            self._set(self.outputs, buf, out)
        for t in ins:
            ag.release(t)  # _exec_forward_pass's ``inputs`` local dies as it returns
        self.graphs[buf] = (ag, ag.take_leaves())
        self.loss_graph = self.graphs[buf] if self.stage.last else None

    def send_activation(self, buf: int) -> None:
        """The first send's _send_tensor_meta: ``torch.empty(TENSOR_META_SIZE, int32)`` on the device (256 int32)
        and the metadata list as a host tensor (``torch.tensor(meta_buf_list, int32)``: on the CPU accelerator the
        same memory), both dropped as it returns; p2p.send allocates nothing."""
        if self.sent:
            return
        self.sent = True
        h = self.host
        meta = h.empty("pipe.send_meta", INT32 * TENSOR_META_SIZE, component=PIPE)
        dims = [3, 2] if self.llama else [3]  # hidden [B, S, h] (and the position ids [B, S])
        count = 2 + sum(2 + d for d in dims) if self.llama else 3 + dims[0]
        listed = h.empty("pipe.send_meta.list", INT32 * count, component=PIPE) if self.cpu_run else None
        h.release(listed)
        h.release(meta)

    def recv_grad(self, buf: int) -> None:
        if self.grad_layer is None:  # _allocate_or_extend_buffers over the float outputs
            self.grad_layer = self.host.empty("pipe.grad_layer", self.b * self.B * self.S * self.h, component=PIPE)

    def backward(self, buf: int) -> None:
        ag = self.graphs[buf][0]
        if self.stage.last:  # DeepSpeedEngine.backward(self.loss)
            made = [ag.op("engine.loss_over_gas", FP32, (self.loss,), component=SCALARS)]
            if self.scaler:
                made.append(ag.op("engine.scaled_loss", FP32, (made[-1],), component=SCALARS))
            ag.backward(made[-1], FP32)
            self.engine.end_backward(ag, False)
            for t in reversed(made):
                ag.release(t)
        else:
            (hidden, *_rest) = self.outputs[buf]
            ag.backward_from(hidden, ag.ref(self.grad_layer))  # the buffer keeps its reference
            self.engine.end_backward(ag, False)
            self._set(self.outputs, buf, None)

    def send_grad(self, buf: int) -> None:
        """The input buffer is dropped; the received hidden states live on in the graph the logits hold."""
        self._set(self.inputs, buf, None)

    def end_batch(self) -> None:
        """train_batch's end: _aggregate_total_loss, then fwd_outputs reset at the next _exec_schedule."""
        for t in self.fwd_outputs:
            self.host.release(t)
        self.fwd_outputs = []
        if self.total_loss is not None:
            self.host.release(self.total_loss)
            self.total_loss = None

    def _set(self, slots: list, buf: int, value) -> None:
        old = slots[buf]
        slots[buf] = value
        for t in (old if isinstance(old, tuple) else (old,)):
            self.host.release(t)
