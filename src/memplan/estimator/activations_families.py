"""Saved tensors per layer for Gemma 2 / 3, Phi-3, Qwen3-MoE, OLMo 2 and DeepSeek-V3 (transformers 5.17).

One Term per tensor autograd keeps for backward, per token of this rank, with its shape; enumerated on the CPU
with torch.autograd.graph.saved_tensors_hooks (tools/saved_tensors.py, tests/test_estimator_families.py).
Symbols as in activations.py, plus: d head_dim, E routed experts, k experts per token, I_e an expert's MLP
width, I_s the shared experts' width (n_shared_experts · I_e), r_q / r_kv MLA's q and kv latent widths,
d_qk = qk_nope + qk_rope and d_v MLA's per-head widths, W the sliding window.

Layers differ: a Gemma sliding layer gets a mask once S >= W (masking_utils._ignore_causal_mask_sdpa skips it
below), a DeepSeek-V3 layer before first_k_dense_replace (a Qwen3-MoE layer in mlp_only_layers) has a dense MLP.

Where CUDA's kernels differ from the CPU's (``kernel``):
- sdpa without a mask: CPU flash and CUDA FlashAttention-2 both save q, k, v, out and a fp32 logsumexp
  [nh, S] (Dao 2023); k and v keep their kv_heads (enable_gqa).
- sdpa with a mask (sliding layers, S >= W): transformers repeats k and v (repeat_kv, use_gqa_in_sdpa) and
  torch converts the bool mask into an additive bias of the query dtype [S, S] per sequence
  (attention.cpp convert_boolean_attn_mask), which the kernel saves, in every masked layer. Measured on the
  CPU; on CUDA the memory-efficient kernel saves its attn_bias the same way and pads its logsumexp to a
  multiple of 32 rows (not modelled: < 32·nh·4 bytes per sequence).
- MLA (d_v != d_qk): CUDA sdpa has no FlashAttention for unequal head widths; on the H200 (torch 2.11) it runs
  cuDNN attention for d_qk 192 / d_v 128 (benchmarks/attention/mla-sdpa-probe-h200.jsonl, tools/mla_sdpa_probe.py),
  which saves q, k, v, out and logsumexp, as flash and the memory-efficient kernel do; the CPU runs the math
  fallback in fp32 (q·√s, k·√s, softmax, v, all fp32) and the output projection gets its own copy.
- eager: the same aten ops on both.
- dropout: CUDA's native_dropout keeps a bool mask, the CPU's one in the input dtype.
"""

from __future__ import annotations

from ..modelspec import ModelSpec

FAMILIES = ("gemma2", "gemma3_text", "phi3", "qwen3_moe", "olmo2", "deepseek_v3")


def _term(name: str, bytes_per_token: int, detail: str, fixed_bytes: int = 0):
    from .activations import Term  # activations imports this module; Term lives there

    return Term(name, bytes_per_token, detail, fixed_bytes)


def rmsnorm(m: ModelSpec, b: int, width: int, name: str, rows: int = 1, weight: int | None = None) -> list:
    """The family's RMSNorm over ``width`` (``rows`` vectors per token, ``weight`` the norm's own width).

    Llama-style (Phi3/Qwen3Moe/DeepseekV3RMSNorm): fp32 input, rsqrt [T, rows], x.to(dtype) kept by weight·x.
    Gemma2/3RMSNorm: fp32 input, rsqrt, the fp32 normed x kept by x·(1 + w.float()), and that (1 + w) [w]
    fp32 per layer. Olmo2RMSNorm: (weight · x).to(dtype) keeps the fp32 normed x."""
    terms = [_term(f"{name}.fp32_input", 4 * width, f"[T, {width}] fp32 (hidden.float())"),
             _term(f"{name}.rsqrt", 4 * rows, f"[T, {rows}] fp32")]
    if m.family in ("gemma2", "gemma3_text"):
        w = weight or width
        return terms + [_term(f"{name}.fp32_normed", 4 * width, f"[T, {width}] fp32 (x·rsqrt, kept by ·(1+w))"),
                        _term(f"{name}.one_plus_weight", 0, f"[{w}] fp32 (1 + weight.float()), per layer", 4 * w)]
    if m.family == "olmo2":
        return terms + [_term(f"{name}.fp32_normed", 4 * width, f"[T, {width}] fp32 (x·rsqrt, kept by weight·x)")]
    if b != 4:  # in fp32 training .to(input_dtype) is the same tensor
        terms.append(_term(f"{name}.normed", b * width, f"[T, {width}] (x.to(input_dtype), saved by weight·x)"))
    return terms


def attention_kernel(m: ModelSpec, b: int, attention: str, seq: int, layer: int, kernel: str) -> str:
    """eager | flash (also CUDA's memory-efficient kernel without a mask: the same tensors) | masked |
    math (fp32 with grouped-query heads: no fused kernel takes it) | mla (CUDA) | mla_math (CPU)."""
    if attention == "eager":
        return "eager"
    if m.kv_lora_rank is not None:
        return "mla_math" if kernel == "cpu" else "mla"
    if m.is_sliding_layer(layer) and m.sliding_window is not None and seq >= m.sliding_window:
        return "masked"
    if b == 2 and m.head_dim <= 256 and m.head_dim % 8 == 0:
        return "flash"
    return "flash" if m.num_kv_heads == m.num_heads else "math"


def _copies_out(m: ModelSpec) -> bool:
    """Phi3's apply_rotary_pos_emb builds q and k with torch.cat: [B, nh, S, d]-contiguous, so the kernel's
    output is too, and attn_output.transpose(1, 2).contiguous() copies it for o_proj (measured)."""
    return m.family == "phi3"


def _attention(m: ModelSpec, b: int, attention: str, seq: int, layer: int, kernel: str) -> list:
    """The attention core of the non-MLA families: what the kernel saves and the output projection's input."""
    q, kv, nh = m.q_dim, m.kv_dim, m.num_heads
    repeated = m.num_kv_heads != m.num_heads
    # Phi-3 without repeat_kv: v stays a view of the fused qkv_proj output, whose storage is what is kept
    v_storage = b * (q + 2 * kv) if m.fused_qkv else b * kv
    v_detail = "[T, q+2kv] fused qkv_proj output (v is a view)" if m.fused_qkv else "[T, kv]"
    kind = attention_kernel(m, b, attention, seq, layer, kernel)
    proj = [_term("attn.out_proj_input", b * q, "attn_output.transpose(1, 2).contiguous() [T, q]")]
    if kind == "eager":
        terms = [_term("attn.q", b * q, "[T, q] (q·kᵀ)"),
                 _term("attn.k_repeated", b * q, "repeat_kv(k) [T, q]" if repeated else "k [T, kv]")]
        if m.attn_logit_softcapping is not None:
            terms.append(_term("attn.softcap_tanh", b * nh * seq, "tanh(scores / c) [nh, S, S] (per token: nh·S)"))
        terms += [_term("attn.scores_softmax", 4 * nh * seq, "softmax out [nh, S, S] fp32 (per token: nh·S)"),
                  _term("attn.probs", b * nh * seq, "softmax.to(dtype) [nh, S, S]")]
        if m.attention_dropout > 0:
            terms += [_term("attn.dropout_mask", nh * seq, "bool [nh, S, S]"),
                      _term("attn.probs_dropped", b * nh * seq, "dropout out [nh, S, S]")]
        v = _term("attn.v_repeated", b * q, "repeat_kv(v) [T, q]") if repeated else _term("attn.v", v_storage,
                                                                                             v_detail)
        return terms + [v] + proj
    if kind == "math":  # _scaled_dot_product_attention_math, as activations._attention_core
        return [_term("attn.math_qkv", 5 * b * q, "q (RoPE), q·√scale, repeat(k)·√scale, repeat(k), repeat(v)"),
                _term("attn.math_probs", b * nh * seq, "softmax out [nh, S, S]")] + proj
    lse = _term("attn.logsumexp", 4 * nh, "[nh, S] fp32 (per token: nh)")
    out = [_term("attn.out", b * q, "[T, q] (the output projection's input too)")]
    if _copies_out(m):
        out += proj
    if kind == "masked":
        kv_terms = ([_term("attn.k_repeated", b * q, "repeat_kv(k) [T, q]"),
                     _term("attn.v_repeated", b * q, "repeat_kv(v) [T, q]")] if repeated else
                    [_term("attn.k", b * kv, "k after RoPE [T, kv]"), _term("attn.v", v_storage, v_detail)])
        return ([_term("attn.q", b * q, "q after RoPE [T, q]")] + kv_terms + out + [lse]
                + [_term("attn.mask_bias", b * seq, f"bool mask → additive bias [S, S] in the dtype, this layer's "
                                                    f"(per token: S; sliding window {m.sliding_window} <= S)")])
    return [_term("attn.q", b * q, "q after RoPE [T, q]"), _term("attn.k", b * kv, "k after RoPE [T, kv]"),
            _term("attn.v", v_storage, v_detail)] + out + [lse]


def _mla(m: ModelSpec, b: int, attention: str, seq: int, layer: int, kernel: str) -> list:
    """DeepseekV3Attention: the latents' norms and up projections' inputs, then the kernel on [nh, d_qk] q and
    k (torch.cat / new_empty + copy_ in expand_kv) and v, a view of kv_b_proj's output [T, nh·(nope + d_v)]."""
    nh, dqk, dv, nope = m.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim, m.qk_nope_head_dim
    terms = []
    if m.q_lora_rank is not None:
        rq = m.q_lora_rank
        terms += rmsnorm(m, b, rq, "mla.q_a_layernorm") + [
            _term("mla.q_b_proj_input", b * rq, f"q_a_layernorm out [T, {rq}]")]
    rkv = m.kv_lora_rank
    terms += rmsnorm(m, b, rkv, "mla.kv_a_layernorm") + [
        _term("mla.kv_b_proj_input", b * rkv, f"kv_a_layernorm out [T, {rkv}]")]
    v_storage = _term("attn.v", b * nh * (nope + dv), "[T, nh·(nope+d_v)] kv_b_proj output (v is a view)")
    kind = attention_kernel(m, b, attention, seq, layer, kernel)
    if kind == "eager":
        return terms + [_term("attn.q", b * nh * dqk, "[T, nh·d_qk] (q·kᵀ)"),
                        _term("attn.k", b * nh * dqk, "[T, nh·d_qk] (expand_kv's keys)"),
                        _term("attn.scores_softmax", 4 * nh * seq, "softmax out [nh, S, S] fp32 (per token: nh·S)"),
                        _term("attn.probs", b * nh * seq, "softmax.to(dtype) [nh, S, S]"), v_storage,
                        _term("attn.out_proj_input", b * nh * dv, "[T, nh·d_v] contiguous")]
    if kind == "mla_math":  # CPU: math fallback in fp32
        return terms + [_term("attn.math_q", 4 * nh * dqk, "q·√scale [T, nh·d_qk] fp32"),
                        _term("attn.math_k", 4 * nh * dqk, "k·√scale [T, nh·d_qk] fp32"),
                        _term("attn.math_probs", 4 * nh * seq, "softmax out [nh, S, S] fp32"),
                        _term("attn.math_v", 4 * nh * dv, "v [T, nh·d_v] fp32"),
                        _term("attn.out_proj_input", b * nh * dv, "[T, nh·d_v] contiguous")]
    return terms + [_term("attn.q", b * nh * dqk, "[T, nh·d_qk]"), _term("attn.k", b * nh * dqk, "[T, nh·d_qk]"),
                    v_storage, _term("attn.out", b * nh * dv, "[T, nh·d_v] (the output projection's input too)"),
                    _term("attn.logsumexp", 4 * nh, "[nh, S] fp32 (per token: nh)")]


def _dense_mlp(m: ModelSpec, b: int, width: int, input_saved: bool = True) -> list:
    """gate/up/down (Gemma, OLMo 2, the MoE families' dense layers; Phi-3's fused gate_up_proj keeps its
    [T, 2I] output, which gate and up are views of: the same 4·b·I)."""
    saved = [_term("mlp.input", m.hidden_size * b, "[T, h] (gate/up input)")] if input_saved else []
    if m.fused_gate_up:
        return saved + [_term("mlp.gate_up_out", 2 * b * width, f"[T, 2·{width}] (act's input, up is a view)"),
                        _term("mlp.act_and_prod", 2 * b * width, f"act(gate), act·up [T, {width}] each")]
    return saved + [_term("mlp.gate_up_act_prod", 4 * b * width, f"gate, act(gate), up, product [T, {width}] each")]


def _router(m: ModelSpec, b: int) -> list:
    """Qwen3MoeTopKRouter (softmax) / DeepseekV3TopkRouter (sigmoid, fp32 logits, group-limited top-k)."""
    h, e, k = m.hidden_size, m.num_experts, m.num_experts_per_tok
    norm = ([_term("moe.topk_norm", 4 + 4 * k, "top-k sum [T, 1] and weights [T, k] fp32 (weights /= sum)")]
            if m.norm_topk_prob else [])
    if m.router_scoring == "softmax":
        return [_term("moe.router_input", b * h, "[T, h] (F.linear)"),
                _term("moe.router_probs", 4 * e, f"softmax(dtype=float32) [T, {e}]"),
                _term("moe.topk_indices", 8 * k, f"topk [T, {k}] int64")] + norm
    # the group-limited choice (per-group topk(2), topk of the groups, the -inf masked_fill, topk of the
    # masked scores) only yields integer indices: its nodes die with their discarded values during the
    # forward, and what they saved with them (measured), so only gather(sigmoid, indices) keeps a graph
    return [_term("moe.router_fp32_input", 4 * h, "hidden.type(float32) [T, h]"),
            _term("moe.router_fp32_weight", 0, f"weight.type(float32) [{e}, {h}], per layer", 4 * e * h),
            _term("moe.router_sigmoid", 4 * e, f"sigmoid(logits) [T, {e}] fp32 (gather's input)"),
            _term("moe.topk_indices", 8 * k, f"topk [T, {k}] int64 (gather's index)")] + norm


def _experts(m: ModelSpec, b: int) -> list:
    """integrations/moe.py grouped_mm_experts_forward: the k routed copies of each token, sorted by expert.

    Each expert's intermediates are over the tokens it received; their sum is T·k whatever the routing, so a
    random-init model (near-uniform routing) keeps the same bytes as a trained one (only the per-expert split,
    which no saved tensor depends on, changes)."""
    h, e, k, i = m.hidden_size, m.num_experts, m.num_experts_per_tok, m.expert_intermediate_size
    w = 4 if m.router_scoring == "sigmoid" else b  # DeepSeek's routing weights stay fp32; Qwen3's are cast
    return [_term("moe.sort_perm", 8 * k, "torch.sort perm [T·k] int64"),
            _term("moe.token_index", 8 * k, "perm // k [T·k] int64 (hidden[perm // k])"),
            _term("moe.sentinel_mask", k, "expert_ids >= E [T·k, 1] bool (masked_fill)"),
            _term("moe.offsets", 0, f"cumsum of tokens per expert [{e}] int32, per layer", 4 * e),
            _term("moe.gathered_input", b * k * h, "hidden[perm // k] [T·k, h] (gate_up grouped_mm input)"),
            _term("moe.gate_up", 2 * b * k * i, f"grouped gate_up out [T·k, 2·{i}] (act's input, up a view)"),
            _term("moe.act_and_product", 2 * b * k * i, f"act(gate), act·up [T·k, {i}] each"),
            _term("moe.routing_weights", w * k, f"sample_weights[perm] [T·k, 1] {'fp32' if w == 4 else 'dtype'}"),
            _term("moe.expert_out", b * k * h, "down out [T·k, h] (kept by · routing weight)"),
            _term("moe.inverse_perm", 8 * k, "inv_perm [T·k] int64 (restores token order)")]


def _mlp(m: ModelSpec, b: int, layer: int) -> list:
    if not m.is_moe_layer(layer):
        return _dense_mlp(m, b, m.intermediate_size)
    terms = _router(m, b) + _experts(m, b)
    if m.family == "deepseek_v3":  # DeepseekV3MoE: shared_experts(residuals) keeps the norm output itself
        width = m.n_shared_experts * m.expert_intermediate_size
        terms += [_term("moe.shared_input", b * m.hidden_size, "[T, h] (shared_experts' gate/up input)"),
                  _term("moe.shared_gate_up_act_prod", 4 * b * width, f"gate, act, up, product [T, {width}]")]
    return terms


def layer_terms(m: ModelSpec, b: int, attention: str, seq: int, layer: int, kernel: str) -> list:
    """Every tensor layer ``layer`` keeps for backward, per token (fixed_bytes: per layer, not per token)."""
    h = m.hidden_size
    if m.norm_placement == "post":  # OLMo 2: q/k/v read the residual stream; norms on the outputs
        terms = [_term("attn.proj_input", b * h, "[T, h] layer input (q/k/v input)")]
    else:
        terms = rmsnorm(m, b, h, "input_layernorm") + [_term("attn.proj_input", b * h, "[T, h] (q/k/v input)")]
    if m.kv_lora_rank is not None:
        terms += _mla(m, b, attention, seq, layer, kernel)
    else:
        if m.qk_norm and m.qk_norm_per_head:
            d = m.head_dim
            terms += (rmsnorm(m, b, m.q_dim, "q_norm", m.num_heads, d)
                      + rmsnorm(m, b, m.kv_dim, "k_norm", m.num_kv_heads, d))
        elif m.qk_norm:
            terms += rmsnorm(m, b, m.q_dim, "q_norm") + rmsnorm(m, b, m.kv_dim, "k_norm")
        terms += _attention(m, b, attention, seq, layer, kernel)
    if m.norm_placement == "sandwich":
        terms += rmsnorm(m, b, h, "post_attention_layernorm") + rmsnorm(m, b, h, "pre_feedforward_layernorm")
        terms += _mlp(m, b, layer) + rmsnorm(m, b, h, "post_feedforward_layernorm")
    elif m.norm_placement == "post":
        terms += rmsnorm(m, b, h, "post_attention_layernorm") + _mlp(m, b, layer)
        terms += rmsnorm(m, b, h, "post_feedforward_layernorm")
    else:
        terms += rmsnorm(m, b, h, "post_attention_layernorm") + _mlp(m, b, layer)
    if m.hidden_dropout > 0:  # Phi3DecoderLayer.resid_attn_dropout / resid_mlp_dropout
        # native_dropout keeps a bool mask on CUDA (native_dropout_cuda), one in the input's dtype on the CPU
        mask = b if kernel == "cpu" else 1
        terms.append(_term("dropout_masks", 2 * mask * h, f"2 × [T, h] {'dtype' if mask == b else 'bool'}"))
    return terms


def layers_differ(m: ModelSpec) -> bool:
    """Whether some layers keep other tensors than layer 0 (sliding / full, dense / MoE)."""
    kinds = {(m.is_sliding_layer(i), m.is_moe_layer(i)) for i in range(m.num_layers)}
    return len(kinds) > 1


def backward_mlp_transient(m: ModelSpec, b: int) -> int:
    """Largest MLP gradient set in one layer's backward, per token: three [T, width] grads and two [T, h]
    (dense), or the routed k copies of an expert's three [T·k, I_e] grads (plus the shared experts)."""
    widths = []
    if any(not m.is_moe_layer(i) for i in range(m.num_layers)):
        widths.append(m.intermediate_size)
    if any(m.is_moe_layer(i) for i in range(m.num_layers)):
        widths.append(m.num_experts_per_tok * m.expert_intermediate_size
                      + m.n_shared_experts * m.expert_intermediate_size)
    return 3 * b * max(widths) + 2 * b * m.hidden_size
