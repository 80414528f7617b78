"""What a frozen base and LoRA adapters change in what autograd saves (which parameters train:
estimator/train_set.py).

Saved tensors (torch's tools/autograd/derivatives.yaml and gen_variable_type.py's guard_for: a saved input
used only by one operand's gradient formula is saved only when that operand requires grad). ``mm``/``addmm``
(F.linear): the input is saved for the weight's gradient, the weight for the input's; ``mul``: each factor
for the other's gradient. So a frozen linear keeps nothing of its own (its weight is a parameter), and a
frozen norm's ``weight · x`` keeps no normalised x. peft's lora.Linear.forward computes
``base_layer(x) + lora_B(lora_A(dropout(x))) * scaling``: lora_A saves dropout(x) (x itself when
lora_dropout is 0, nn.Identity), native_dropout its bool mask, lora_B the r-wide output of lora_A; the
multiply by the Python float scaling saves nothing. The embedding (embedding_backward) keeps its indices
only when its weight trains. Without gradient checkpointing a frozen embedding's output does not require
grad, so layer 0's first norm keeps only what its weight's gradient needs; with it, transformers 5.17's
gradient_checkpointing_enable calls enable_input_require_grads (modeling_utils.py; peft's
PeftModel._prepare_model_for_gradient_checkpointing does the same), and layer 0 is like every other.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..params import Role
from ..specs import LoraSpec, ModelSpec, TrainingSpec
from .activations import DROPOUT_MASK_BYTES, Term
from .train_set import TrainSet, in_out_features, job_train_set, trains_everything


#: saved tensors that only a weight's gradient reads (an input of a linear, a norm's normalised x), by the
#: role of the weight that reads them (suffixes for the norms' ``<name>.normed``)
_WEIGHT_GRAD_INPUTS: dict[str, Role] = {
    "attn.proj_input": "attn_in", "mla.q_b_proj_input": "attn_in", "mla.kv_b_proj_input": "attn_in",
    "attn.out_proj_input": "attn_out", "mlp.input": "mlp_in", "mlp.fc_out_input": "mlp_out",
    "lm_head.input": "lm_head", "embedding.indices": "embedding", "moe.router_input": "router",
    "moe.gathered_input": "mlp_in", "moe.shared_input": "mlp_in",
}
_NORMED_SUFFIXES = (".normed", ".fp32_normed")
#: grouped terms with one member read only by a weight's gradient: (its role, the share of the term). A gated
#: MLP's [T, I] quartet gate, act(gate), up (read by input gradients) and their product (down_proj's input);
#: the experts' act(gate) and act·up (the grouped down_proj's input); Phi-3's fused MLP keeps act(gate) and
#: act·up beside its gate_up_proj output (activations_families._dense_mlp: "mlp.act_and_prod")
_SHARED_TERMS: dict[str, tuple[Role, int]] = {
    "mlp.gate_up_act_prod": ("mlp_out", 4), "moe.shared_gate_up_act_prod": ("mlp_out", 4),
    "moe.act_and_product": ("mlp_out", 2), "mlp.act_and_prod": ("mlp_out", 2)}
#: the first norm of a layer (its input is the layer's input), and the branches a layer's input feeds
_FIRST_NORMS = ("input_layernorm.", "ln_1.")
_ATTENTION_BRANCH = ("attn.", "q_norm.", "k_norm.", "mla.")
_MLP_BRANCH = ("mlp.", "moe.")
_MLP_NORMS = ("post_attention_layernorm.", "ln_2.")
_ATTENTION_ROLES = ("attn_in", "attn_out", "attn_latent")
_ATTENTION_ENTRY = ("attn_in", "attn_latent")
_MLP_ENTRY = ("mlp_in", "router")


@dataclass(frozen=True, slots=True)
class _Layer:
    """What trains in one place of the model: base weights by role, adapted linears by role, norms."""

    weights: frozenset  # roles with a training base weight
    adapted: tuple  # (role, in features) per adapted linear
    norms: bool  # a norm weight trains


def _layer(ts: TrainSet, model: ModelSpec, layer: int | None) -> _Layer:
    weights = {t.role for t, trains in ts.tensors if trains and t.layer == layer and not t.is_bias
               and ".lora_" not in t.name}
    adapted = tuple((w.role, in_out_features(model, w)[0]) for w in ts.adapted if w.layer == layer)
    norms = any(trains and t.role == "norm" and not t.is_bias for t, trains in ts.tensors if t.layer == layer)
    return _Layer(frozenset(weights), adapted, norms)


def _input_kept(place: _Layer, role: str, dropout: float, shared_input: bool) -> bool:
    """A linear input stays saved when a training base weight reads it, or lora_A reads it as it is (no
    dropout, and the adapter in the training dtype: ``shared_input``)."""
    return role in place.weights or (shared_input and dropout == 0 and any(r == role for r, _ in place.adapted))


def _trains_in(place: _Layer, roles: tuple[str, ...]) -> bool:
    return any(r in place.weights for r in roles) or any(r in roles for r, _ in place.adapted)


@dataclass(frozen=True, slots=True)
class _Flow:
    """Where gradients flow in a layer whose input may not require grad: its branches' inputs and entries."""

    layer_input: bool  # the layer's input requires grad
    attention_entry: bool  # q/k/v (or MLA's down projections) train or are adapted
    mlp_input: bool  # the MLP's input requires grad
    mlp_entry: bool  # gate/up (fc_in, the router) train or are adapted

    @classmethod
    def of(cls, place: _Layer, input_requires_grad: bool, parallel_residual: bool) -> _Flow:
        if input_requires_grad:
            return cls(True, True, True, True)
        attention = _trains_in(place, _ATTENTION_ROLES)  # o_proj too: the residual after it requires grad
        return cls(False, _trains_in(place, _ATTENTION_ENTRY), attention and not parallel_residual,
                   _trains_in(place, _MLP_ENTRY))

    def input_grad(self, role: str) -> bool:
        """Whether an adapted linear of ``role`` gets an input that requires grad (then its dropout keeps a mask)."""
        if role in _ATTENTION_ENTRY:
            return self.layer_input
        if role == "attn_out":
            return self.attention_entry
        if role in _MLP_ENTRY:
            return self.mlp_input
        return self.mlp_input or self.mlp_entry if role == "mlp_out" else True

    def grad_free(self, name: str) -> bool:
        """A term no gradient flows through: the first norm (but its weight's input), the attention before its
        first trained linear, the MLP's norm when the MLP's input does not require grad, the MLP before its
        first trained linear. Linear inputs are _input_kept's to decide."""
        if name.endswith(_NORMED_SUFFIXES) or name in _WEIGHT_GRAD_INPUTS:
            return False
        if name.startswith(_FIRST_NORMS):
            return not self.layer_input
        if name.startswith(_ATTENTION_BRANCH):
            return not self.attention_entry
        if name.startswith(_MLP_NORMS):
            return not self.mlp_input
        if name.startswith(_MLP_BRANCH):
            return not (self.mlp_input or self.mlp_entry)
        return False


def apply(terms: tuple[Term, ...], place: _Layer, b: int, lora: LoraSpec | None, input_requires_grad: bool = True,
          adapter_bytes: int | None = None, parallel_residual: bool = False, kernel: str = "cuda",
          zero3_linear: bool = False) -> tuple[Term, ...]:
    """``terms`` (what full training saves) as a frozen base with these adapters saves them: the module
    docstring's rule, written once for the layers and for the head. ``adapter_bytes``: the adapters' dtype
    (b, or 4 where peft's fp32 adapters stay fp32: adapter_dtype_bytes); x is cast to it before lora_A.
    ``kernel`` "cpu": torch's CPU dropout keeps its scaled noise in the input dtype (aten/native/Dropout.cpp
    _dropout_impl: input * noise) where CUDA's native_dropout keeps a bool mask. ``zero3_linear``: F.linear
    is DeepSpeed's LinearFunctionForZeroStage3 (zero3_linear_uses_saved_input)."""
    dropout = lora.dropout if lora is not None else 0.0
    a = adapter_bytes or b
    shared = a == b
    flow = _Flow.of(place, input_requires_grad, parallel_residual)

    def input_kept(role: Role) -> bool:
        return (_input_kept(place, role, dropout, shared)
                or (zero3_linear and role != "embedding" and flow.input_grad(role)))

    out: list[Term] = []
    for t in terms:
        role = _WEIGHT_GRAD_INPUTS.get(t.name)
        if role is not None and not input_kept(role):
            continue
        if t.name.endswith(_NORMED_SUFFIXES) and not place.norms:
            continue
        kept = _SHARED_TERMS.get(t.name)
        weight_share = kept is not None and input_kept(kept[0])
        if flow.grad_free(t.name):
            if weight_share:  # the product alone, for the trained down projection's weight
                out.append(Term(t.name, t.bytes_per_token // kept[1], t.detail + " (only the product: grad-free)"))
            continue
        if kept is not None and not weight_share:
            t = Term(t.name, t.bytes_per_token - t.bytes_per_token // kept[1],
                     t.detail + " (the frozen down projection's input not kept)")
        out.append(t)
    if lora is not None:
        for role, n_in in place.adapted:
            out.append(Term(f"lora.{role}.a_out", a * lora.rank, f"lora_A output [T, {lora.rank}] (lora_B input)"))
            if dropout > 0 or not shared:
                mask = (DROPOUT_MASK_BYTES if kernel == "cuda" else a) if dropout > 0 and flow.input_grad(role) else 0
                out.append(Term(f"lora.{role}.a_input", (a + mask) * n_in,
                                f"dropout(x.to(adapter dtype)) [T, {n_in}] (lora_A input){' and its mask' * bool(mask)}"))
    return tuple(out)


def zero3_linear_uses_saved_input(training: TrainingSpec) -> bool:
    """Under ZeRO-3, deepspeed.zero.Init (and DeepSpeedZeRoOffload, which wraps an un-Init'ed model in one)
    replaces torch.nn.functional.linear with zero3_linear_wrap for good (partition_parameters.py
    _enable_mem_efficient_linear, zero_optimization.memory_efficient_linear, default true), and nn.Linear calls
    it: LinearFunctionForZeroStage3.setup_context (runtime/zero/linear.py) saves input, weight and bias whatever
    requires grad. So a frozen linear that a gradient flows through keeps its input, as in full training
    (the weight is a parameter, released by ZeRO-3: no bytes). Measured: llama-3.2-1b LoRA q,v ZeRO-3 without
    checkpointing kept o_proj's, gate/up's and down_proj's inputs (rows-h200-8-lora.jsonl)."""
    return training.zero.stage == 3


def adapter_dtype_bytes(training: TrainingSpec) -> int:
    """Bytes per element of the adapter weights: get_peft_model's autocast_adapter_dtype makes them fp32
    (peft/tuners/tuners_utils.py _cast_adapter_dtype); DeepSpeedEngine._configure_distributed_model casts
    every parameter to the training dtype (_cast_module_mixed_precision), except in a zero.Init model
    (ZeRO-3), whose adapters, created after zero.Init, stay fp32."""
    from ..units import dtype_bytes

    return 4 if training.zero.stage == 3 else dtype_bytes(training.dtype)


def layer_place(training: TrainingSpec, model: ModelSpec, layer: int = 0) -> _Layer:
    """What trains in transformer layer ``layer``."""
    return _layer(job_train_set(training, model), model, layer)


def head_place(training: TrainingSpec, model: ModelSpec) -> _Layer:
    """What trains outside the layers (embeddings, final norm, lm_head)."""
    return _layer(job_train_set(training, model), model, None)


def input_requires_grad(training: TrainingSpec, model: ModelSpec) -> bool:
    """Whether layer 0's input requires grad: the word embedding trains, or checkpointing is on
    (enable_input_require_grads)."""
    if training.checkpointing != "none":
        return True
    ts = job_train_set(training, model)
    return any(trains and t.role in ("embedding", "position") for t, trains in ts.tensors)


@dataclass(frozen=True, slots=True)
class SavedDeltas:
    """What a frozen base and adapters change in the saved bytes per token against full training."""

    layer: int  # every transformer layer (layer 0's terms)
    first_layer: int  # layer 0 again when its input does not require grad (no checkpointing)
    head: int  # outside the layers: embedding, final norm, lm_head


_NO_DELTAS = SavedDeltas(0, 0, 0)


def saved_deltas(training: TrainingSpec, model: ModelSpec, seq: int, ulysses: bool) -> SavedDeltas:
    """apply() on layer 0's and the head's terms, as differences (0 for full training)."""
    return _NO_DELTAS if trains_everything(training) else _adapted_deltas(training, model, seq, ulysses)


@lru_cache(maxsize=1024)
def _adapted_deltas(training: TrainingSpec, model: ModelSpec, seq: int, ulysses: bool) -> SavedDeltas:
    from ..units import dtype_bytes
    from . import head
    from .activations import layer_terms

    b = dtype_bytes(training.dtype)
    terms = layer_terms(model, b, training.attention, seq, ulysses, 0)
    place = layer_place(training, model)
    full = sum(t.bytes_per_token for t in terms)
    a, pr = adapter_dtype_bytes(training), model.parallel_residual
    z3 = zero3_linear_uses_saved_input(training)
    layer = sum(t.bytes_per_token for t in apply(terms, place, b, training.lora, True, a, pr, zero3_linear=z3))
    first = sum(t.bytes_per_token for t in apply(terms, place, b, training.lora,
                                                 input_requires_grad(training, model), a, pr, zero3_linear=z3))
    outside = head.saved_terms(model, b, seq)
    adapted_head = sum(t.bytes_per_token for t in apply(outside, head_place(training, model), b, training.lora,
                                                        zero3_linear=z3))
    return SavedDeltas(layer - full, first - layer, adapted_head - sum(t.bytes_per_token for t in outside))
