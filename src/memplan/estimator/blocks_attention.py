"""Attention in the autograd model: transformers' attention interfaces and the kernels torch's
scaled_dot_product_attention dispatches to (estimator/autograd.py; conventions as in blocks.py).

``eager_attention`` is transformers' ``eager_attention_forward`` (modeling_llama.py and its copies), a pure
composition of aten ops. ``sdpa_attention`` is ``integrations/sdpa_attention.py sdpa_attention_forward``:
repeat_kv unless ``use_gqa_in_sdpa``, ``F.scaled_dot_product_attention``, ``transpose(1, 2).contiguous()``.
The kernel is picked by ``sdpa_kernel`` after torch's sdp dispatch (aten/src/ATen/native/transformers/
cuda/sdp_utils.cpp ``select_sdp_backend``; sdp_utils_cpp.cpp ``select_sdp_backend_cpp`` on the CPU) and
modelled by ``flash_attention`` (CUDA FlashAttention-2, aten ``_scaled_dot_product_flash_attention``),
``efficient_attention`` (CUDA ``_scaled_dot_product_efficient_attention``, the CUTLASS kernels of
mem_eff_attention), ``math_attention`` (``_scaled_dot_product_attention_math``, composite: the same on every
device) and ``cpu_flash_attention`` (``_scaled_dot_product_flash_attention_for_cpu``, what the CPU trace
comparison runs). Allocations inside a kernel that it frees before returning are named ``*.tmp``.

Layouts: a [B, nh, S, d] tensor is either "bshd" (its memory is [B, S, nh, d], as a projection viewed and
transposed, and what RoPE's elementwise ops keep) or "bhsd" (contiguous); the layout decides where a
reshape or ``.contiguous()`` copies, in forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import blocks as B
from .autograd import Autograd, Tensor, _Ctx
from .blocks import FP32

#: FlashAttention-2 takes head_dim in multiples of 8: sdpa pads q, k, v (attention.cpp pad_last_dim<8>)
FLASH_HEAD_ALIGN = 8
#: FlashAttention-2's backward rounds the sequence to 128 and head_dim to 32 for softmax_d / dq_accum
FLASH_SEQ_ROUND, FLASH_HEAD_ROUND = 128, 32
#: largest head_dim flash takes (sdp_utils.cpp check_head_dim_size_flash)
FLASH_MAX_HEAD_DIM = 256
#: the memory-efficient kernel's logsumexp rows are padded to this (attention.cu kAlignLSE)
EFFICIENT_LSE_ALIGN = 32
#: an attention mask's last dim is padded to this for the memory-efficient kernel (attention.cpp preprocess_mask)
EFFICIENT_MASK_ALIGN = 16


@dataclass(frozen=True, slots=True)
class Geometry:
    """One attention call: batch, query/key length, heads, key/value heads, head_dim, bytes per element."""

    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    b: int

    def bytes(self, heads: int | None = None, head_dim: int | None = None, b: int | None = None) -> int:
        """Bytes of one [B, heads, S, head_dim] tensor (defaults: the query's)."""
        return ((b or self.b) * self.batch * (heads or self.heads) * self.seq * (head_dim or self.head_dim))

    def scores(self, b: int | None = None) -> int:
        """Bytes of the [B, nh, S, S] score matrix."""
        return (b or self.b) * self.batch * self.heads * self.seq * self.seq


def sdpa_kernel(net, g: Geometry, has_mask: bool, dropout: float, enable_gqa: bool) -> str:
    """The kernel F.scaled_dot_product_attention runs: "flash", "efficient", "math" (CUDA) or "cpu_flash".

    ``net.sdpa_backend`` forces one (torch.nn.attention.sdpa_kernel); ``net.attention == "flash"`` restricts
    sdpa to flash (memplan.verify.hfbuild). On the CPU
    (select_sdp_backend_cpp): flash unless dropout > 0 (check_for_dropout), else math. On CUDA
    (select_sdp_backend, priority flash > efficient > math): flash takes no mask (check_for_attn_mask),
    16-bit dtypes only (check_dtypes_flash_attention), head_dim <= 256 (padded to a multiple of 8); the
    memory-efficient kernel needs head_dim a multiple of 8 (16-bit) or 4 (fp32) (minimum_gemm_alignment on
    sm80+) and, in its backward, as many key/value heads as query heads (_efficient_attention_backward
    checks query.size(2) == key.size(2)); math takes anything."""
    if net.sdpa_backend:
        return net.sdpa_backend
    if net.attention == "flash":
        return "flash"
    if net.device == "cpu":
        return "math" if dropout > 0 else "cpu_flash"
    if not has_mask and g.b == 2 and g.head_dim <= FLASH_MAX_HEAD_DIM:
        return "flash"
    if g.head_dim % (8 if g.b == 2 else 4) == 0 and not enable_gqa:
        return "efficient"
    return "math"


def repeat_kv(ag: Autograd, x: Tensor, n_rep: int, name: str) -> Tensor:
    """transformers repeat_kv: x[:, :, None].expand(B, kv, n_rep, S, d).reshape(B, kv·n_rep, S, d), a copy
    (clone: CloneBackward0 passes the grad; ExpandBackward0 sums it back to [B, kv, 1, S, d], a new tensor
    of x's size); n_rep == 1 returns x itself. The copy is contiguous ("bhsd")."""
    if n_rep == 1:
        return ag.ref(x)
    return ag.op(name, x.nbytes * n_rep, (x,), (),
                 lambda ctx, grad, node: (ctx.new(f"grad.{name}", x.nbytes, view=True),))


def _folds_copy(bshd: bool, g: Geometry) -> bool:
    """Whether torch.matmul's reshape of a [B, h, S, d] operand to [B·h, S, d] copies: when its memory is
    [B, S, h, d] and B > 1 (a batch of one folds into the heads as a view)."""
    return bshd and g.batch > 1


def _transpose_contiguous(ag: Autograd, out: Tensor, bshd: bool, name: str) -> Tensor:
    """attn_output.transpose(1, 2).contiguous(): free when the output's memory is [B, S, nh, d], else a copy
    (CloneBackward0: the grad passes through)."""
    return ag.view(out) if bshd else B.clone(ag, out, name)


def eager_attention(net, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, g: Geometry, *, dropout: float,
                    name: str, q_bshd: bool = True, k_bshd: bool = True, v_bshd: bool = True) -> Tensor:
    """transformers eager_attention_forward: repeat_kv(k), repeat_kv(v); q @ k^T (torch.matmul: an operand
    whose memory is [B, S, h, d] copies, a repeated one is contiguous), · scaling, + mask, softmax in fp32, .to(dtype),
    dropout, @ v, transpose(1, 2).contiguous() (a copy). Returns the [B, S, nh, d] output."""
    ag = net.ag
    n_rep = g.heads // g.kv_heads
    kr = repeat_kv(ag, k, n_rep, f"{name}.k_repeated")
    vr = repeat_kv(ag, v, n_rep, f"{name}.v_repeated")
    scores = B.matmul(ag, q, kr, g.scores(), f"{name}.scores", copy_a=_folds_copy(q_bshd, g),
                      copy_c=_folds_copy(n_rep == 1 and k_bshd, g))
    scaled = B.scale(ag, scores, f"{name}.scaled")
    ag.release(scores)
    if mask is not None:
        masked = B.add(ag, scaled, mask, f"{name}.masked")
        ag.release(scaled)
        scaled = masked
    probs32 = B.softmax(ag, scaled, g.scores(FP32), f"{name}.softmax", half_to_float=_half_to_float(net, g))
    probs = B.to_dtype(ag, probs32, g.scores(), f"{name}.probs")
    ag.release(probs32)
    ag.release(scaled)
    dropped = B.dropout(ag, probs, dropout, g.b, f"{name}.dropout", net.device)
    ag.release(probs)
    # attn_output.transpose(1, 2).contiguous() below hands the matmul's _unsafe_view a transposed grad
    out = B.matmul(ag, dropped, vr, g.bytes(), f"{name}.out", copy_c=_folds_copy(n_rep == 1 and v_bshd, g),
                   grad_copy=_folds_copy(True, g))
    o = B.clone(ag, out, f"{name}.out_contiguous")
    ag.release(out)
    for t in (kr, vr, dropped):  # the function returns (attn_output, attn_weights): locals die
        ag.release(t)
    return o


def _half_to_float(net, g: Geometry) -> bool:
    """CUDA's softmax takes fp16 input with an fp32 result directly (SoftMax.cpp softmax: the half_to_float
    path is for CUDA Half inputs); bf16, and every CPU input, is cast first."""
    return net.device == "cuda" and net.dtype == "fp16"


def sdpa_attention(net, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, g: Geometry, *, dropout: float,
                   name: str, bshd: tuple[bool, bool, bool] = (True, True, True)) -> Tensor:
    """transformers sdpa_attention_forward: with grouped-query heads, k and v are repeat_kv'd unless
    use_gqa_in_sdpa (no mask and head_dim <= 256: enable_gqa instead); F.scaled_dot_product_attention
    (a bool mask converted to the dtype first, attention.cpp convert_boolean_attn_mask, a local of the call;
    then the kernel, ``sdpa_kernel``); transpose(1, 2).contiguous(). ``bshd``: the memory layouts of q, k, v.
    Returns the [B, S, nh, d] output."""
    ag = net.ag
    n_rep = g.heads // g.kv_heads
    gqa = n_rep > 1 and mask is None and g.head_dim <= FLASH_MAX_HEAD_DIM
    if n_rep > 1 and not gqa:
        k2 = repeat_kv(ag, k, n_rep, f"{name}.k_repeated")
        v2 = repeat_kv(ag, v, n_rep, f"{name}.v_repeated")
        g2 = Geometry(g.batch, g.seq, g.heads, g.heads, g.head_dim, g.b)
        bshd = (bshd[0], False, False)
    else:
        k2, v2, g2 = ag.ref(k), ag.ref(v), g
    kernel = sdpa_kernel(net, g2, mask is not None, dropout, gqa)
    run = {"flash": flash_attention, "cpu_flash": cpu_flash_attention, "efficient": efficient_attention,
           "math": math_attention}[kernel]
    fmask = _bool_mask_to_float(ag, mask, g2, f"{name}.mask", kernel != "math") if kernel != "flash" else None
    out, out_bshd = run(net, q, k2, v2, fmask, g2, dropout=dropout, name=f"{name}.{kernel}", bshd=bshd)
    if fmask is not None:
        ag.release(fmask)
    o = _transpose_contiguous(ag, out, out_bshd, f"{name}.out_contiguous")
    ag.release(out)
    ag.release(k2)  # sdpa_attention_forward returns: its key, value (the repeated ones) die
    ag.release(v2)
    return o


def grad_copies(net, g: Geometry, mask_given: bool, dropout: float) -> tuple[bool, bool, bool]:
    """Whether the grads this attention hands back for q, k, v make the heads view's backward (the
    [B, nh, S, d] grad transposed back and viewed as [B, S, nh·d]) copy. Flash and efficient return them in
    the inputs' [B, S, nh, d] memory: no copy. Eager and math return q's and v's from bmm, contiguous
    [B, nh, S, d]: a copy; k's comes from the mat2 grad of k^T, [B, nh, d, S] in memory, whose transpose views
    back: no copy unless k was repeated (repeat_kv / repeat_interleave: contiguous [B, nh, S, d])."""
    n_rep = g.heads // g.kv_heads
    if net.attention == "eager":
        return True, n_rep > 1, True
    gqa = n_rep > 1 and not mask_given and g.head_dim <= FLASH_MAX_HEAD_DIM
    if n_rep > 1 and not gqa:
        g2 = Geometry(g.batch, g.seq, g.heads, g.heads, g.head_dim, g.b)
        return sdpa_kernel(net, g2, mask_given, dropout, False) == "math", True, True
    if sdpa_kernel(net, g, mask_given, dropout, gqa) == "math":
        return True, n_rep > 1, True
    return False, False, False


def _bool_mask_to_float(ag: Autograd, mask: Tensor | None, g: Geometry, name: str, saved: bool) -> Tensor | None:
    """attention.cpp convert_boolean_attn_mask: a bool mask becomes zeros_like(mask, dtype) masked_fill'd
    with -inf where it is False ([B, 1, S, S] in the query's dtype; mask.logical_not() is a temporary).
    Unless the kernel saves it (``saved``), it dies inside the sdpa call (named .tmp)."""
    if mask is None:
        return None
    out = ag.empty(f"{name}.float_mask" + ("" if saved else ".tmp"), g.b * g.batch * g.seq * g.seq)
    inverted = ag.empty(f"{name}.mask_not.tmp", g.batch * g.seq * g.seq)
    ag.release(inverted)
    return out


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

    out = ag.op(f"{name}.out", out_bytes, (q, k, v), (k, q, v), backward)
    lse = ag.empty(f"{name}.logsumexp", FP32 * g.batch * g.heads * g.seq)
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
    lse = ag.empty(f"{name}.logsumexp", FP32 * g.batch * g.heads * g.seq)
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
    out = ag.op(f"{name}.out", out_bytes, (q, k, v), saved, backward)
    lse = ag.empty(f"{name}.logsumexp", FP32 * g.batch * g.heads * s32)
    ag.keep(out, lse)
    ag.keep(out, out)
    ag.release(lse)
    if bias is not None:
        ag.release(bias)
    return out, True


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
    temporary), _safe_softmax, dropout, @ v, .to(dtype)
    of the probabilities and then of the output (make_tuple's arguments, right to left); the C++ locals die
    last declared first, the unused probabilities as sdpa returns. Returns a contiguous [B, nh, S, d] output."""
    ag = net.ag
    n_rep = g.heads // g.kv_heads
    q32 = B.to_dtype(ag, q, g.bytes(b=FP32), f"{name}.q_fp32")
    k32 = B.to_dtype(ag, k, g.bytes(g.kv_heads, b=FP32), f"{name}.k_fp32")
    v32 = B.to_dtype(ag, v, g.bytes(g.kv_heads, b=FP32), f"{name}.v_fp32")
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
    scores = B.matmul(ag, qs, ks, g.scores(FP32), f"{name}.scores", copy_a=_folds_copy(bshd[0], g),
                      copy_c=_folds_copy(n_rep == 1 and bshd[1], g))
    ag.release(ks)
    if mask is not None and g.b != FP32:  # attn.add_(mask): the 16-bit mask cast to fp32 for the add
        ag.release(ag.empty(f"{name}.mask_fp32", FP32 * mask.nbytes // g.b))
    probs = B.safe_softmax(ag, scores, f"{name}.softmax", g.batch * g.heads * g.seq)
    ag.release(scores)
    dropped = B.dropout(ag, probs, dropout, FP32, f"{name}.dropout", net.device)
    probs_out = B.to_dtype(ag, dropped, g.scores(), f"{name}.probs_out")
    # the output goes through transpose(1, 2).contiguous(): its reshape's backward sees a transposed grad
    o32 = B.matmul(ag, dropped, vr, g.bytes(b=FP32), f"{name}.out_fp32",
                   copy_c=_folds_copy(n_rep == 1 and bshd[2], g), grad_copy=_folds_copy(True, g))
    out = B.to_dtype(ag, o32, g.bytes(), f"{name}.out")
    ag.release(o32)
    for t in (probs, dropped, vr, kr, qs, fmask, v32, k32, q32, probs_out):
        ag.release(t)
    return out, False
