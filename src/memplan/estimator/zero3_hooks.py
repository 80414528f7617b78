"""ZeRO-3's module hooks (DeepSpeed 0.19.8 runtime/zero/parameter_offload.py DeepSpeedZeRoOffload's forward and
backward hooks, partitioned_param_coordinator.py fetch_sub_module / release_sub_module) over the partitioned
parameters of estimator/zero3_params.py: which module holds which gathered parameter (ds_active_sub_modules, the
external parameters, the frozen ones a checkpoint's recompute attributes to the active backward module), and the
fetch and release around each module's forward and backward. The host's time of each hook is a work record
(estimator/timing.py).
"""

from __future__ import annotations

from .autograd import Autograd, Tensor
from .timing import CPU_Z3_POST_BACKWARD_S, CPU_Z3_POST_FORWARD_S, CPU_Z3_PRE_BACKWARD_S, CPU_Z3_PRE_FORWARD_S
from .transformer import ModuleHooks


class Zero3Hooks(ModuleHooks):
    """The hooks half of Zero3Params (mixed into it: fetch, release, gather_now and the coordinator's state are
    Zero3Params')."""

    # A non-reentrant checkpoint's recompute (torch/utils/checkpoint.py _recomputation_hook) runs the modules'
    # hooks again: each gathers its parameters, and the pack hook keeps ``x.detach()`` of every saved tensor
    # that requires grad — a trained weight too (LinearFunctionForZeroStage3 saves input, weight and bias;
    # addmm the weight only; the norms' multiply the weight) — so the release after the module frees nothing
    # of those: the storage lives until the node has run in backward and released what it saved; its backward
    # fetch gathers the parameter again. A frozen parameter (LoRA's base) is kept as itself, not detached, and
    # an unsaved one (Conv1D's bias) not at all: their release frees the gathered storage as usual.
    # The recompute starts when backward first unpacks a saved tensor of the region (unpack_hook), so after the
    # PreBackwardFunctionForModule of the region's last module has fetched its weight: the recompute's fetch
    # of that module finds it available. It stops (_StopRecomputationError) once the last saved tensor is
    # packed: that module's post-forward hook and everything after it never run.
    def _module_params(self, module: str, own: tuple[str, ...]) -> tuple[str, ...]:
        """iter_params(module): its own parameters, then its external ones."""
        return tuple(dict.fromkeys(own + self.external.get(module, ())))

    def _hold(self, module: str, names: tuple[str, ...]) -> None:
        for p in names:
            self.holders.setdefault(p, set()).add(module)

    def _unhold(self, module: str, names) -> None:
        for p in names:
            self.holders.get(p, set()).discard(module)

    def _drop_holds(self) -> None:
        """Every active backward module, recompute attribution and ds_active_sub_modules entry gone."""
        self.active_backward.clear()
        self.recompute_owned.clear()
        self.holders.clear()

    def param_access(self, ag: Autograd, module: str, name: str) -> None:
        """A forward reads parameter ``name`` outside its own module (peft's ``lora_A.weight.dtype``) while
        ``module`` is the innermost one running: in engine.forward a parameter not available is registered as
        ``module``'s external parameter and gathered at once (ZeROOrderedDict.__getitem__: param.all_gather();
        a recompute runs outside engine.forward, where reads gather nothing)."""
        if getattr(ag, "stop_at", None) is not None or getattr(ag, "suppress", False):
            return
        if name in self.avail or name in self.inflight:
            return
        self.external[module] = (*self.external.get(module, ()), name)
        self.gather_now([name])

    def pre_forward(self, ag: Autograd, module: str, params: tuple[Tensor, ...], inputs: tuple[Tensor, ...]):
        if getattr(ag, "suppress", False):
            return inputs
        self.L.work(CPU_Z3_PRE_FORWARD_S)
        names = self._module_params(module, tuple(t.param for t in params))
        self.fetch(names)
        self._hold(module, names)
        if getattr(ag, "stop_at", None) is not None and self.active_backward:
            # _fetch_sub_module_impl in a checkpoint's recompute (a forward inside backward's graph task): each
            # frozen parameter is attributed to the last active backward module (update_recompute_parameters),
            # whose id in its ds_active_sub_modules keeps it gathered past this module's release until that
            # module's backward release; trained ones release as usual (their storage kept by the saved detach)
            owner = next(reversed(self.active_backward))
            frozen = tuple(t.param for t in params if not t.requires_grad)
            self.recompute_owned.setdefault(owner, set()).update(frozen)
            self._hold(owner, frozen)
        # PostBackwardFunctionModule on each input that requires grad: once all their grads are computed
        # (module.ds_grads_remaining back to 0), release the module's parameters
        remaining = [sum(1 for x in inputs if x.requires_grad)]

        def after_backward():
            remaining[0] -= 1
            if remaining[0] == 0:
                self.backward_release(ag, module, tuple(t.param for t in params))
        return tuple(ag.marker(x, after_backward) if x.requires_grad else x for x in inputs)

    def backward_fetch(self, module: str, own: tuple[str, ...]) -> None:
        """pre_sub_module_backward_function: the module becomes an active backward submodule, then its fetch."""
        self.L.work(CPU_Z3_PRE_BACKWARD_S)
        self.active_backward.setdefault(module, None)
        names = self._module_params(module, own)
        self.fetch(names)
        self._hold(module, names)

    def backward_release(self, ag: Autograd, module: str, own: tuple[str, ...]) -> None:
        """release_sub_module(forward=False): the module leaves the active backward submodules; its parameters
        go by __params_to_release's rules, the frozen ones a recompute attributed to it (ds_recompute_parameters)
        whenever not persistent, each once no other module holds it (a view a live node saved keeps the storage:
        Autograd.saved_param_views)."""
        self.L.work(CPU_Z3_POST_BACKWARD_S)
        self.active_backward.pop(module, None)
        names = self._module_params(module, own)
        owned = self.recompute_owned.pop(module, set())
        self._unhold(module, (*names, *owned))
        self.release(names, saved=ag.saved_param_views)
        for p in sorted(owned, key=self.rank_of.__getitem__):
            if not self.persistent(p):
                self._release(p, p in ag.saved_param_views)

    def post_forward(self, ag: Autograd, module: str, params: tuple[Tensor, ...], output: Tensor) -> Tensor:
        if getattr(ag, "suppress", False):
            return output
        self.L.work(CPU_Z3_POST_FORWARD_S)
        names = self._module_params(module, tuple(t.param for t in params))
        self._unhold(module, names)
        kept = ag.recompute_detached if getattr(ag, "stop_at", None) is not None else frozenset()
        self.release(names, retain=kept, saved=ag.saved_param_views)
        # PreBackwardFunctionForModule on the output: before the module's backward, fetch it
        own = tuple(t.param for t in params)
        return (ag.marker(output, lambda: self.backward_fetch(module, own)) if output.requires_grad else output)

    def end_forward(self, ag: Autograd, out):
        """The root module's post-forward hook: its outputs (the loss, the logits) wrapped in
        PreBackwardFunctionForModule, so the backward starts with the root module's (parameter-less) fetch —
        a step of the trace like any other."""
        if getattr(ag, "suppress", False):
            return out
        for level in range(1 + self.wrapper_modules):  # the *ForCausalLM's, then each peft wrapper's (outermost last)
            wrapped = []
            for t in (out.loss, out.logits):
                w = (ag.marker(t, lambda level=level: self.backward_fetch(f"(root {level})", ())) if t.requires_grad
                     else t)
                if w is not t:
                    ag.release(t)
                wrapped.append(w)
            out = type(out)(*wrapped)
        return out
