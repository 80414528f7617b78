"""peft 0.21's lora.ParamWrapper (peft/tuners/lora/layer.py) in the autograd model: LoRA on a parameter rather
than a linear, which is how peft adapts a mixture-of-experts block on transformers 5 (the fused 3-D experts and
the router's weight: peftconfig.wrapped_parameters).

``ParamWrapper.forward`` runs its base layer inside ``_activate_lora``: it registers a parametrization on the
parameter (torch.nn.utils.parametrize: ParametrizationList.__init__ evaluates it once to check its dtype and
shape, a tensor of the parameter's size that dies at once) and enters
``parametrize.cached()``, so the first access of the parameter inside the base forward computes it once and the
cache holds it until the outermost ``cached()`` exits (the wrappers of one module nest: peft wraps the first
targeted parameter innermost). Then the parametrization is removed and its proxy, with what it holds, dies.

- An expert stack [E, out, in] (num_experts > 1, one adapter): ``_LoraFactorsProxy(*get_delta_factors())``.
  get_delta_factors reshapes lora_B [out, r·E] to [E, out, r] (reshape, then permute) and lora_A [r·E, in] to
  [E, r, in] (views), each ``.to(param.dtype)`` (a copy when the adapters' dtype differs; lhs first), and the
  proxy's forward is ``torch.baddbmm(W, lhs, rhs, alpha=scaling)``: a new tensor of the whole stack in the
  parameter's dtype. BaddbmmBackward0 saves batch1 for batch2's grad and batch2 for batch1's (the frozen W's
  grad is not computed) and, in sorted input-name order, computes batch1's grad ``grad.bmm(batch2ᵀ)`` then
  batch2's ``batch1ᵀ.bmm(grad)``, each times alpha (maybe_multiply: a second tensor unless alpha is 1). The
  grad of the permuted lhs reaches lora_B through the reshape's backward, a copy (it is not contiguous).
- A 2-D weight (the router: num_experts 1): ``_LoraParameterProxy(get_delta_weight())``: lora.Linear's
  ``(lora_B @ lora_A) * scaling`` (on a CPU with 16-bit adapters through fp32 copies and a cast back), then
  ``.to(param.dtype)``; the proxy's forward is ``W + delta`` (AddBackward0 hands delta the grad itself).
  The delta dies with the proxy. MmBackward0 computes mat2's (lora_A's) grad first, then self's.

Symbols: E experts, r the adapter's rank (2r for the fused gate_up_proj: peft's _convert_peft_config_moe doubles
r and lora_alpha there), b the parameter's dtype bytes, a the adapters'.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod as numel_of

from . import blocks as B
from .autograd import Tensor
from .blocks import FP32


@dataclass(frozen=True, slots=True)
class Wrapped:
    """One parameter peft wraps: the ParamWrapper module holding its adapter, the parameter's shape, the rank."""

    module: str
    shape: tuple[int, ...]
    rank: int
    scaling: float


def _names(module: str) -> tuple[str, str]:
    return f"{module}.lora_A.default.weight", f"{module}.lora_B.default.weight"


class Activation:
    """One ParamWrapper's ``_activate_lora`` around its base forward: ``enter`` builds the proxy's tensors,
    ``weight`` is the first access of the parameter inside the forward (the cached parametrization), ``exit``
    removes the parametrization."""

    def __init__(self, net, name: str, w: Wrapped):
        self.net, self.name, self.param, self.w = net, name, net.p[name], w
        self.held: list[Tensor] = []  # what the proxy holds (the factors' casts, the delta)
        self.value: Tensor | None = None  # the cached parametrized tensor
        self.accessed: list[Activation] = []  # the shared cache's insertion order (run_wrapped)

    def enter(self) -> None:
        net, w = self.net, self.w
        ag, p, a = net.ag, net.p, net.p.adapter_bytes
        b = self.param.nbytes // numel_of(w.shape)
        wa, wb = (p[n] for n in _names(w.module))
        if len(w.shape) == 3:
            lhs = _permuted_view(ag, wb, f"{w.module}.lhs")  # [E, out, r]
            rhs = ag.view(wa, f"{w.module}.rhs")  # [E, r, in]
            self.held = [B.to_dtype(ag, lhs, lhs.nbytes // a * b, f"{w.module}.lhs_cast"),
                         B.to_dtype(ag, rhs, rhs.nbytes // a * b, f"{w.module}.rhs_cast")]
            ag.release(lhs)
            ag.release(rhs)
            self._check()
            return
        out, inn = w.shape
        if net.device == "cpu" and a < FP32:  # Linear.get_delta_weight: weight_A.float(), weight_B.float()
            fa, fb = (B.to_dtype(ag, t, t.nbytes // a * FP32, f"{w.module}.{n}_fp32") for t, n in ((wa, "A"), (wb, "B")))
            prod = _mm(ag, fb, fa, FP32 * out * inn, f"{w.module}.delta_mm")
            scaled = B.scale(ag, prod, f"{w.module}.delta")
            ag.release(prod)
            delta = B.to_dtype(ag, scaled, a * out * inn, f"{w.module}.delta_cast")
            ag.release(scaled)
            for t in (fa, fb):
                ag.release(t)
        else:
            prod = _mm(ag, wb, wa, a * out * inn, f"{w.module}.delta_mm")
            delta = B.scale(ag, prod, f"{w.module}.delta")
            ag.release(prod)
        self.held = [B.to_dtype(ag, delta, b * out * inn, f"{w.module}.delta_to")]  # ParamWrapper.get_delta_weight
        ag.release(delta)
        self._check()

    def _check(self) -> None:
        """register_parametrization's consistency check (ParametrizationList.__init__, unsafe=False): ``Z =
        self()`` evaluates the parametrization once and Z dies as __init__ returns (its graph with it)."""
        self.net.ag.release(self.net.ag.empty(f"{self.w.module}.registration_check", self.param.nbytes))

    def weight(self) -> Tensor:
        """The parameter as the base forward reads it (computed at the first access, then cached)."""
        if self.value is not None:
            return self.value
        ag, w = self.net.ag, self.w
        if len(w.shape) == 3:
            lhs, rhs = self.held
            self.value = _baddbmm(ag, self.param, lhs, rhs, w)
        else:
            (delta,) = self.held
            self.value = ag.op(f"{w.module}.weight_lora", self.param.nbytes, (self.param, delta), (),
                               lambda ctx, grad, node: grad)
        self.accessed.append(self)
        return self.value

    def clear_cache(self) -> None:
        """The outermost ``cached()`` exits: the cache's reference goes."""
        self.net.ag.release(self.value)
        self.value = None

    def exit(self) -> None:
        """_remove_parametrizations: the proxy dies with what it holds."""
        for t in self.held:
            self.net.ag.release(t)
        self.held = []


def run_wrapped(net, activations: list[Activation], fn):
    """``fn()`` (the base forward, reading each parameter through ``Activation.weight``) inside the nested
    wrappers of ``activations`` (outermost first): each enters in turn and the innermost's base runs; then the
    inner ones remove their parametrizations, innermost first, the outermost ``cached()`` empties the cache
    (``_cache = {}``: the old dict releases its values in insertion order, the order of first access) and the
    outermost removes its own."""
    accessed: list[Activation] = []
    for act in activations:
        act.enter()
        act.accessed = accessed
    out = fn()
    for act in reversed(activations[1:]):
        act.exit()
    for act in accessed:
        act.clear_cache()
    if activations:
        activations[0].exit()
    return out


def _permuted_view(ag, wb: Tensor, name: str) -> Tensor:
    """lora_B.reshape(out, r, E).permute(2, 0, 1): a view whose backward reshapes a non-contiguous grad, which
    copies (ViewBackward0 on PermuteBackward0's permuted grad)."""
    v = Tensor(wb.storage, wb.nbytes, name, wb.requires_grad, is_view=True)
    ag.ref(v)
    if wb.requires_grad and ag.grad_enabled:
        v.node = ag._node(f"{name}.reshape_permute", (wb,), (),
                          lambda ctx, grad, node: (ctx.new(f"grad.{name}", wb.nbytes),))
    return v


def _mm(ag, mat1: Tensor, mat2: Tensor, out_bytes: int, name: str) -> Tensor:
    """mat1 @ mat2 (MmBackward0: mat2's grad self^T·grad, then self's grad·mat2^T; each saves the other)."""
    def backward(ctx, grad, node):
        g2 = ctx.new(f"grad.{name}.mat2", mat2.nbytes) if mat2.requires_grad else None
        g1 = ctx.new(f"grad.{name}.self", mat1.nbytes) if mat1.requires_grad else None
        return (g1, g2)

    saved = ((mat2,) if mat1.requires_grad else ()) + ((mat1,) if mat2.requires_grad else ())
    return ag.op(name, out_bytes, (mat1, mat2), saved, backward)


def _baddbmm(ag, w_param: Tensor, lhs: Tensor, rhs: Tensor, w: Wrapped) -> Tensor:
    """torch.baddbmm(W, lhs, rhs, alpha=scaling) (the module docstring)."""
    scaled = w.scaling != 1.0

    def grad_of(ctx, like: Tensor, name: str) -> Tensor:
        g = ctx.new(f"grad.{name}", like.nbytes)
        if not scaled:
            return g
        out = ctx.new(f"grad.{name}.alpha", like.nbytes)
        ctx.free(g)
        return out

    def backward(ctx, grad, node):
        g1 = grad_of(ctx, lhs, f"{w.module}.baddbmm.batch1") if lhs.requires_grad else None
        g2 = grad_of(ctx, rhs, f"{w.module}.baddbmm.batch2") if rhs.requires_grad else None
        return (None, g1, g2)

    # SavedVariables batch1_ then batch2_ (released in that order): each saved for the other's grad
    saved = ((lhs,) if rhs.requires_grad else ()) + ((rhs,) if lhs.requires_grad else ())
    return ag.op(f"{w.module}.baddbmm", w_param.nbytes, (w_param, lhs, rhs), saved, backward)


def activations(net, names: tuple[str, ...]) -> list[Activation]:
    """The ParamWrappers around the module whose parameters are ``names`` (registration order), outermost
    first (peft wrapped the first targeted one innermost); empty when peft wraps none of them."""
    wrapped = net.p.wrapped
    return [Activation(net, n, wrapped[n]) for n in names if n in wrapped][::-1]


def reader(net, acts: list[Activation]):
    """``read(name)``: the parameter as the base forward sees it: through its wrapper's parametrization when
    wrapped (its first read computes it), else the parameter itself."""
    by_name = {a.name: a for a in acts}
    return lambda name: by_name[name].weight() if name in by_name else net.p[name]
