"""Attention in the autograd model: transformers' attention interfaces and the kernels torch's
scaled_dot_product_attention dispatches to (estimator/autograd.py; conventions as in blocks.py).

``eager_attention`` is transformers' ``eager_attention_forward`` (modeling_llama.py and its copies), a pure
composition of aten ops. ``sdpa_attention`` is ``integrations/sdpa_attention.py sdpa_attention_forward``:
repeat_kv unless ``use_gqa_in_sdpa``, ``F.scaled_dot_product_attention``, ``transpose(1, 2).contiguous()``.
The kernel is picked by ``sdpa_kernel`` after torch's sdp dispatch (aten/src/ATen/native/transformers/
cuda/sdp_utils.cpp ``select_sdp_backend``; sdp_utils_cpp.cpp ``select_sdp_backend_cpp`` on the CPU) and
modelled in blocks_kernels.py. Allocations inside a kernel that it frees before returning are named
``*.tmp``.

Layouts: a [B, nh, S, d] tensor is either "bshd" (its memory is [B, S, nh, d], as a projection viewed and
transposed, and what RoPE's elementwise ops keep) or "bhsd" (contiguous); the layout decides where a
reshape or ``.contiguous()`` copies, in forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import blocks as B
from . import blocks_linear as BL
from .autograd import Autograd, Tensor
from .blocks import FP32

#: FlashAttention-2 takes head_dim in multiples of 8: sdpa pads q, k, v (attention.cpp pad_last_dim<8>)
FLASH_HEAD_ALIGN = 8
#: FlashAttention-2's backward rounds the sequence to 128 and head_dim to 32 for softmax_d / dq_accum
FLASH_SEQ_ROUND, FLASH_HEAD_ROUND = 128, 32
#: largest head_dim flash takes (sdp_utils.cpp check_head_dim_size_flash)
FLASH_MAX_HEAD_DIM = 256
#: torch 2.11 on the measuring machine (H200 = sm90, the cu130 wheel bundling cuDNN 9.19) tries cuDNN attention
#: first: sdp_utils.cpp check_prefer_cudnn_attention puts cudnn_attention ahead of flash for cuDNN > 9.15.0 on
#: sm90 / sm100. The committed H200 traces agree: their sdpa backward allocates one cuDNN workspace per layer and
#: none of FlashAttention-2's dk_expanded / dq_accum buffers (benchmarks/accuracy/traces/trace-llama1b-*)
CUDNN_FIRST = True
#: cuDNN 9.19's head_dim limit (check_cudnn_tensor_shapes: 256 needs cuDNN > 9.22), a multiple of 8
CUDNN_MAX_HEAD_DIM, CUDNN_HEAD_ALIGN = 128, 8
#: cuDNN's dropout resolution: p must be a multiple of 1/16 (check_cudnn_dropout)
CUDNN_DROPOUT_STEPS = 16
#: the memory-efficient kernel's logsumexp rows are padded to this (attention.cu kAlignLSE)
EFFICIENT_LSE_ALIGN = 32
#: an attention mask's last dim is padded to this for the memory-efficient kernel (attention.cpp preprocess_mask)
EFFICIENT_MASK_ALIGN = 16


#: cuDNN's one head-width pair with unequal widths, DeepSeek's MLA (d_qk 192, d_v 128): torch 2.11 on the H200
#: runs it (benchmarks/attention/mla-sdpa-probe-h200.jsonl: aten::_scaled_dot_product_cudnn_attention at every
#: probed shape), as cudnn-frontend documents ("d_qo should be equal to d_kv, except d_qk 192 / d_vo 128")
CUDNN_MLA_HEAD_DIMS = (192, 128)


@dataclass(frozen=True, slots=True)
class Geometry:
    """One attention call: batch, query/key length, heads, key/value heads, head_dim (q and k), bytes per
    element, and the value head width when it differs (MLA's v_head_dim; 0: head_dim)."""

    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    b: int
    v_head_dim: int = 0

    @property
    def dv(self) -> int:
        """Width per head of v and of the output."""
        return self.v_head_dim or self.head_dim

    def bytes(self, heads: int | None = None, head_dim: int | None = None, b: int | None = None) -> int:
        """Bytes of one [B, heads, S, head_dim] tensor (defaults: the query's)."""
        return ((b or self.b) * self.batch * (heads or self.heads) * self.seq * (head_dim or self.head_dim))

    def v_bytes(self, heads: int | None = None, b: int | None = None) -> int:
        """Bytes of one [B, heads, S, dv] tensor (v, the output; defaults: the query's heads)."""
        return self.bytes(heads, self.dv, b)


    def scores(self, b: int | None = None) -> int:
        """Bytes of the [B, nh, S, S] score matrix."""
        return (b or self.b) * self.batch * self.heads * self.seq * self.seq


def model_geometry(m, batch: int, seq: int, b: int) -> Geometry:
    """The attention call of model ``m`` (a ModelSpec): MLA attends over [nh, qk_nope + qk_rope] queries and
    keys and [nh, v_head_dim] values (DeepseekV3Attention: expand_kv), the others over head_dim."""
    if m.kv_lora_rank is not None:
        return Geometry(batch, seq, m.num_heads, m.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim, b,
                        m.v_head_dim)
    return Geometry(batch, seq, m.num_heads, m.num_kv_heads, m.head_dim, b)


def sdpa_kernel(net, g: Geometry, has_mask: bool, dropout: float, enable_gqa: bool) -> str:
    """The kernel F.scaled_dot_product_attention runs for this call under ``net`` (see ``select_kernel``)."""
    return select_kernel(net.device, net.attention, net.sdpa_backend, g, has_mask, dropout, enable_gqa)


def select_kernel(device: str, attention: str, forced: str | None, g: Geometry, has_mask: bool, dropout: float,
                  enable_gqa: bool) -> str:
    """The kernel F.scaled_dot_product_attention runs: "cudnn", "flash", "efficient", "math" (CUDA) or
    "cpu_flash"; the one rule (activations.sdpa_backend and the specs' checks ask it too).

    ``forced`` (torch.nn.attention.sdpa_kernel) wins; ``attention == "flash"`` restricts sdpa to flash
    (memplan.verify.hfbuild). On the CPU (select_sdp_backend_cpp): flash unless dropout > 0
    (check_for_dropout), else math. On CUDA (select_sdp_backend, torch 2.11's order on the H200: cuDNN, flash,
    efficient, math — CUDNN_FIRST): cuDNN takes 16-bit dtypes (check_dtypes_low_precision), head_dim a multiple
    of 8 up to 128 (check_cudnn_tensor_shapes), dropout in steps of 1/16 (check_cudnn_dropout), masks and
    grouped-query heads; flash takes no mask (check_for_attn_mask), 16-bit dtypes only
    (check_dtypes_flash_attention), head_dim <= 256 (padded to a multiple of 8, attention.cpp pad_last_dim); the
    memory-efficient kernel needs head_dim a multiple of 8 (16-bit) or 4 (fp32) (minimum_gemm_alignment on sm80+)
    and, in its backward, as many key/value heads as query heads (_efficient_attention_backward checks
    query.size(2) == key.size(2)); math takes anything."""
    if forced:
        return forced
    if attention == "flash":
        return "flash"
    if device == "cpu":  # check_head_dim_size_cpp: flash needs q, k and v of one width
        return "math" if dropout > 0 or g.dv != g.head_dim else "cpu_flash"
    if CUDNN_FIRST and cudnn_takes(g, dropout):
        return "cudnn"
    if g.dv != g.head_dim:  # unequal widths outside cuDNN's pair: the memory-efficient kernel (not modelled)
        return "math"
    if not has_mask and g.b == 2 and g.head_dim <= FLASH_MAX_HEAD_DIM:
        return "flash"
    if g.head_dim % (8 if g.b == 2 else 4) == 0 and not enable_gqa:
        return "efficient"
    return "math"


def cudnn_takes(g: Geometry, dropout: float) -> bool:
    """can_use_cudnn_attention for a dense training call (see select_kernel)."""
    steps = dropout * CUDNN_DROPOUT_STEPS
    widths = (g.head_dim, g.dv)
    shapes = (widths == CUDNN_MLA_HEAD_DIMS
              or all(d % CUDNN_HEAD_ALIGN == 0 and d <= CUDNN_MAX_HEAD_DIM for d in widths) and g.dv == g.head_dim)
    return g.b == 2 and shapes and steps == int(steps) and g.seq > 1


def use_gqa(g: Geometry, has_mask: bool) -> bool:
    """transformers' use_gqa_in_sdpa: grouped-query heads go to sdpa as they are (enable_gqa) when there is
    no mask and head_dim <= 256; else repeat_kv copies k and v to the query heads first."""
    return g.heads != g.kv_heads and not has_mask and g.head_dim <= FLASH_MAX_HEAD_DIM


def dispatch(device: str, attention: str, forced: str | None, g: Geometry, has_mask: bool, dropout: float
             ) -> tuple[str, Geometry, bool]:
    """(kernel, the geometry sdpa sees, enable_gqa) for transformers' sdpa_attention_forward on ``g``: with
    grouped-query heads and no use_gqa_in_sdpa, k and v arrive repeated to the query heads."""
    gqa = use_gqa(g, has_mask)
    if g.heads != g.kv_heads and not gqa:
        g = Geometry(g.batch, g.seq, g.heads, g.heads, g.head_dim, g.b, g.v_head_dim)
    return select_kernel(device, attention, forced, g, has_mask, dropout, gqa), g, gqa


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
                    name: str, q_bshd: bool = True, k_bshd: bool = True, v_bshd: bool = True,
                    softcap: bool = False) -> Tensor:
    """transformers eager_attention_forward: repeat_kv(k), repeat_kv(v); q @ k^T (torch.matmul: an operand
    whose memory is [B, S, h, d] copies, a repeated one is contiguous), · scaling, (Gemma 2's ``softcap``:
    / cap, tanh, · cap), + mask, softmax in fp32, .to(dtype), dropout, @ v, transpose(1, 2).contiguous() (a
    copy). Returns the [B, S, nh, d] output and attn_weights (the dropout's output, or the probabilities),
    which the caller holds until its own frame dies."""
    ag = net.ag
    n_rep = g.heads // g.kv_heads
    kr = repeat_kv(ag, k, n_rep, f"{name}.k_repeated")
    vr = repeat_kv(ag, v, n_rep, f"{name}.v_repeated")
    scores = BL.matmul(ag, q, kr, g.scores(), f"{name}.scores", copy_a=_folds_copy(q_bshd, g),
                      copy_c=_folds_copy(n_rep == 1 and k_bshd, g), batch=g.batch * g.heads, elem_bytes=g.b)
    scaled = B.scale(ag, scores, f"{name}.scaled")
    ag.release(scores)
    if softcap:
        scaled = B.soft_cap(ag, scaled, f"{name}.softcap")
    if mask is not None:
        masked = B.add(ag, scaled, mask, f"{name}.masked")
        ag.release(scaled)
        scaled = masked
    probs32 = B.softmax(ag, scaled, g.scores(FP32), f"{name}.softmax", half_to_float=_half_to_float(net, g),
                        device=net.device)
    probs = B.to_dtype(ag, probs32, g.scores(), f"{name}.probs")
    ag.release(probs32)
    ag.release(scaled)
    dropped = B.dropout(ag, probs, dropout, g.b, f"{name}.dropout", net.device)
    ag.release(probs)
    # attn_output.transpose(1, 2).contiguous() below hands the matmul's _unsafe_view a transposed grad
    out = BL.matmul(ag, dropped, vr, g.v_bytes(), f"{name}.out", copy_c=_folds_copy(n_rep == 1 and v_bshd, g),
                   grad_copy=_folds_copy(True, g), batch=g.batch * g.heads, elem_bytes=g.b)
    o = B.clone(ag, out, f"{name}.out_contiguous")
    ag.release(out)
    for t in (kr, vr):  # the function returns (attn_output, attn_weights): the other locals die
        ag.release(t)
    return o, dropped


def _half_to_float(net, g: Geometry) -> bool:
    return B.half_to_float(net)


def sdpa_attention(net, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, g: Geometry, *, dropout: float,
                   name: str, bshd: tuple[bool, bool, bool] = (True, True, True)) -> Tensor:
    """transformers sdpa_attention_forward: with grouped-query heads, k and v are repeat_kv'd unless
    use_gqa_in_sdpa (no mask and head_dim <= 256: enable_gqa instead); F.scaled_dot_product_attention
    (a bool mask converted to the dtype first, attention.cpp convert_boolean_attn_mask, a local of the call;
    then the kernel, ``sdpa_kernel``); transpose(1, 2).contiguous(). ``bshd``: the memory layouts of q, k, v.
    Returns the [B, S, nh, d] output."""
    from . import blocks_kernels as K

    ag = net.ag
    kernel, g2, _ = dispatch(net.device, net.attention, net.sdpa_backend, g, mask is not None, dropout)
    if g2 is not g:  # repeat_kv to the query heads
        n_rep = g.heads // g.kv_heads
        k2 = repeat_kv(ag, k, n_rep, f"{name}.k_repeated")
        v2 = repeat_kv(ag, v, n_rep, f"{name}.v_repeated")
        bshd = (bshd[0], False, False)
    else:
        k2, v2 = ag.ref(k), ag.ref(v)
    run = {"flash": K.flash_attention, "cpu_flash": K.cpu_flash_attention, "efficient": K.efficient_attention,
           "math": K.math_attention, "cudnn": K.cudnn_attention}[kernel]
    # the kernel saves the converted mask, except the math path (composite) and a checkpointed forward
    saved = kernel != "math" and ag.saving
    fmask = _bool_mask_to_float(ag, mask, g2, f"{name}.mask", saved) if kernel != "flash" else None
    out, out_bshd = run(net, q, k2, v2, fmask, g2, dropout=dropout, name=f"{name}.{kernel}", bshd=bshd)
    if fmask is not None:
        ag.release(fmask)
    # a single head transposes to a contiguous tensor (Ulysses' local heads can be one): no copy
    o = _transpose_contiguous(ag, out, out_bshd or g2.heads == 1, f"{name}.out_contiguous")
    ag.release(out)
    ag.release(k2)  # sdpa_attention_forward returns: its key, value (the repeated ones) die
    ag.release(v2)
    return o


def grad_copies(net, g: Geometry, mask_given: bool, dropout: float) -> tuple[bool, bool, bool]:
    """Whether the grads this attention hands back for q, k, v make the heads view's backward (the
    [B, nh, S, d] grad transposed back and viewed as [B, S, nh·d]) copy. Flash, efficient and cuDNN return them
    in the inputs' [B, S, nh, d] memory (cuDNN: alloc_with_matching_layout): no copy. Eager and math return q's
    and v's from bmm, contiguous [B, nh, S, d]: a copy; k's comes from the mat2 grad of k^T, [B, nh, d, S] in
    memory, whose transpose views back: no copy unless k was repeated (repeat_kv / repeat_interleave:
    contiguous [B, nh, S, d]). Under Ulysses (the rank's sequence shorter than attention's) the grads come
    back from the wrapper's backward: q's and k's through RoPE, v's as ulysses.v_grad_copies says."""
    if net.s.attn_seq != net.s.seq:
        from .ulysses import v_grad_copies

        return True, True, v_grad_copies(net, g)
    n_rep = g.heads // g.kv_heads
    if net.attention == "eager":
        return True, n_rep > 1, True
    kernel, g2, _ = dispatch(net.device, net.attention, net.sdpa_backend, g, mask_given, dropout)
    if g2 is not g:  # k and v repeated first: their grads reach the heads view through repeat_kv's
        return kernel == "math", True, True
    if kernel == "math":
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
