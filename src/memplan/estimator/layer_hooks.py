"""Full backward hooks on the decoder layers: ``module.register_full_backward_hook`` (and its pre-hook) as torch
2.x runs them (torch/utils/hooks.py ``BackwardHook``, installed by ``Module._call_impl``).

``setup_input_hook`` and ``setup_output_hook`` pass the layer's tensor arguments and its output through
``BackwardHookFunction`` (torch/nn/modules/_functions.py: returns its inputs, aliases, no memory). In backward
the output's ``BackwardHookFunctionBackward`` pre-hook stores the gradient that reached the layer
(``self.grad_outputs = ...``) so that the user hook can be called with it once the layer's input gradient is
known; the input's node then calls the user hooks and drops it (``self.grad_outputs = None``). So the layer's
output gradient stays referenced through the whole layer backward: the residual add hands that same tensor to
the residual branch, and InputBuffer::accumulate, finding it referenced twice, adds the branch's gradient out of
place (a new tensor) where without the hook it would add in place.

memplan verify registers such hooks (only to mark the timeline) on every decoder layer during the first
micro-step of the DeepSpeed loop when the job has no checkpointing, ZeRO below 3, no adapters and nothing frozen
(verify/worker.py ``train``, verify/phases.py ``TimelineHooks``); user code (profilers, gradient inspection)
does the same. Pure: no torch.
"""

from __future__ import annotations

from .autograd import Autograd, Tensor


class LayerBackwardHooks:
    """The state of one forward's BackwardHook objects: each hooked layer's held output gradient."""

    def __init__(self):
        self._held: dict[int, Tensor] = {}

    def wrap(self, ag: Autograd, i: int, run):
        """``run`` (decoder layer i's call on its hidden-state argument) between its BackwardHookFunctions."""
        def hooked(x: Tensor) -> Tensor:
            xi = ag.grad_hook(x, lambda grad: ag.release(self._held.pop(i, None))) if x.requires_grad else x
            out = run(xi)
            if xi is not x:
                ag.release(xi)
            first = out[0] if isinstance(out, tuple) else out  # (hidden, attn_weights): only the first gets a grad
            if not first.requires_grad:
                return out
            others = tuple(t for t in out[1:] if t is not None and t.requires_grad) if isinstance(out, tuple) else ()
            o = ag.grad_hook(first, lambda grad: self._hold(ag, i, grad, others))
            ag.release(first)
            return (o, *out[1:]) if isinstance(out, tuple) else o
        return hooked

    def _hold(self, ag: Autograd, i: int, grad: Tensor, others: tuple[Tensor, ...]) -> None:
        """The output node's pre-hook: ``self.grad_outputs`` takes a reference to the incoming gradient. Then its
        apply: one BackwardHookFunction wraps every output tensor, and a custom function materializes the
        gradients that never arrived (``ctx.materialize_grads``, on by default) as zeros: for BLOOM's attention
        probabilities a [B, heads, S, S] tensor that the CPU trace shows freed within the node's evaluation."""
        self._held[i] = ag.ref(grad)
        for t in others:
            ag.release(ag.empty(f"{t.name}.grad_zeros", t.nbytes, component="activations"))
