"""The kernels torch's F.scaled_dot_product_attention dispatches to, in the autograd model (conventions as in
blocks.py; geometry, layouts and the dispatch rule in blocks_attention.py): ``flash_attention`` (CUDA
FlashAttention-2, aten ``_scaled_dot_product_flash_attention``), ``efficient_attention`` (CUDA
``_scaled_dot_product_efficient_attention``, the CUTLASS kernels of mem_eff_attention), ``math_attention``
(``_scaled_dot_product_attention_math``, composite: the same ops on every device) and
``cpu_flash_attention`` (``_scaled_dot_product_flash_attention_for_cpu``, what the CPU trace comparison runs).
Each returns (output, whether its memory is [B, S, nh, d]). Allocations a kernel frees before returning are
named ``*.tmp``.
"""

from __future__ import annotations

from . import blocks as B
from . import blocks_linear as BL
from .autograd import Tensor, _Ctx
from .blocks import FP32
from .blocks_attention import (
    EFFICIENT_LSE_ALIGN,
    EFFICIENT_MASK_ALIGN,
    FLASH_HEAD_ALIGN,
    FLASH_HEAD_ROUND,
    FLASH_SEQ_ROUND,
    Geometry,
    _folds_copy,
    repeat_kv,
)
from .timing import (
    ATTENTION_BACKWARD_RATIO,
    ATTENTION_CUDNN,
    ATTENTION_EFFICIENT,
    ATTENTION_FLASH,
    attention_flops,
)


def _fused(g: Geometry, kernel: int) -> dict:
    """A fused attention kernel's time (timing.py): causal softmax(q·kᵀ)·v over the call's geometry."""
    return {"flops": attention_flops(g.batch, g.heads, g.seq, g.seq, g.head_dim, g.dv), "kernel": kernel,
            "backward_ratio": ATTENTION_BACKWARD_RATIO[kernel]}


def _lse_name(ag, name: str) -> str:
    """The logsumexp's name: under a checkpointed forward nothing saves it, so it dies inside the sdpa call
    (a kernel temporary, ``.tmp``)."""
    return f"{name}.logsumexp" + ("" if ag.saving else ".tmp")


def flash_attention(net, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, g: Geometry, *, dropout: float,
                    name: str, bshd: tuple[bool, bool, bool] = (True, True, True)) -> tuple[Tensor, bool]:
    """torch's sdpa FLASH_ATTENTION on CUDA (aten _scaled_dot_product_flash_attention → FlashAttention-2's
    mha_fwd / mha_bwd, Dao 2023). head_dim not a multiple of 8: q, k, v are padded first (attention.cpp
    pad_last_dim<8>: constant_pad_nd copies [B, h, S, d₈], saved instead of the originals;
    ConstantPadNdBackward0 narrows the grad back, a copy) and the output sliced back (post_process_flash_output:
    SliceBackward0 allocates the padded grad). Forward: out = empty_like(q) (q's memory layout) and the fp32
    logsumexp [B, nh, S]; saves q, k, v, out, logsumexp (released: key, query, value, logsumexp, output).
    Backward (mha_bwd): grad_out and out made contiguous when their memory is not [B, S, nh, d] (temporaries),
    dq, dk, dv (empty_like), with grouped-query attention dk_expanded / dv_expanded [B, S, nh, d] summed into
    dk, dv, and the fp32 softmax_d [B, nh, S₁₂₈] and dq_accum [B, S₁₂₈, nh, d₃₂]; temporaries freed inside."""
    ag = net.ag
    d = -(-g.head_dim // FLASH_HEAD_ALIGN) * FLASH_HEAD_ALIGN
    padded = d != g.head_dim
    q_bshd = bshd[0]
    if padded:  # constant_pad_nd: contiguous [B, h, S, d8] copies
        q, k, v = (ag.op(f"{name}.{w}_padded", g.bytes(h, d), (t,), (),
                         lambda ctx, grad, node, t=t, w=w: (ctx.new(f"grad.{name}.{w}_unpadded", t.nbytes),))
                   for w, t, h in (("q", q, g.heads), ("k", k, g.kv_heads), ("v", v, g.kv_heads)))
        q_bshd = False
    else:
        q, k, v = ag.ref(q), ag.ref(k), ag.ref(v)
    s128 = -(-g.seq // FLASH_SEQ_ROUND) * FLASH_SEQ_ROUND
    d32 = -(-d // FLASH_HEAD_ROUND) * FLASH_HEAD_ROUND
    out_bytes = g.bytes(head_dim=d)
    contiguous_out = q_bshd  # out follows q's memory; mha_bwd needs it (and grad_out) as [B, S, nh, d]

    def backward(ctx: _Ctx, grad: Tensor, node):
        tmp = [] if contiguous_out else [ctx.new(f"{name}.grad_out_contiguous.tmp", out_bytes),
                                         ctx.new(f"{name}.out_contiguous.tmp", out_bytes)]
        dq = ctx.new(f"grad.{name}.q", q.nbytes)
        dk = ctx.new(f"grad.{name}.k", k.nbytes)
        dv = ctx.new(f"grad.{name}.v", v.nbytes)
        if g.kv_heads != g.heads:
            tmp += [ctx.new(f"{name}.dk_expanded.tmp", g.bytes(head_dim=d)),
                    ctx.new(f"{name}.dv_expanded.tmp", g.bytes(head_dim=d))]
        tmp += [ctx.new(f"{name}.softmax_d.tmp", FP32 * g.batch * g.heads * s128),
                ctx.new(f"{name}.dq_accum.tmp", FP32 * g.batch * s128 * g.heads * d32)]
        for t in tmp:
            ctx.free(t)
        return (dq, dk, dv)

    out = ag.op(f"{name}.out", out_bytes, (q, k, v), (k, q, v), backward, **_fused(g, ATTENTION_FLASH))
    lse = ag.empty(_lse_name(ag, name), FP32 * g.batch * g.heads * g.seq)
    ag.keep(out, lse)
    ag.keep(out, out)
    ag.release(lse)
    for t in (q, k, v):
        ag.release(t)
    if padded:  # out.slice(-1, 0, d): SliceBackward0 (slice_backward) allocates zeros of the padded size
        sliced = B.slice_view(ag, out, g.bytes(), f"{name}.out_sliced")
        ag.release(out)
        return sliced, False
    return out, q_bshd


def cpu_flash_attention(net, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, g: Geometry, *,
                        dropout: float, name: str, bshd: tuple[bool, bool, bool] = (True, True, True)) -> tuple[Tensor, bool]:
    """aten _scaled_dot_product_flash_attention_for_cpu (attention.cpp), what sdpa runs on the CPU (``mask``:
    the converted float mask or None): out = empty_like(q) (q's memory layout),
    logsumexp in fp32 [B, S, nh]; saves attn_mask, key, query, value, output, logsumexp (released in that
    sorted-name order, results last). Backward (_backward): zeros grad_q, grad_k, grad_v of q, k, v's sizes
    (grouped-query k, v keep their own heads)."""
    ag = net.ag

    def backward(ctx: _Ctx, grad: Tensor, node):
        return (ctx.new(f"grad.{name}.q", q.nbytes), ctx.new(f"grad.{name}.k", k.nbytes),
                ctx.new(f"grad.{name}.v", v.nbytes))

    saved = (mask, k, q, v) if mask is not None else (k, q, v)
    out = ag.op(f"{name}.out", g.bytes(), (q, k, v), saved, backward)
    lse = ag.empty(_lse_name(ag, name), FP32 * g.batch * g.heads * g.seq)
    ag.keep(out, lse)
    ag.keep(out, out)
    ag.release(lse)
    return out, bshd[0]


def efficient_attention(net, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, g: Geometry, *,
                        dropout: float, name: str, bshd: tuple[bool, bool, bool] = (True, True, True)) -> tuple[Tensor, bool]:
    """torch's sdpa EFFICIENT_ATTENTION on CUDA (aten _scaled_dot_product_efficient_attention →
    _efficient_attention_forward, xFormers' CUTLASS kernels; Rabe & Staats 2021). The converted mask is
    expanded to [B, nh, S, S] (preprocess_mask); with S not a multiple of 16 it is padded
    (pad_bias<16>: a [B, nh, S, S₁₆] copy, saved). Forward: out [B, S, nh, d] and the fp32 logsumexp
    [B, nh, S₃₂] (S padded to 32); the philox seed/offset are CPU scalars. Saves attn_bias, key, query, value,
    output, log_sumexp. Backward (_efficient_attention_backward): grad_q, grad_k, grad_v [B, S, h, d], the fp32
    delta [B, nh, S] (16-bit; for fp32 (grad_out·out).sum(-1) through two temporaries), and the kernel's
    fp32 workspace (``efficient_workspace_bytes``); temporaries freed inside."""
    ag = net.ag
    bias = ag.ref(mask) if mask is not None else None
    if bias is not None and g.seq % EFFICIENT_MASK_ALIGN:
        s16 = -(-g.seq // EFFICIENT_MASK_ALIGN) * EFFICIENT_MASK_ALIGN
        padded = ag.empty(f"{name}.mask_padded", g.b * g.batch * g.heads * g.seq * s16)
        ag.release(bias)
        bias = padded
    s32 = -(-g.seq // EFFICIENT_LSE_ALIGN) * EFFICIENT_LSE_ALIGN
    out_bytes = g.bytes()

    def backward(ctx: _Ctx, grad: Tensor, node):
        dq = ctx.new(f"grad.{name}.q", q.nbytes)
        dk = ctx.new(f"grad.{name}.k", k.nbytes)
        dv = ctx.new(f"grad.{name}.v", v.nbytes)
        rows = FP32 * g.batch * g.heads * g.seq
        if g.b == 2:  # Kernel::kKernelComputesDelta
            tmp = [ctx.new(f"{name}.delta.tmp", rows)]
        else:  # (grad_out.float() * out.float()).sum(-1).transpose(-2, -1).contiguous()
            prod = ctx.new(f"{name}.delta_product.tmp", out_bytes)
            summed = ctx.new(f"{name}.delta_sum.tmp", rows)
            ctx.free(prod)
            tmp = [ctx.new(f"{name}.delta.tmp", rows)]
            ctx.free(summed)
        work = efficient_workspace_bytes(g, dropout)
        if work:
            tmp.append(ctx.new(f"{name}.workspace.tmp", work))
        for t in tmp:
            ctx.free(t)
        return (dq, dk, dv)

    saved = (bias, k, q, v) if bias is not None else (k, q, v)
    out = ag.op(f"{name}.out", out_bytes, (q, k, v), saved, backward, **_fused(g, ATTENTION_EFFICIENT))
    lse = ag.empty(_lse_name(ag, name), FP32 * g.batch * g.heads * s32)
    ag.keep(out, lse)
    ag.keep(out, out)
    ag.release(lse)
    if bias is not None:
        ag.release(bias)
    return out, True


#: the cuDNN 9.19 SDPA graphs' workspaces on the H200 (mha_graph->get_workspace_size(), decided by cuDNN's
#: execution plan, not by torch): the forward's is 256 bytes whatever the shape; the backward's is an fp32
#: [B, nh, S, w] buffer, one fp32 [B, nh, S] row and 256 bytes, w the widest head (q/k or v) — doubled for
#: grouped-query attention without a mask (the causal graph). Read off the committed H200 and H100 traces (48
#: jobs, tools: benchmarks/accuracy/README.md, session 18): w = d for every multi-head job (Llama-2, OLMo 2,
#: BLOOM, Pythia at d 256, Phi-3-mini at d 96, DeepSeek's MLA at q/k width 192) and every masked one (Mistral's
#: and Phi-3-medium's sliding window, Gemma 2), w = 2·d for every unmasked grouped-query one (Llama-3.2-1B and
#: Qwen2.5-0.5B at d 64; Qwen3, Qwen2.5-72B, Mixtral, Llama-2-70B, Llama-3 8B and 405B, Mistral under Ulysses at
#: d 128), whatever the dtype and the sequence
CUDNN_FWD_WORKSPACE_BYTES = CUDNN_BWD_WORKSPACE_EXTRA_BYTES = 256


def cudnn_bwd_workspace_bytes(g: Geometry, masked: bool) -> int:
    """The backward cuDNN graph's workspace (see CUDNN_FWD_WORKSPACE_BYTES)."""
    rows = FP32 * g.batch * g.heads * g.seq
    width = max(g.head_dim, g.dv) * (2 if g.heads != g.kv_heads and not masked else 1)
    return rows * width + rows + CUDNN_BWD_WORKSPACE_EXTRA_BYTES


def cudnn_attention(net, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, g: Geometry, *, dropout: float,
                    name: str, bshd: tuple[bool, bool, bool] = (True, True, True)) -> tuple[Tensor, bool]:
    """torch's sdpa CUDNN_ATTENTION (aten _scaled_dot_product_cudnn_attention → _cudnn_attention_forward →
    cudnn/MHA.cpp run_cudnn_SDP_fprop; backward _cudnn_attention_backward → run_cudnn_SDP_bprop). Forward: the
    philox seed and offset (at::zeros({1}, kLong): 8 bytes each, outputs autograd saves), o in q's memory
    layout (alloc_with_matching_layout), the fp32 softmax stats [B, nh, S] (logsumexp), then the graph's
    workspace, freed on return; saves attn_bias (the converted mask), key, query, value, output, logsumexp,
    philox seed and offset. Backward: a temporary of the output's size, dq, dk, dv in their inputs' layouts
    (grouped-query k, v keep their heads), the graph's workspace (``cudnn_bwd_workspace_bytes``); the
    temporaries are freed inside, in the order the H200 traces show."""
    ag = net.ag
    suffix = "" if ag.saving else ".tmp"

    def backward(ctx: _Ctx, grad: Tensor, node):
        tmp = ctx.new(f"{name}.grad_out_copy.tmp", g.v_bytes())
        grads = (ctx.new(f"grad.{name}.q", q.nbytes), ctx.new(f"grad.{name}.k", k.nbytes),
                 ctx.new(f"grad.{name}.v", v.nbytes))
        work = ctx.new(f"{name}.workspace.tmp", cudnn_bwd_workspace_bytes(g, mask is not None))
        ctx.free(work)
        ctx.free(tmp)
        return grads

    seed = ag.empty(f"{name}.philox_seed{suffix}", 8)
    offset = ag.empty(f"{name}.philox_offset{suffix}", 8)
    saved = (mask, k, q, v) if mask is not None else (k, q, v)
    out = ag.op(f"{name}.out", g.v_bytes(), (q, k, v), saved, backward, **_fused(g, ATTENTION_CUDNN))
    lse = ag.empty(_lse_name(ag, name), FP32 * g.batch * g.heads * g.seq)
    ag.release(ag.empty(f"{name}.workspace.tmp", CUDNN_FWD_WORKSPACE_BYTES))
    for t in (out, lse, seed, offset):
        ag.keep(out, t)
    for t in (lse, seed, offset):
        ag.release(t)
    return out, bshd[0]


#: CUTLASS backward kernels of mem_eff_attention (kernels/cutlassB.h dispatch_cutlassB_{bf16,f16,f32}_sm80,
#: tried in order; sm90 runs the sm80 ones): (kBlockSizeI, kBlockSizeJ, kMaxK), first with kMaxK >= head_dim
_CUTLASS_B_16BIT = ((64, 64, 32), (64, 64, 64), (128, 128, 128), (64, 64, 65536))
_CUTLASS_B_16BIT_DROPOUT = ((64, 64, 32), (64, 64, 64), (128, 128, 128), (64, 64, 65536))
_CUTLASS_B_F32 = ((64, 64, 32), (64, 64, 64), (128, 64, 128), (64, 64, 65536))


def efficient_workspace_bytes(g: Geometry, dropout: float) -> int:
    """The memory-efficient backward's fp32 workspace (kernel_backward.h Params::workspace_size):
    B·nh·align4(gq + gk + gv) floats per the kernel dispatch_cutlassB picks (the first whose kMaxK >= d);
    gq (kNeedsAccumGradQ: always for 16-bit, with split keys for fp32) = ⌈S/I⌉·⌈d/J⌉ tiles of I·J floats
    plus a 16-byte lock each (GradQTempStorage); gk and gv (kNeedsAccumGradK/V: 16-bit kernels whose output
    does not stay in registers, kMaxK > I) = num_splits_key·J·align(d, I) each, num_splits_key = ⌈S/J⌉."""
    table = _CUTLASS_B_F32 if g.b == FP32 else _CUTLASS_B_16BIT_DROPOUT if dropout > 0 else _CUTLASS_B_16BIT
    bi, bj, kmax = next(kern for kern in table if kern[2] >= g.head_dim)
    gq = -(-g.seq // bi) * -(-g.head_dim // bj) * (bi * bj + 4)
    gkv = 0
    if g.b != FP32 and kmax > bi:  # !kOutputInRF
        gkv = 2 * -(-g.seq // bj) * bj * (-(-g.head_dim // bi) * bi)
    return FP32 * g.batch * g.heads * (-(-(gq + gkv) // 4) * 4)


def math_attention(net, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, g: Geometry, *, dropout: float,
                   name: str, bshd: tuple[bool, bool, bool] = (True, True, True)) -> tuple[Tensor, bool]:
    """aten _scaled_dot_product_attention_math (attention.cpp; composite, the same ops on every device):
    q, k, v cast to fp32 (16-bit inputs; .to keeps their memory layout), q·√scale; without a mask a causal
    one from ones [S, S] bool → tril → convert_boolean_attn_mask (fp32 0 / -inf); with enable_gqa k and v
    repeat_interleave'd to the query heads (copies); q @ (k^T·√scale) [B·nh, S, S] fp32 (torch.matmul copies
    an operand whose memory is [B, S, h, d]), the mask added in place (a 16-bit mask cast to fp32 for it, a
    temporary), _safe_softmax, dropout (attn rebound), @ v, .to(dtype)
    of the probabilities and then of the output (make_tuple's arguments, right to left); the C++ locals die
    last declared first, the unused probabilities as sdpa returns. Returns a contiguous [B, nh, S, d] output."""
    ag = net.ag
    n_rep = g.heads // g.kv_heads
    q32 = B.to_dtype(ag, q, g.bytes(b=FP32), f"{name}.q_fp32")
    k32 = B.to_dtype(ag, k, g.bytes(g.kv_heads, b=FP32), f"{name}.k_fp32")
    v32 = B.to_dtype(ag, v, g.v_bytes(g.kv_heads, b=FP32), f"{name}.v_fp32")
    qs = B.scale(ag, q32, f"{name}.q_scaled")
    if mask is None:  # is_causal: at::ones({L, S}, bool).tril(), then convert_boolean_attn_mask
        ones = ag.empty(f"{name}.causal_ones", g.seq * g.seq)
        tril = ag.empty(f"{name}.causal_tril", g.seq * g.seq)
        ag.release(ones)
        fmask = ag.empty(f"{name}.causal_mask", FP32 * g.seq * g.seq)
        ag.release(tril)
    else:
        fmask = ag.ref(mask)
    kr = repeat_kv(ag, k32, n_rep, f"{name}.k_repeated")  # repeat_interleave: unsqueeze, expand, clone
    vr = repeat_kv(ag, v32, n_rep, f"{name}.v_repeated")
    ks = B.scale(ag, kr, f"{name}.k_scaled")
    scores = BL.matmul(ag, qs, ks, g.scores(FP32), f"{name}.scores", copy_a=_folds_copy(bshd[0], g),
                      copy_c=_folds_copy(n_rep == 1 and bshd[1], g), batch=g.batch * g.heads, elem_bytes=FP32)
    ag.release(ks)
    if mask is not None and g.b != FP32:  # attn.add_(mask): the 16-bit mask cast to fp32 for the add
        ag.release(ag.empty(f"{name}.mask_fp32", FP32 * mask.nbytes // g.b))
    probs = B.safe_softmax(ag, scores, f"{name}.softmax", g.batch * g.heads * g.seq, net.device)
    ag.release(scores)
    dropped = B.dropout(ag, probs, dropout, FP32, f"{name}.dropout", net.device)
    ag.release(probs)  # attn rebound to the dropout's output
    probs_out = B.to_dtype(ag, dropped, g.scores(), f"{name}.probs_out")
    # the output goes through transpose(1, 2).contiguous(): its reshape's backward sees a transposed grad
    o32 = BL.matmul(ag, dropped, vr, g.v_bytes(b=FP32), f"{name}.out_fp32",
                   copy_c=_folds_copy(n_rep == 1 and bshd[2], g), grad_copy=_folds_copy(True, g),
                   batch=g.batch * g.heads, elem_bytes=FP32)
    out = B.to_dtype(ag, o32, g.v_bytes(), f"{name}.out")
    ag.release(o32)
    for t in (dropped, vr, kr, qs, fmask, v32, k32, q32, probs_out):
        ag.release(t)
    return out, False
