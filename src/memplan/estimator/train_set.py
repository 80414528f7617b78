"""Which parameters train: a frozen base, LoRA adapters, modules_to_save and --freeze.

Parameters (peft 0.21 peft/tuners/lora/layer.py LoraLayer.update_layer, peft/utils/other.py
ModulesToSaveWrapper, peft/tuners/lora/model.py LoraModel._mark_only_adapters_as_trainable): get_peft_model
freezes every base parameter; each adapted linear gains lora_A.default (r × in) and lora_B.default (out × r)
after its base_layer's weight and bias, and with use_dora a lora_magnitude_vector (out); LoraConfig.bias
"all" trains every bias, "lora_only" the biases of the adapted linears; each module named in modules_to_save
is deep-copied (the copy trains, the original stays frozen: both are held in the training dtype). --freeze
without an adapter turns off the groups memplan.params.frozen_names names. ``deepspeed.initialize`` is given
the trainable parameters only (memplan.verify.worker.initialize), as users pass them. DeepSpeed's buffers:
ZeRO-1/2's grads_in_partition and the flat groups cover the trainable parameters (stage_1_and_2.py __init__
builds bit16_groups from the params with requires_grad), but the IPG buckets are reduce_bucket_size elements
whatever the trainable count (stage_1_and_2.py setup_buckets; stage3.py __init__ under contiguous_gradients),
so they stay as in full training; ZeRO-3 partitions and gathers every parameter (zero.Init), frozen or not.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..params import ParamTensor, frozen_names, linear_modules, parameter_tensors
from ..peftconfig import adapted_linears, module_matches, wrapped_parameters
from ..specs import LoraSpec, ModelSpec, TrainingSpec
from .peft_param import Wrapped


@dataclass(frozen=True, slots=True)
class TrainSet:
    """Every parameter tensor of the (adapted) model in named_parameters() order, with whether it trains."""

    tensors: tuple[tuple[ParamTensor, bool], ...]
    adapted: tuple[ParamTensor, ...]  # the base weight of each adapted linear
    #: the parameters peft adapts through lora.ParamWrapper: (base parameter name, its Wrapped)
    wrapped: tuple[tuple[str, Wrapped], ...] = ()

    @property
    def trainable_params(self) -> int:
        """Elements of the parameters that require grad (what the optimizer and ZeRO's groups hold)."""
        return sum(t.numel for t, trains in self.tensors if trains)

    @property
    def frozen_params(self) -> int:
        """Elements of the parameters that do not (held in the training dtype only)."""
        return sum(t.numel for t, trains in self.tensors if not trains)


def in_out_features(model: ModelSpec, weight: ParamTensor) -> tuple[int, int]:
    """(in, out) features of a linear's weight: nn.Linear (out, in); GPT-2's Conv1D (in, out)."""
    return weight.shape[::-1] if model.family != "gpt2" else weight.shape


@lru_cache(maxsize=1024)
def train_set(model: ModelSpec, lora: LoraSpec | None, freeze: tuple[str, ...]) -> TrainSet:
    """Which tensors train for this adapter / frozen groups (all of them without either)."""
    base = parameter_tensors(model)
    if lora is None:
        frozen = frozen_names(model, freeze) if freeze else frozenset()
        return TrainSet(tuple((t, t.name not in frozen) for t in base), ())
    adapted = set(adapted_linears(model.family, lora.targets, linear_modules(model)))
    suffixes = wrapped_parameters(model.family, lora.targets)
    wrapped: list[tuple[str, Wrapped]] = []
    pending: list[ParamTensor] = []  # this module's wrapped parameters, in registration order
    saved = tuple(lora.modules_to_save)
    out: list[tuple[ParamTensor, bool]] = []
    weights: list[ParamTensor] = []
    copies: list[tuple[ParamTensor, bool]] = []
    for i, t in enumerate(base):
        module = t.name.rsplit(".", 1)[0]
        bias_trains = t.is_bias and (lora.bias == "all" or (lora.bias == "lora_only" and module in adapted))
        out.append((t, bias_trains))
        if saved and any(module_matches(module, s) for s in saved):
            copies.append((ParamTensor(f"{module}.modules_to_save.{t.name[len(module) + 1:]}", t.shape, t.layer,
                                       t.role), True))
        last_of_module = i + 1 == len(base) or base[i + 1].name.rsplit(".", 1)[0] != module
        if any(t.name.endswith("." + x) for x in suffixes):
            pending.append(t)
        if pending and last_of_module:
            for w in _param_wrappers(module, pending, lora):
                wrapped.append(w)
                out += _wrapper_adapters(w[1], t)
            pending = []
        if module in adapted and last_of_module:
            w = next(x for x in base if x.name == f"{module}.weight")
            weights.append(w)
            n_in, n_out = in_out_features(model, w)
            out.append((ParamTensor(f"{module}.lora_A.default.weight", (lora.rank, n_in), t.layer, t.role), True))
            out.append((ParamTensor(f"{module}.lora_B.default.weight", (n_out, lora.rank), t.layer, t.role), True))
            if lora.use_dora:
                out.append((ParamTensor(f"{module}.lora_magnitude_vector", (n_out,), t.layer, t.role), True))
        if copies and last_of_module:
            out += copies
            copies = []
    return TrainSet(tuple(out), tuple(weights), tuple(wrapped))


def _scaling(lora: LoraSpec, rank: int, alpha: float) -> float:
    """LoraLayer.update_layer: lora_alpha / r, or / sqrt(r) with use_rslora."""
    return alpha / rank ** 0.5 if lora.use_rslora else alpha / rank


def _param_wrappers(module: str, params: list[ParamTensor], lora: LoraSpec) -> list[tuple[str, Wrapped]]:
    """The ParamWrappers of one module's targeted parameters: peft wraps the first innermost, so the k-th of n
    lives at ``module`` + ".base_layer" × (n − 1 − k). The fused gate_up_proj gets r and lora_alpha doubled
    (_convert_peft_config_moe's rank_pattern and alpha_pattern)."""
    out = []
    for k, t in enumerate(params):
        fused = 2 if t.name.endswith(".gate_up_proj") else 1
        rank = lora.rank * fused
        out.append((t.name, Wrapped(module + ".base_layer" * (len(params) - 1 - k), tuple(t.shape), rank,
                                    _scaling(lora, rank, lora.alpha * fused))))
    return out


def _wrapper_adapters(w: Wrapped, t: ParamTensor) -> list[tuple[ParamTensor, bool]]:
    """lora_A and lora_B of a ParamWrapper (ParamWrapper.update_layer: nn.Linear(in, r·E) and nn.Linear(r·E,
    out)); a 3-D expert stack is stored (E, out, in) and a 2-D weight (out, in)."""
    e, out_f, in_f = w.shape if len(w.shape) == 3 else (1, *w.shape)
    return [(ParamTensor(f"{w.module}.lora_A.default.weight", (w.rank * e, in_f), t.layer, t.role), True),
            (ParamTensor(f"{w.module}.lora_B.default.weight", (out_f, w.rank * e), t.layer, t.role), True)]


def job_train_set(training: TrainingSpec, model: ModelSpec) -> TrainSet:
    """train_set for a job's training spec."""
    return train_set(model, training.lora, tuple(training.freeze))


def trains_everything(training: TrainingSpec) -> bool:
    """Full training: no adapter and no frozen group."""
    return training.lora is None and not training.freeze


def parameter_counts(training: TrainingSpec, model: ModelSpec) -> dict[str, int]:
    """The whole model's trainable and frozen parameter counts (what verify records from requires_grad)."""
    ts = job_train_set(training, model)
    return {"trainable_params": ts.trainable_params, "frozen_params": ts.frozen_params}
