"""The megatron-core measurement case and memplan's prediction for it (pure; the harness is
memplan.verify.megatron_worker).

The harness builds megatron-core 0.16.1's GPTModel (get_gpt_layer_local_spec: no Transformer Engine, no apex,
learned absolute positions, tied output layer) inside Float16Module, on one rank of a tp group emulated with
torch's fake process group, and runs forward + backward micro-steps with param.grad gradients (no DDP wrapper,
no optimizer). Its phases: "init" (the model built), then per micro-step "forward" and "backward"; peak
allocated per phase, and each layer's forward delta of memory_allocated.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..specs import Job, Layout, MegatronSpec, ModelSpec, TrainingSpec, _Frozen
from .layer import layer_terms, selective_terms
from .outside import loss_backward_transient_per_token, loss_forward_transient_per_token
from .shape import resolve, split
from .stage import stage_activations


class MegatronCase(_Frozen):
    """One megatron-core measurement: the model's shape, the job, the flags (one row of the matrix)."""

    name: str = Field(pattern=r"^[A-Za-z0-9._-]{1,80}$")
    hidden: int = Field(gt=0, le=65536)
    heads: int = Field(gt=0, le=1024)
    layers: int = Field(gt=0, le=256)
    ffn: int | None = Field(None, gt=0, description="ffn_hidden_size (None: 4·hidden)")
    vocab: int = Field(50257, gt=0, le=2**20, description="before Megatron's padding")
    seq: int = Field(gt=0, le=2**17)
    micro: int = Field(1, gt=0, le=64)
    dtype: Literal["bf16", "fp16"] = "bf16"
    tp: int = Field(1, gt=0, le=16)
    sequence_parallel: bool = False
    checkpointing: Literal["none", "selective", "full"] = "none"
    flash: bool = False
    hidden_dropout: float = Field(0.0, ge=0, lt=1)
    attention_dropout: float = Field(0.0, ge=0, lt=1)
    recompute_method: Literal["uniform", "block"] = "uniform"
    recompute_num_layers: int = Field(1, gt=0)
    micro_steps: int = Field(2, gt=0, le=8, description="forward + backward micro-steps measured")


def case_model(case: MegatronCase) -> ModelSpec:
    """The GPT the harness builds, as a memplan ModelSpec (GPT-2 style: LayerNorm, GeLU, biases, learned
    positions, tied embeddings)."""
    return ModelSpec(
        name=case.name, family="gpt2", hidden_size=case.hidden, num_layers=case.layers, num_heads=case.heads,
        num_kv_heads=case.heads, head_dim=case.hidden // case.heads, intermediate_size=case.ffn or 4 * case.hidden,
        vocab_size=case.vocab, max_position_embeddings=case.seq, tie_word_embeddings=True, attention_bias=True,
        attention_out_bias=True, mlp_bias=True, norm="layernorm", gated_mlp=False, activation="gelu",
        position_embedding="learned", source="memplan.megatron.harness MegatronCase")


def case_job(case: MegatronCase) -> Job:
    """The memplan Job of a case (megatron-core codebase; no fused softmax kernel without apex / TE)."""
    meg = MegatronSpec(codebase="megatron-core", masked_softmax_fusion=False, pipeline_engine=False,
                       hidden_dropout=case.hidden_dropout, attention_dropout=case.attention_dropout,
                       recompute_method=case.recompute_method, recompute_num_layers=case.recompute_num_layers)
    training = TrainingSpec(seq_len=case.seq, micro_batch=case.micro, dtype=case.dtype,
                            checkpointing=case.checkpointing, attention="flash" if case.flash else "eager",
                            model_impl="megatron", megatron=meg)
    layout = Layout(world=case.tp, tp=case.tp, tp_sequence_parallel=case.sequence_parallel)
    return Job(model=case_model(case), training=training, layout=layout)


def param_bytes(case: MegatronCase) -> int:
    """This rank's 16-bit parameters: word embedding [V/t, h] (tied with the output layer), positions [s, h],
    per layer qkv [3h/t, h] + bias, proj [h, h/t] + bias h, fc1 [I/t, h] + bias, fc2 [h, I/t] + bias h, two
    LayerNorms, and the final LayerNorm (megatron-core layers.py Column/RowParallelLinear shapes)."""
    job = case_job(case)
    s = resolve(job.model, job)
    h, i, t = s.h, s.ffn, s.tp
    layer = (3 * h * h + 3 * h) // t + h * h // t + h + (h * i + i) // t + i * h // t + h + 4 * h
    return s.b * (s.vocab // t * h + case.seq * h + case.layers * layer + 2 * h)


def per_layer_bytes(case: MegatronCase) -> int:
    """What the harness's forward hooks read for one layer: memory_allocated after − before. Without full
    recompute that is the layer's saved tensors (its input is the previous layer's output, its output the
    next one's input); under full recompute the layer runs inside the checkpoint's no-grad forward and leaves
    only its output [T/r, h]."""
    job = case_job(case)
    s = resolve(job.model, job)
    if case.checkpointing == "full":
        return split(s.b * s.h, s.r) * s.tokens
    terms = selective_terms(job.model, job) if case.checkpointing == "selective" else layer_terms(job.model, job)
    return sum(t.bytes_per_token for t in terms) * s.tokens


def predict(case: MegatronCase) -> dict[str, int]:
    """Peak allocated of each phase of the harness's loop as memplan models it (bytes): "init",
    "micro<i>.forward", "micro<i>.backward", and "peak". From the second micro-step on, every parameter's
    .grad exists (16-bit, AccumulateGrad adds each new gradient into it)."""
    job = case_job(case)
    m, s = job.model, resolve(job.model, job)
    tokens = s.tokens
    params = param_bytes(case)
    a = stage_activations(m, job, case.layers)
    v = s.vocab // s.tp
    head_grad = s.b * v * s.h  # the tied word embedding's grad, from the output layer's backward
    layer_grad = s.b * ((4 * s.h * s.h + 2 * s.h * s.ffn) // s.tp)  # one layer's weight grads
    base = params + a.buffers
    held = a.saved_layers + a.outside
    forward = max(base + held + loss_forward_transient_per_token(m, job) * tokens, base + a.forward_layer_peak)
    # the loss's backward turns its saved fp32 softmax into the grad in place; the grad's cast to the logits'
    # dtype (ToCopyBackward of .float()) exists beside it before the fp32 grad is freed
    at_cast = base + held + s.b * v * tokens
    after_loss = base + held - 4 * v * tokens + loss_backward_transient_per_token(m, job) * tokens
    top = base + a.saved_layers + a.recompute - (0 if a.recompute else a.layer_saved) + a.backward_transient
    end = base + head_grad  # the embedding's dense grad before it is added into the tied .grad
    scores = base + a.backward_layer_peak  # CoreAttention's backward in the last layer (0: flash)
    # the tied weight's AccumulateGrad runs once both uses have sent their grads: the output layer's [V/t, h]
    # grad waits in its InputBuffer through every layer's backward, in every micro-step
    first = {"forward": forward, "backward": max(at_cast, after_loss + head_grad, top + head_grad + layer_grad,
                                                 scores + head_grad + layer_grad, end + params)}
    # from the second micro-step every .grad exists: no weight grad is in flight beside the softmax's backward
    later = {"forward": forward + params, "backward": max(at_cast, after_loss + head_grad, top + head_grad
                                                          + layer_grad, scores + head_grad, end) + params}
    out = {"init": params}
    for i in range(case.micro_steps):
        for phase, peak in (first if i == 0 else later).items():
            out[f"micro{i}.{phase}"] = peak
    out["peak"] = max(out.values())
    return out
