"""peft 0.21's LoRA linear (peft/tuners/lora/layer.py Linear.forward) in the autograd model, and which jobs the
ledger runs with adapters.

``lora.Linear.forward(x)``::

    result = self.base_layer(x)                      # the frozen nn.Linear (or GPT-2's Conv1D)
    torch_result_dtype = result.dtype
    x = self._cast_input_dtype(x, lora_A.weight.dtype)   # x.to(adapter dtype): a copy when they differ
    result = result + lora_B(lora_A(dropout(x))) * scaling
    result = result.to(torch_result_dtype)
    return result

``dropout`` is nn.Dropout(lora_dropout) (nn.Identity at 0: x itself). The expression's temporaries die as the
interpreter pops them: dropout(x) once lora_A returns, lora_A's output once lora_B returns, lora_B's once the
multiply by the Python float ``scaling`` returns (mul.Scalar saves nothing), the product once the add returns;
the cast input dies with the frame (its local ``x``) after the final ``.to``. With fp32 adapters on a 16-bit
base (peft's autocast_adapter_dtype, kept under ZeRO-3: lora.adapter_dtype_bytes) the add promotes to fp32 and
``.to`` copies back; with adapters in the base dtype ``.to`` returns the tensor itself. lora_A and lora_B are
nn.Linear modules (ZeRO-3 hooks gather their weights; under ZeRO-3 their F.linear is
LinearFunctionForZeroStage3, as the base layer's). The wrapper itself owns no parameter.
"""

from __future__ import annotations

from . import blocks as B
from . import blocks_linear as BL
from .autograd import Tensor

#: peft's adapter names in named_parameters (LoraLayer.update_layer: lora_A[adapter_name], lora_B[adapter_name])
ADAPTER = "default"


def adapter_names(module: str) -> tuple[str, str]:
    """The names of the A and B weights peft gives the adapter of linear ``module``."""
    return f"{module}.lora_A.{ADAPTER}.weight", f"{module}.lora_B.{ADAPTER}.weight"


def ledger_models(lora) -> bool:
    """Adapters the ledger models: plain LoRA on linears, bias "none", nothing in modules_to_save, no DoRA
    (the rest stays on the phase lists: estimator/lora.py)."""
    return lora is None or (lora.bias == "none" and not lora.modules_to_save and not lora.use_dora)


def adapter_tensors(job) -> tuple[tuple[str, int], ...]:
    """(name, numel) of the job's adapter weights in named_parameters() order (none without LoRA)."""
    if job.training.lora is None:
        return ()
    from .lora import job_train_set

    return tuple((t.name, t.numel) for t, _ in job_train_set(job.training, job.model).tensors if ".lora_" in t.name)


def build_adapters(L, adapters: tuple[tuple[str, int], ...], b: int) -> list[int]:
    """get_peft_model's allocations on the GPU, after the base model (``b``: its dtype's bytes): each adapted
    linear's lora_A and lora_B are made on the host (nn.Linear's fp32 default) and moved with the base
    weight's device and dtype (tuners_utils.py _move_adapter_to_device_of_base_layer: ``item.to(device,
    dtype=base dtype)``); then cast_adapter_dtype (autocast_adapter_dtype=True) makes every 16-bit adapter
    weight fp32 (``param.data = param.data.float()``: the fp32 copy, then the 16-bit one freed). Returns the
    ledger ids of the fp32 weights, in order."""
    moved = [L.alloc(f"{name} (moved)", b * numel, "params_16bit") for name, numel in adapters]
    if b == 4:
        return moved
    out = []
    for (name, numel), old in zip(adapters, moved):
        out.append(L.alloc(name, 4 * numel, "params_16bit"))
        L.free(old)
    return out


def cast_adapters(L, adapters: tuple[tuple[str, int], ...], ids: list[int], b: int) -> dict[str, int]:
    """DeepSpeedEngine._cast_module_mixed_precision (a model not built under zero.Init): every fp32 parameter
    cast to the training dtype, ``p.data = p.data.to(dtype)`` in parameters() order (the copy, then the fp32
    one freed). Returns the new ids by name."""
    out = {}
    for (name, numel), old in zip(adapters, ids):
        if b == 4:
            out[name] = old
            continue
        out[name] = L.alloc(name, b * numel, "params_16bit")
        L.free(old)
    return out


def lora_linear(net, x: Tensor, name: str, out_features: int, base) -> Tensor:
    """peft's Linear.forward around the base layer ``base(x)`` (the module docstring), for linear ``name``."""
    ag, p, s = net.ag, net.p, net.s
    a_name, b_name = adapter_names(name)
    wa, wb = p[a_name], p[b_name]
    rank = p.lora_rank
    result = base(x)
    net.hooks.param_access(ag, name, a_name)  # _cast_input_dtype(x, lora_A.weight.dtype) reads lora_A's weight
    xa = B.to_dtype(ag, x, x.nbytes // s.b * p.adapter_bytes, f"{name}.lora_input")
    # self.lora_dropout[adapter](x): a module (nn.Dropout, or nn.Identity at 0) without parameters
    dropped = net.container(f"{name}.lora_dropout.{ADAPTER}", lambda z: B.dropout(
        ag, z, p.lora_dropout, p.adapter_bytes, f"{name}.lora_dropout", net.device), xa)
    transposed = not net.hooks.zero3_linear
    keep = net.hooks.zero3_linear
    a_out = net.module(f"{name}.lora_A.{ADAPTER}",
                       lambda z: BL.linear(ag, z, wa, p.adapter_bytes * s.tokens * rank, f"{name}.lora_A",
                                          transposed=transposed, keeps_input=keep), dropped, params=(wa,))
    ag.release(dropped)
    b_out = net.module(f"{name}.lora_B.{ADAPTER}",
                       lambda z: BL.linear(ag, z, wb, p.adapter_bytes * s.tokens * out_features, f"{name}.lora_B",
                                          transposed=transposed, keeps_input=keep), a_out, params=(wb,))
    ag.release(a_out)
    scaled = B.scale(ag, b_out, f"{name}.lora_scaled")
    ag.release(b_out)
    total = B.add(ag, result, scaled, f"{name}.lora_sum")
    ag.release(scaled)
    ag.release(result)
    out = B.to_dtype(ag, total, result.nbytes, f"{name}.lora_result")
    ag.release(total)
    ag.release(xa)  # the frame's local x (the cast input) dies as forward returns
    return out
