"""A model of PyTorch's eager autograd memory: tensors, views, saved tensors, and the backward engine.

Forward code written against this module (estimator/blocks.py) allocates each op's output in the ledger,
records what autograd saves, and drops Python references where the transformers code drops them; a tensor's
storage is freed when nothing refers to it (a variable, a view, a saved tensor, a gradient buffer), as torch's
refcounting frees it. ``backward`` then runs the recorded nodes the way torch/csrc/autograd/engine.cpp does
(estimator/autograd_engine.py).

Sizes are bytes; shapes are not kept. Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Callable

from ..ledger import Ledger
from .autograd_engine import BackwardEngine, _Ctx
from .timing import BACKWARD_RATIO, CPU_OP_S, GEMM, MEMORY


class Storage:
    """One allocation: freed when its reference count reaches zero."""

    __slots__ = ("nbytes", "refs", "tid")

    def __init__(self, tid: int, nbytes: int):
        self.tid, self.nbytes, self.refs = tid, nbytes, 0


class Tensor:
    """A tensor (or a view of one): its storage, its own byte size, its grad_fn and whether it needs grad."""

    __slots__ = ("is_view", "name", "nbytes", "node", "param", "requires_grad", "slot", "storage", "summed_bytes")

    def __init__(self, storage: Storage | None, nbytes: int, name: str, requires_grad: bool, node=None,
                 param: str | None = None, is_view: bool = False, slot: int = 0):
        self.storage, self.nbytes, self.name = storage, nbytes, name
        self.requires_grad, self.node, self.param = requires_grad, node, param
        self.is_view = is_view
        self.slot = slot  # which output of a multi-output node (chunk) this tensor is
        #: a gradient both broadcast and wider than its input: validate_outputs sums it to this many bytes
        #: (its own dtype) before casting it to the input's (0: one step)
        self.summed_bytes = 0


class Node:
    """A grad_fn: which inputs get gradients, what it saved, and its backward formula.

    ``backward(ctx, grad, node)`` receives the incoming gradient (for a node of ``n_out`` > 1 outputs, such as
    SplitBackward0, a list with one entry per output, None where none arrived) and returns one gradient per
    entry of ``inputs`` (None for inputs that need none); it allocates through ctx."""

    __slots__ = ("backward", "cost", "inputs", "n_out", "name", "reduce_staging", "region", "saved", "seq",
                 "unpacked", "would_save")

    def __init__(self, name: str, inputs: tuple, saved: tuple, backward: Callable, seq: int, n_out: int = 1):
        self.name, self.inputs, self.saved, self.backward, self.seq = name, inputs, saved, backward, seq
        self.n_out = n_out
        self.region = None  # a checkpointed region whose saved tensors are recomputed before this node runs
        self.would_save = bool(saved)  # saved something, or would have outside a checkpointed forward
        self.unpacked = False  # its saved tensors came from a checkpoint's recompute: apply's locals own them
        self.reduce_staging = None  # input index → CUDA reduction staging bytes (blocks_linear.py, cuda_reduce.py)
        self.cost: tuple[float, int, int] | None = None  # its backward's (operations, bytes, kernel): timing.py


class Autograd(BackwardEngine):
    """Forward bookkeeping and the backward engine (BackwardEngine) over one ledger (see the module docstring)."""

    def __init__(self, ledger: Ledger, component: str = "activations",
                 on_param_grad: Callable[[Tensor, Tensor], None] | None = None):
        self.ledger = ledger
        self.component = component
        #: bytes per element of the training dtype and the kernel kind its matrix products run as (timing.GEMM, or
        #: GEMM_FP32 in fp32): what an op's operations are counted and timed with (program.build_ledger sets both)
        self.elem_bytes = 2
        self.gemm_kernel = GEMM
        self.nodes: list[Node] = []
        self.grad_enabled = True
        self.on_param_grad = on_param_grad or (lambda param, grad: self.release(grad))
        self.before_matmul: Callable[[], None] | None = None  # called once, after the first matmul's output
        #: called once, by the first matmul a backward runs, after its output is allocated: the autograd
        #: engine's device thread gets its own cuBLAS handle (CublasHandlePool.cpp getCurrentCUDABlasHandle is
        #: per thread), whose workspace the handle's first gemm allocates
        self.backward_matmul: Callable[[], None] | None = None
        self.saving = True  # False inside a non-reentrant checkpointed forward: saved tensors are not kept
        self.region = None  # the checkpointed region whose nodes are being recorded
        self.suppress = False  # a recompute stopped early: what follows allocates nothing
        self.stop_at: int | None = None  # index in self.nodes of the recompute's last node that saves
        self.recomputing = False  # a checkpoint's recompute is running (its nodes are dropped afterwards)
        #: parameters a live node saved through a view (blocks_moe.grouped_mm: ``weight.transpose(-2, -1)``):
        #: the view keeps the gathered storage when ZeRO-3 swaps param.data for its partition
        self.saved_param_views: set[str] = set()
        #: parameters a checkpoint's recompute saved that require grad: its pack hook keeps ``x.detach()`` of
        #: those (torch/utils/checkpoint.py _recomputation_hook: ``x.detach() if x.requires_grad else x``), a new
        #: tensor on the gathered storage; a frozen parameter is kept as itself, and ZeRO-3's param.data swap
        #: frees its storage (Region.recompute clears the set)
        self.recompute_detached: set[str] = set()
        #: called with a parameter's name when a node releases it from its saved tensors (ZeRO-3: the gathered
        #: storage a checkpoint's recompute kept for it goes then, inside the node's call_function, before
        #: validate_outputs sums a bias's grad and before the parameter's AccumulateGrad runs)
        self.on_saved_param_release: Callable[[str], None] | None = None
        self._buffers: dict[int, Tensor] = {}  # id(tensor) → accumulated gradient waiting for its node
        self._param_buffers: dict[int, Tensor] = {}  # id(parameter) → gradient waiting for its AccumulateGrad
        self._param_uses: dict[int, int] = {}  # id(parameter) → edges into its AccumulateGrad not yet run
        self._leaves: list[list] = []  # [leaf, its .grad] of input leaves (input_leaf) of the current graph
        self._held: list[list] = []  # the same of graphs already handed out (take_leaves), until released

    # -- storage ----------------------------------------------------------------------------------------
    def empty(self, name: str, nbytes: int, requires_grad: bool = False, component: str | None = None,
              stream: int = 0) -> Tensor:
        """A new tensor with its own storage (one allocation), referenced once by the caller."""
        if self.suppress:
            return Tensor(None, nbytes, name, requires_grad)
        st = Storage(self.ledger.alloc(name, nbytes, component or self.component, stream), nbytes)
        st.refs = 1
        return Tensor(st, nbytes, name, requires_grad)

    def param(self, name: str, nbytes: int, requires_grad: bool = True) -> Tensor:
        """A parameter: its storage is owned elsewhere (model states), never freed here."""
        return Tensor(None, nbytes, name, requires_grad, param=name)

    def ref(self, t: Tensor) -> Tensor:
        """Take one more reference to ``t``'s storage (a variable, a saved slot, a buffer)."""
        if t.storage is not None:
            t.storage.refs += 1
        return t

    def release(self, t: Tensor | None) -> None:
        """Drop one reference; the storage is freed when none is left."""
        if t is None or t.storage is None:
            return
        st = t.storage
        st.refs -= 1
        if st.refs == 0:
            self.ledger.free(st.tid)
        elif st.refs < 0:
            raise AssertionError(f"released {t.name} more often than referenced")

    def input_leaf(self, t: Tensor) -> None:
        """``t.requires_grad_(True)`` on a tensor no gradient flows into (transformers' enable_input_require_grads
        on the input embeddings' output): a leaf whose AccumulateGrad holds it (the graph owns a reference) and
        keeps the gradient that reaches it as ``.grad``; both die with the graph (take_leaves)."""
        t.requires_grad = True
        self.ref(t)
        self._leaves.append([t, None])

    def take_leaves(self) -> list[list]:
        """The current graph's input leaves, handed to whoever holds the graph (the loop's output object)."""
        out, self._leaves = self._leaves, []
        self._held.extend(out)
        return out

    def release_leaves(self, leaves: list[list]) -> None:
        """The graph dies: each leaf's .grad (its AutogradMeta goes first in TensorImpl::release_resources),
        then the leaf."""
        for entry in leaves:
            self.release(entry[1])
            self.release(entry[0])
            self._held = [e for e in self._held if e is not entry]
        leaves.clear()

    def view(self, t: Tensor, name: str | None = None, nbytes: int | None = None, node_from: Tensor | None = None
             ) -> Tensor:
        """A view of ``t`` (transpose, reshape of a contiguous tensor, slice, unsqueeze, expand): no allocation;
        its grad_fn passes the gradient through to ``t`` (views are grad-transparent for memory)."""
        v = Tensor(t.storage, t.nbytes if nbytes is None else nbytes, name or t.name, t.requires_grad, is_view=True)
        self.ref(v)
        if t.requires_grad and self.grad_enabled:
            v.node = self._node("ViewBackward", (t,), (), _passthrough)
        return v

    def marker(self, t: Tensor, fn: Callable[[], None]) -> Tensor:
        """An alias of ``t`` whose backward runs ``fn`` when the gradient reaches it and passes the gradient on
        (the autograd functions DeepSpeed wraps module inputs and outputs in for its backward hooks)."""
        return self.grad_hook(t, lambda grad: fn())

    def grad_hook(self, t: Tensor, on_grad: Callable[[Tensor], None]) -> Tensor:
        """An alias of ``t`` whose backward calls ``on_grad(grad)`` with the gradient that reached it (which may
        take a reference to it) and passes the gradient on: a custom autograd function returning its input."""
        v = Tensor(t.storage, t.nbytes, t.name, t.requires_grad, is_view=True)
        self.ref(v)
        if t.requires_grad and self.grad_enabled:
            def backward(ctx, grad, node):
                on_grad(grad)
                return grad
            v.node = self._node("HookBackward", (t,), (), backward)
        return v

    # -- graph ------------------------------------------------------------------------------------------
    def _node(self, name: str, inputs: tuple, saved: tuple, backward: Callable, n_out: int = 1) -> Node:
        would_save = bool(saved)
        if not self.saving:  # torch.utils.checkpoint's saved-tensor hooks keep a handle, not the tensor
            saved = ()
        for s in saved:
            self.ref(s)
            if self.recomputing and s.param is not None and s.requires_grad:
                self.recompute_detached.add(s.param)
        if not self.recomputing:  # a recompute's graph is dropped: its edges feed no AccumulateGrad
            for t in inputs:  # edges into each parameter's AccumulateGrad
                if t is not None and t.requires_grad and t.param is not None and t.node is None:
                    self._param_uses[id(t)] = self._param_uses.get(id(t), 0) + 1
        node = Node(name, inputs, saved, backward, len(self.nodes), n_out)
        node.would_save = would_save
        node.region = self.region
        self.nodes.append(node)
        return node

    def split(self, t: Tensor, parts: tuple[int, ...], name: str, backward: Callable) -> list[Tensor]:
        """Views of ``t`` (bytes ``parts``) that are the outputs of one node (chunk / split: SplitBackward0):
        their grads wait in one InputBuffer slot each and reach ``backward`` together, as a list."""
        node = (self._node(name, (t,), (), backward, len(parts)) if t.requires_grad and self.grad_enabled
                else None)
        outs = []
        for i, nbytes in enumerate(parts):
            v = Tensor(t.storage, nbytes, f"{name}.{i}", t.requires_grad, node, is_view=True, slot=i)
            outs.append(self.ref(v))
        return outs

    def op(self, name: str, out_bytes: int, inputs: tuple, saved: tuple = (), backward: Callable | None = None,
           component: str | None = None, flops: float = 0.0, kernel: int | None = None,
           backward_ratio: float = BACKWARD_RATIO, saves_after: bool = False) -> Tensor:
        """An op with a fresh output of ``out_bytes``: records its node when grad mode is on and an input
        requires grad. ``saved`` are the tensors autograd keeps for backward (the output may be among them:
        pass the string "out"). Its time (timing.py): ``flops`` operations of ``kernel`` (default: the training
        dtype's matrix product when there are operations, else a memory-bound kernel over the inputs and the
        output); its backward ``backward_ratio`` times that. ``saves_after``: a custom autograd.Function, whose
        setup_context saves after its forward ran: a checkpoint's recompute that stops at it (its pack hook
        raises torch.utils.checkpoint's _StopRecomputationError) has made the output, which dies as the stop
        unwinds Function.apply (aten ops pack their inputs before the kernel: nothing is made)."""
        needs = self.grad_enabled and any(t.requires_grad for t in inputs)
        last = needs and self.stop_at is not None and len(self.nodes) == self.stop_at
        if last and "out" not in saved and not saves_after:  # the recompute stops once this op packs its inputs
            self.suppress = True
        out = self.empty(name, out_bytes, needs, component)
        if last and saves_after and out.storage is not None:  # made, then dropped by the stop (see above)
            self.ledger.free(out.storage.tid)
            out.storage = None
        if not self.suppress:
            nbytes = out_bytes + sum(t.nbytes for t in inputs)
            kind = kernel if kernel is not None else self.gemm_kernel if flops else MEMORY
            self.ledger.work(CPU_OP_S, flops, nbytes, kind)
        if needs:
            saved_t = tuple(out if s == "out" else s for s in saved)
            out.node = self._node(name, inputs, saved_t, backward or _elementwise_grads)
            if not self.suppress:
                out.node.cost = (flops * backward_ratio, int(nbytes * backward_ratio), kind)
        if last:
            self.suppress = True
        return out

    def first_matmul(self) -> None:
        """A cuBLAS call has just had its output allocated: the thread's first one creates its handle, whose
        workspace comes from the caching allocator then (CublasHandlePool.cpp getCurrentCUDABlasHandle, called by
        the gemm after the structured kernel allocated its result): before_matmul, once."""
        if self.before_matmul is not None and not self.suppress:
            hook, self.before_matmul = self.before_matmul, None
            hook()

    def recompute_stops_at_next_op(self) -> bool:
        """Whether a checkpoint's recompute ends at the next op that records a node (it packs that op's inputs
        and stops before the kernel runs: a temporary the kernel would make first is not made)."""
        return self.stop_at is not None and len(self.nodes) == self.stop_at

    def keep(self, out: Tensor, extra: Tensor) -> None:
        """Save ``extra`` for ``out``'s node too (a kernel output allocated after the op's result, such as
        flash attention's logsumexp)."""
        if out.node is not None:
            out.node.would_save = True
            if self.saving:
                out.node.saved = (*out.node.saved, self.ref(extra))


def _passthrough(ctx: _Ctx, grad: Tensor, node: Node):
    """View / add backward: the incoming gradient itself goes to every input (no allocation)."""
    return grad


def _elementwise_grads(ctx: _Ctx, grad: Tensor, node: Node) -> tuple:
    """Default formula: one fresh gradient per input that needs one, of that input's size, in input order."""
    return tuple(ctx.new(f"grad.{node.name}", t.nbytes) if t.requires_grad else None for t in node.inputs)
