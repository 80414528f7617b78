"""The backward engine of the autograd model (estimator/autograd.py): ``BackwardEngine``, the half of
``Autograd`` that runs the recorded nodes the way torch/csrc/autograd/engine.cpp does, and ``_Ctx``, what a
node's backward formula allocates through:

- nodes run in reverse creation order (the ready queue pops the highest sequence number; a node created
  later is never a dependency of an earlier one), AccumulateGrad right after the node that produced the grad
  (AccumulateGrad nodes carry the maximum sequence number), which hands the grad to ``on_param_grad``;
- a node's apply allocates what its formula allocates (``Node.backward``, in its order), then its incoming
  gradients are released (they die with apply's argument list) and then its saved variables
  (``Node::release_variables`` in ``call_function`` when the graph is not kept);
- gradients reaching one tensor from several consumers accumulate in its InputBuffer
  (torch/csrc/autograd/input_buffer.cpp ``InputBuffer::add``/``accumulate``): in place when the buffered
  gradient is referenced only by the buffer, else out of place (a new tensor).

Sizes are bytes. Pure: no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .timing import CPU_NODE_S

if TYPE_CHECKING:
    from .autograd import Autograd, Node, Tensor


class BackwardEngine:
    """loss.backward() over the nodes an Autograd recorded (mixed into Autograd, whose state it uses; see the
    module docstring)."""

    def backward(self, root: Tensor, grad_bytes: int) -> None:
        """loss.backward(): the gradient of ``root`` (ones_like) and every recorded node in engine order."""
        if root.node is None:
            return
        seed = self.empty("grad.root", grad_bytes, component="activations")
        self._push(root, seed)
        self.run_nodes(len(self.nodes) - 1, -1)

    def backward_from(self, root: Tensor, grad: Tensor) -> None:
        """``root.backward(gradient=grad)``: ``grad`` (a reference the caller hands over) is the root's gradient."""
        if root.node is None:
            self.release(grad)
            return
        self._push(root, grad)
        self.run_nodes(len(self.nodes) - 1, -1)

    def run_nodes(self, start: int, stop: int) -> None:
        """Run the nodes from index ``start`` down to ``stop`` (exclusive) that have a gradient waiting."""
        for i in range(start, stop, -1):
            node = self.nodes[i]
            grad = self._buffers.pop(id(node), None)
            if grad is None:  # nothing flowed here: the engine never schedules it
                self._release_saved(node)
                for inp in node.inputs:
                    if inp is not None and inp.requires_grad and inp.param is not None and inp.node is None:
                        self._param_grad(inp, None)
                continue
            if node.region is not None and not node.region.done and node.would_save:  # the first unpack recomputes
                node.region.recompute()
            ctx = _Ctx(self)
            outs = node.backward(ctx, grad, node)
            cost = node.cost  # its kernels, queued once its grads are allocated (timing.py)
            if cost is None:
                self.ledger.work(CPU_NODE_S)
            else:
                self.ledger.work(CPU_NODE_S, cost[0], cost[1], cost[2])
            if isinstance(outs, tuple):  # a kernel's grad for an input that needs none (sdpa computes q, k
                # and v's together) dies with its result tuple inside apply, before the unpacked saved variables
                outs = self._drop_unneeded(node, outs, grad)
            held = bool(node.saved)
            if node.unpacked:  # apply's unpacked locals die (last unpacked first) before its argument list
                for t in node.saved[::-1]:
                    self.release(t)
                    self._saved_param_released(t)
                node.saved = ()
            if outs is not grad:
                outs = self._validate_outputs(node, outs, grad)
            if node.n_out > 1:  # each output's grad dies with apply's argument list
                for g in grad:
                    if g is not None and not any(o is g for o in outs):
                        self.release(g)
            elif outs is grad:  # passthrough of the incoming gradient object (validate_outputs casts it for an
                # input of a narrower dtype: the bf16 operand of a bf16 + fp32 add)
                outs = tuple(self.empty(f"{grad.name}.reduced", inp.nbytes, component="activations")
                             if inp is not None and inp.requires_grad and grad.nbytes > inp.nbytes
                             else self.ref(grad) for inp in node.inputs)
                self.release(grad)
            elif not any(o is grad for o in outs):
                self.release(grad)  # apply's argument list dies with the call
            self._release_saved(node)  # release_variables: the checkpoint's holders go here
            if node.unpacked and held:
                node.region.released()
            for inp, g in zip(node.inputs, outs):
                if g is None:
                    if inp is not None and inp.requires_grad and inp.param is not None and inp.node is None:
                        self._param_grad(inp, None)
                    continue
                if not inp.requires_grad:
                    self.release(g)
                elif inp.param is not None and inp.node is None:
                    self._param_grad(inp, g)
                else:
                    self._push(inp, g)
        self.nodes[stop + 1:start + 1] = []

    def _drop_unneeded(self, node: Node, outs: tuple, grad) -> tuple:
        """``outs`` with the fresh grads of inputs that do not require grad released (None in their place)."""
        kept = []
        for inp, g in zip(node.inputs, outs):
            if g is not None and g is not grad and inp is not None and not inp.requires_grad:
                self.release(g)
                g = None
            kept.append(g)
        return tuple(kept) + tuple(outs[len(node.inputs):])

    def _validate_outputs(self, node: Node, outs: tuple, grad) -> tuple:
        """engine.cpp validate_outputs, after apply, in input order: a grad larger than its input is brought to
        the input's metadata: summed down when the input was broadcast (InputMetadata::reduce_grad →
        at::sum_to), cast when it has a wider dtype (grad.to(metadata dtype)). Either is one more tensor of
        the input's size, and the larger grad is freed (unless it is the incoming gradient itself, which
        apply's argument list holds until the call returns)."""
        fixed = []
        staging = getattr(node, "reduce_staging", None) or {}
        for k, (inp, g) in enumerate(zip(node.inputs, outs)):
            if g is not None and inp is not None and g.nbytes > inp.nbytes:
                summed = None
                if g.summed_bytes and g.summed_bytes != inp.nbytes:  # reduce_grad, then grad.to(dtype)
                    summed = self.empty(f"{g.name}.summed", g.summed_bytes, component="activations")
                    self._reduce_staging(g, staging.get(k))
                    if g is not grad:
                        self.release(g)
                    g = summed
                r = self.empty(f"{g.name}.reduced", inp.nbytes, component="activations")
                if summed is None:
                    self._reduce_staging(g, staging.get(k))
                if g is not grad:
                    self.release(g)
                g = r
            fixed.append(g)
        return tuple(fixed)

    def _reduce_staging(self, g: Tensor, staging: tuple[int, int] | None) -> None:
        """CUDA's global reduction staging (estimator/cuda_reduce.py) of summing ``g``, after the sum's result:
        gpu_reduce_kernel's buffer and semaphores, freed (semaphores first) as it returns."""
        buf, sem = staging or (0, 0)
        if buf:
            b_t = self.empty(f"{g.name}.reduce_staging.tmp", buf, component="activations")
            s_t = self.empty(f"{g.name}.reduce_semaphores.tmp", sem, component="activations")
            self.release(s_t)
            self.release(b_t)

    def _saved_param_released(self, t: Tensor) -> None:
        if t.param is not None and self.on_saved_param_release is not None:
            self.on_saved_param_release(t.param)

    def _release_saved(self, node: Node) -> None:
        had = bool(node.saved)
        for s in node.saved:
            self.release(s)
            self._saved_param_released(s)
        node.saved = ()
        if had and node.region is not None and node.region.done:
            node.region.released()

    def _push(self, t: Tensor, grad: Tensor) -> None:
        """Add ``grad`` to the input buffer of ``t``'s grad_fn (InputBuffer::add); an input leaf's AccumulateGrad
        steals it as .grad."""
        if t.node is None:
            for entry in self._leaves + self._held:
                if entry[0] is t and entry[1] is None:
                    entry[1] = grad
                    return
            self.release(grad)
            return
        key = id(t.node)
        if t.node.n_out > 1:  # one slot per output
            slots = self._buffers.setdefault(key, [None] * t.node.n_out)
            old = slots[t.slot]
            slots[t.slot] = grad if old is None else self._accumulate(old, grad)
            return
        old = self._buffers.get(key)
        if old is None:
            self._buffers[key] = grad
        else:
            self._buffers[key] = self._accumulate(old, grad)

    def _accumulate(self, old: Tensor, grad: Tensor) -> Tensor:
        """InputBuffer::accumulate for dense tensors: ``old.add_(grad)`` when the buffered gradient is a
        plain tensor only the buffer references (can_accumulate_inplace), else ``old + grad`` (a new tensor);
        the incoming gradient is never the one reused."""
        if not old.is_view and old.storage is not None and old.storage.refs == 1:
            self.release(grad)
            return old
        total = self.empty("grad.accumulate", max(old.nbytes, grad.nbytes))
        self.release(old)
        self.release(grad)
        return total

    def _param_grad(self, param: Tensor, grad: Tensor | None) -> None:
        """A gradient for a leaf parameter (None: an edge that delivers nothing). Its AccumulateGrad node runs
        once every edge into it has delivered (the engine's dependency count): a parameter used by several
        nodes (tied embeddings) first sums its gradients in the node's InputBuffer."""
        key = id(param)
        if grad is not None:
            old = self._param_buffers.get(key)
            self._param_buffers[key] = grad if old is None else self._accumulate(old, grad)
        left = self._param_uses.get(key, 1) - 1
        self._param_uses[key] = left
        if left <= 0:
            self._param_uses.pop(key, None)
            total = self._param_buffers.pop(key, None)
            if total is not None:
                self.on_param_grad(param, total)  # AccumulateGrad runs next (maximum sequence number)

    def free_graph(self) -> None:
        """Drop every node's saved tensors without running backward (a graph that goes out of scope)."""
        for node in reversed(self.nodes):
            self._release_saved(node)
        self.nodes.clear()
        for g in (*self._buffers.values(), *self._param_buffers.values()):
            for one in (g if isinstance(g, list) else (g,)):
                self.release(one)
        self._buffers.clear()
        self._param_buffers.clear()
        self._param_uses.clear()


class _Ctx:
    """What a backward formula uses to allocate its temporaries and results."""

    __slots__ = ("ag",)

    def __init__(self, ag: Autograd):
        self.ag = ag

    def new(self, name: str, nbytes: int, view: bool = False) -> Tensor:
        """A fresh tensor; ``view``: what the input receives is a view of it (a gradient that passes a
        reshape's backward on its way), which InputBuffer never accumulates into in place."""
        t = self.ag.empty(name, nbytes, component="activations")
        t.is_view = view
        return t

    def free(self, t: Tensor) -> None:
        self.ag.release(t)
