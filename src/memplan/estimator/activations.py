"""Activations one rank keeps for backward, listed tensor by tensor, per transformer layer.

Each term is one tensor autograd saves in the family's transformers 5.17 ``modeling_<family>.py`` under
torch 2.x on CUDA, with its shape in the detail. Symbols: T tokens this rank holds outside attention
(micro_batch · seq / sp), S the full sequence inside attention, h hidden, q = heads·head_dim, kv =
kv_heads·head_dim, I the MLP width, nh heads, b bytes of the training dtype (2 for bf16/fp16, 4 for fp32).
Under Ulysses each rank holds S tokens and nh/sp heads inside attention, so q/k/v/out bytes equal T·q·b.
The saved tensors were enumerated with torch.autograd.graph.saved_tensors_hooks (tools/saved_tensors.py);
attention kernels are CUDA's: flash saves q, k, v, out and a fp32 logsumexp [nh, S] (FlashAttention-2,
Dao 2023); eager keeps the nh·S² score matrices. Gemma 2/3, Phi-3, Qwen3-MoE, OLMo 2 and DeepSeek-V3 are
listed in activations_families.py (their layers differ: pass ``layer``; ``kernel="cpu"`` gives what torch's
CPU kernels save where they differ from CUDA's, for the CPU tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..specs import ModelSpec
from . import activations_families as families

#: bytes per element of a CUDA LayerNorm's saved mean and rstd (fp32 accumulate type; aten layer_norm_cuda)
LN_STATS_BYTES = 8
#: bytes per element of a CUDA dropout mask (bool; aten native_dropout_cuda)
DROPOUT_MASK_BYTES = 1
#: bytes per token of a RMSNorm's saved rsqrt (fp32 [T, 1]; LlamaRMSNorm.forward)
RMS_RSQRT_BYTES = 4


@dataclass(frozen=True, slots=True)
class Term:
    """One saved tensor (or group of equal tensors): bytes per token and the tensor it models.

    ``fixed_bytes``: a tensor whose size does not grow with the tokens (a per-layer fp32 copy of a weight,
    Gemma's (1 + w), the experts' offsets); its bytes_per_token is 0."""

    name: str
    bytes_per_token: int
    detail: str
    fixed_bytes: int = 0


def _rmsnorm(b: int, width: int, name: str, rows: int = 1) -> list[Term]:
    """LlamaRMSNorm: pow saves the fp32 upcast, mul saves rsqrt, weight·x saves the cast-back x.

    ``rows`` is how many normalised vectors a token has (Qwen3's q_norm / k_norm: one per head)."""
    terms = [Term(f"{name}.fp32_input", 4 * width, f"[T, {width}] fp32 (hidden.to(float32))"),
             Term(f"{name}.rsqrt", RMS_RSQRT_BYTES * rows, f"[T, {rows}] fp32")]
    if b != 4:  # in fp32 training .to(input_dtype) is the same tensor
        terms.append(Term(f"{name}.normed", b * width, f"[T, {width}] (x.to(input_dtype), saved by weight·x)"))
    return terms


def _layernorm(b: int, width: int, name: str, input_shared: bool = False) -> list[Term]:
    """nn.LayerNorm on CUDA: saves its input, and fp32 mean and rstd per row."""
    terms = [] if input_shared else [Term(f"{name}.input", b * width, f"[T, {width}]")]
    return terms + [Term(f"{name}.stats", LN_STATS_BYTES, "mean, rstd [T] fp32")]


def sdpa_backend(m: ModelSpec, b: int, attention: str) -> str:
    """The attention path of these term lists: "eager" (transformers' eager path, and BLOOM's baddbmm
    attention), "masked" (a fused kernel given the sliding-window mask: use_gqa_in_sdpa is off, so k and v
    are repeat_kv'd), else the CUDA kernel of the one dispatch rule (blocks_attention.dispatch: "cudnn",
    "flash", "efficient" or "math"; cuDNN and flash save the same q, k, v, out and logsumexp)."""
    if attention == "eager" or m.family == "bloom":
        return "eager"
    kernel, masked = sdpa_dispatch(m, b, attention)
    return "masked" if masked and kernel != "math" else kernel


def sdpa_dispatch(m: ModelSpec, b: int, attention: str, seq: int | None = None, mask_dropped: bool = False
                  ) -> tuple[str, bool]:
    """(the CUDA kernel blocks_attention.dispatch picks for the model's attention call, whether a sliding
    window's mask is passed to it). ``seq``: the attention's sequence; a window no shorter than it builds no
    mask (masking_utils._ignore_causal_mask_sdpa); None: assume the mask. ``mask_dropped``: the interface gets
    none whatever the model built (Ulysses' uattn_wrapper, estimator/ulysses.py)."""
    from .blocks_attention import dispatch, model_geometry

    masked = (not mask_dropped and m.sliding_window is not None
              and (seq is None or seq >= m.sliding_window))
    g = model_geometry(m, 1, 2, b)  # the kernel does not depend on B, S > 1
    return dispatch("cuda", attention, None, g, masked, m.attention_dropout)[0], masked


def _attention_core(m: ModelSpec, b: int, attention: str, seq: int, qkv_fused: bool) -> list[Term]:
    """The attention kernel's saved tensors (per token of this rank) and the output projection's input."""
    q, kv, nh = m.q_dim, m.kv_dim, m.num_heads
    backend = sdpa_backend(m, b, attention)
    if backend == "math":  # _scaled_dot_product_attention_math: scaled q, repeated and scaled k, repeated v
        return [Term("attn.math_qkv", 5 * b * q, "q (RoPE), q·√scale, repeat(k)·√scale, repeat(k), repeat(v)"),
                Term("attn.math_probs", b * nh * seq, "softmax out [nh, S, S]"),
                Term("attn.out_proj_input", b * q, "attention output made contiguous [T, q]")]
    if backend == "masked":  # memory-efficient kernel with an explicit mask, repeat_kv'd k and v
        return [Term("attn.q", b * q, "q after RoPE [T, q]"), Term("attn.k_repeated", b * q, "repeat_kv(k) [T, q]"),
                Term("attn.v_repeated", b * q, "repeat_kv(v) [T, q]"), Term("attn.out", b * q, "[T, q]"),
                Term("attn.masked_copy", b * q, "one more [T, q] copy on the masked path (measured)"),
                Term("attn.logsumexp", 4 * nh, "[nh, S] fp32")]
    if attention == "eager":
        probs = [Term("attn.scores_softmax", (4 if m.family != "gpt2" else b) * nh * seq,
                      f"softmax out [nh, S, S] {'fp32' if m.family != 'gpt2' else 'dtype'} (per token: nh·S)")]
        if m.family != "gpt2":
            probs.append(Term("attn.probs", b * nh * seq, "softmax.to(dtype) [nh, S, S]"))
        if m.attention_dropout > 0:
            probs += [Term("attn.dropout_mask", DROPOUT_MASK_BYTES * nh * seq, "bool [nh, S, S]"),
                      Term("attn.probs_dropped", b * nh * seq, "dropout out [nh, S, S]")]
        if qkv_fused:
            qkv = [Term("attn.qkv_fused", b * (q + 2 * kv), "[T, q+2kv] fused projection (q, k, v are views)")]
        else:  # repeat_kv copies k and v to nh heads for the matmuls
            qkv = [Term("attn.q", b * q, "[T, q]"), Term("attn.k_repeated", b * q, "repeat_kv(k) [T, q]"),
                   Term("attn.v_repeated", b * q, "repeat_kv(v) [T, q]")]
        return qkv + probs + [Term("attn.out_proj_input", b * q, "attn_output.transpose().contiguous() [T, q]")]
    # flash / sdpa: torch's flash kernel saves q, k, v, out, logsumexp; out is already [T, nh, d]
    lse = Term("attn.logsumexp", 4 * nh, "[nh, S] fp32 (per token: nh)")
    out = Term("attn.out", b * q, "[T, q] (also the output projection's input)")
    if qkv_fused:
        return [Term("attn.qkv_fused", b * (q + 2 * kv), "[T, q+2kv] fused projection output"), out, lse]
    return [Term("attn.q", b * q, "q after RoPE [T, q]"), Term("attn.k", b * kv, "k after RoPE [T, kv]"),
            Term("attn.v", b * kv, "[T, kv]"), out, lse]


def _gated_mlp(m: ModelSpec, b: int) -> list[Term]:
    """LlamaMLP: down(act(gate(x)) * up(x)): gate out, act out, up out, product (down's input)."""
    if m.num_experts:
        return _moe_mlp(m, b)
    i = m.intermediate_size
    return [Term("mlp.input", b * m.hidden_size, "[T, h] normed x (gate/up input)"),
            Term("mlp.gate_up_act_prod", 4 * b * i, "gate, act(gate), up, product [T, I] each")]


def _moe_mlp(m: ModelSpec, b: int) -> list[Term]:
    """MixtralSparseMoeBlock with transformers' grouped_mm experts: k routed copies of each token."""
    h, i, k, e = m.hidden_size, m.intermediate_size, m.num_experts_per_tok, m.num_experts
    return [Term("moe.router_input", b * h, "[T, h]"),
            Term("moe.router_probs", 4 * e, "softmax [T, E] fp32"),
            Term("moe.routing_indices", 8 * 4 * k, "topk / perm / inverse-perm indices int64 [T·k]"),
            Term("moe.gathered_input", b * k * h, "hidden[perm] [T·k, h]"),
            Term("moe.gate_up", 2 * b * k * i, "grouped gate_up out [T·k, 2I]"),
            Term("moe.act_and_product", 2 * b * k * i, "act(gate), act·up [T·k, I] each"),
            Term("moe.expert_out", b * k * h + 4 * k, "down out [T·k, h], routing weights fp32")]


def _plain_mlp(m: ModelSpec, b: int, name_in: str = "mlp.input") -> list[Term]:
    """fc_in → activation → fc_out (GPT-2, GPT-NeoX, BLOOM)."""
    i = m.intermediate_size
    act = m.activation
    if act == "gelu_new":  # NewGELUActivation in Python: saves x, tanh(.), 0.5·x, 1+tanh(.)
        act_terms = [Term("mlp.gelu_new_intermediates", 4 * b * i, "x, tanh, 0.5x, 1+tanh [T, I] each")]
    else:  # a fused activation saves its input only
        act_terms = [Term("mlp.act_input", b * i, "[T, I]")]
    return ([Term(name_in, b * m.hidden_size, "[T, h] fc_in input")] + act_terms
            + [Term("mlp.fc_out_input", b * i, "[T, I]")])


def _dropout_masks(m: ModelSpec, count: int) -> list[Term]:
    """Residual dropouts keep a bool mask [T, h] each when p > 0."""
    if m.hidden_dropout <= 0:
        return []
    return [Term("dropout_masks", count * DROPOUT_MASK_BYTES * m.hidden_size, f"{count} × bool [T, h]")]


def layer_terms(m: ModelSpec, b: int, attention: str, seq: int, ulysses: bool = False, layer: int = 0,
                kernel: str = "cuda") -> tuple[Term, ...]:
    """Every tensor one transformer layer saves for backward, per token of this rank.

    ``ulysses``: DeepSpeed's UlyssesSPAttentionHF wraps the attention; the output all-to-all gives the output
    projection its own input [T, q], apart from the kernel's saved output. ``layer``: which layer (layers of
    Gemma, Qwen3-MoE and DeepSeek-V3 differ; the older families' are alike). ``kernel``: "cuda", or "cpu" for
    what torch's CPU attention kernels save (activations_families.py says where they differ)."""
    h = m.hidden_size
    if m.family in families.FAMILIES:
        terms = families.layer_terms(m, b, attention, seq, layer, kernel)
    elif m.family in ("gpt2",):
        terms = (_layernorm(b, h, "ln_1") + [Term("attn.proj_input", b * h, "ln_1 out [T, h]")]
                 + _attention_core(m, b, attention, seq, qkv_fused=True) + _layernorm(b, h, "ln_2")
                 + _plain_mlp(m, b) + _dropout_masks(m, 2))
    elif m.family == "gpt_neox":  # fused qkv; RoPE on a slice makes new q and k, v stays a view of qkv
        core = _attention_core(m, b, attention, seq, qkv_fused=False)
        if sdpa_backend(m, b, attention) == "eager":  # matmuls save q, k and the fused storage behind v
            core = [t for t in core if t.name not in ("attn.q", "attn.k_repeated", "attn.v_repeated")]
        else:  # the kernel keeps v as a view of the fused qkv; dense gets the output made contiguous
            core = [Term("attn.out_proj_input", b * h, "attn_output.reshape().contiguous() [T, h] (dense's input)")] + [
                t for t in core if t.name not in ("attn.q", "attn.k", "attn.v")]
        terms = (_layernorm(b, h, "input_layernorm") + [Term("attn.proj_input", b * h, "[T, h]")]
                 + [Term("attn.qkv_fused", b * 3 * h, "[T, 3h] (v is a view)"),
                    Term("attn.q", b * h, "rotary q [T, h]"), Term("attn.k", b * h, "rotary k [T, h]")]
                 + core + _layernorm(b, h, "post_attention_layernorm", input_shared=m.parallel_residual)
                 + _plain_mlp(m, b) + _dropout_masks(m, 2))
    elif m.family == "bloom":  # eager only (alibi); fused qkv; softmax in fp32 then cast
        terms = (_layernorm(b, h, "input_layernorm") + [Term("attn.proj_input", b * h, "[T, h]")]
                 + _attention_core(m, b, "eager", seq, qkv_fused=True)
                 + _layernorm(b, h, "post_attention_layernorm") + _plain_mlp(m, b) + _dropout_masks(m, 2))
    else:  # llama, mistral, qwen2, qwen3, mixtral
        terms = _rmsnorm(b, h, "input_layernorm") + [Term("attn.proj_input", b * h, "[T, h] (q/k/v input)")]
        if m.qk_norm:
            terms += _rmsnorm(b, m.q_dim, "q_norm", m.num_heads) + _rmsnorm(b, m.kv_dim, "k_norm", m.num_kv_heads)
        terms += _attention_core(m, b, attention, seq, qkv_fused=False)
        terms += _rmsnorm(b, h, "post_attention_layernorm") + _gated_mlp(m, b)
    if ulysses:
        terms = list(terms) + [Term("attn.ulysses_out_proj_input", b * m.q_dim, "all-to-all output [T, q]")]
    return tuple(terms)


#: what selective recomputation (Korthikanti et al. 2022, §4.2: recompute the attention core) drops:
#: the [nh, S, S] score, probability and dropout-mask tensors; flash attention keeps none of them anyway
SELECTIVE_RECOMPUTED = ("attn.scores_softmax", "attn.probs", "attn.dropout_mask", "attn.probs_dropped",
                        "attn.math_probs", "attn.softcap_tanh")


#: under tensor parallelism (Megatron-style / DeepSpeed AutoTP) these live sharded by heads or MLP columns;
#: the norms, the projections' inputs and the residual stream stay whole on every tp rank
TP_SHARDED_PREFIXES = ("attn.q", "attn.k", "attn.v", "attn.out", "attn.logsumexp", "attn.qkv_fused",
                       "attn.scores", "attn.probs", "attn.dropout", "attn.math", "attn.masked", "attn.ulysses",
                       "mlp.gate_up", "mlp.act", "mlp.gelu", "mlp.fc_out", "moe.gate_up", "moe.act",
                       "attn.softcap", "moe.shared_gate_up")


@lru_cache(maxsize=4096)
def layer_bytes_per_token(m: ModelSpec, b: int, attention: str, seq: int, ulysses: bool = False,
                          selective: bool = False, tp: int = 1, tp_sequence_parallel: bool = False,
                          layer: int | None = None, kernel: str = "cuda") -> int:
    """Sum of layer_terms: bytes one layer keeps per token of this rank (``selective``: without the
    attention core's score-sized tensors, recomputed in backward; ``tp``: sharded terms divided by tp;
    ``tp_sequence_parallel``: Megatron's sequence parallelism splits the rest over tp too, Korthikanti et
    al. 2022 §4.2.2 — modelled, not measured). ``layer`` None: where layers differ (Gemma's sliding and
    full layers, dense and MoE layers), their mean over all layers rounded up, so that layers × this is the
    model's total to within num_layers bytes per token; else that layer's."""
    if layer is None:
        if m.family in families.FAMILIES and families.layers_differ(m):
            per = [layer_bytes_per_token(m, b, attention, seq, ulysses, selective, tp, tp_sequence_parallel, i,
                                         kernel) for i in range(m.num_layers)]
            return -(-sum(per) // len(per))
        layer = 0
    total = 0
    for t in layer_terms(m, b, attention, seq, ulysses, layer, kernel):
        if selective and t.name in SELECTIVE_RECOMPUTED:
            continue
        split = tp > 1 and (tp_sequence_parallel or t.name.startswith(TP_SHARDED_PREFIXES))
        total += t.bytes_per_token // tp if split else t.bytes_per_token
    return total


def layer_fixed_bytes(m: ModelSpec, b: int, attention: str, seq: int, layer: int, kernel: str = "cuda") -> int:
    """Bytes layer ``layer`` keeps whatever the token count (Term.fixed_bytes: DeepSeek-V3's fp32 router
    weight copy E·h·4, Gemma's (1 + w) fp32 per norm, the experts' int32 offsets); 0 for the older families."""
    return sum(t.fixed_bytes for t in layer_terms(m, b, attention, seq, False, layer, kernel))


def layer_input_bytes_per_token(m: ModelSpec, b: int) -> int:
    """What a fully checkpointed layer keeps: its input hidden states [T, h]."""
    return b * m.hidden_size


@lru_cache(maxsize=4096)
def backward_transient_bytes_per_token(m: ModelSpec, b: int, attention: str, seq: int, tp: int = 1) -> int:
    """Largest set of gradient temporaries inside one layer's backward, per token.

    MLP: grad of down's input, then grads of act and up (3 tensors [T, I] at once, k-fold for MoE);
    attention (flash): dq, dk, dv, grad of out and the kernel's fp32 dq accumulator [T, q].
    """
    k = max(1, m.num_experts_per_tok) if m.num_experts else 1
    mlp = 3 * b * m.intermediate_size * k + 2 * b * m.hidden_size
    if m.family in families.FAMILIES:  # dense and expert widths differ (Qwen3-MoE, DeepSeek-V3)
        mlp = families.backward_mlp_transient(m, b)
    q, kv = m.q_dim, m.kv_dim
    attn = b * (2 * q + 2 * kv) + 4 * q + 2 * b * m.hidden_size
    if sdpa_backend(m, b, attention) in ("eager", "math"):
        attn += 2 * 4 * m.num_heads * seq  # grad of the scores and of the softmax input [nh, S, S]
    return max(mlp, attn) // tp
