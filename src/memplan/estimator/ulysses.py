"""DeepSpeed's Ulysses sequence parallelism for transformers (DeepSpeed 0.19.8
runtime/sequence_parallel/ulysses_sp.py, UlyssesSPAttentionHF) in the autograd model.

register_with_transformers replaces the attention interface with ``uattn_wrapper``: the model's mask is dropped
(``attention_mask = None``: causal, no window), and UlyssesSPAttentionHF.forward runs on q, k, v [B, heads,
S/sp, d] of this rank's shard:

1. position_ids gathered: ``[torch.empty_like(position_ids) for _ in range(sp)]`` ([B, S/sp] int64 each: the
   loop's expanded positions give contiguous copies), all_gather, ``torch.cat`` → [B, S] (kept in ``kwargs``).
2. _combine_local_sequences, q then k then v: ``rearrange(.., "bs hc sl hs -> sl bs hc hs")`` (a view), for k
   and v ``repeat_interleave`` by sp / kv_heads when sp exceeds the kv heads (a new tensor), a reshape that
   splits the heads (a view), ``rearrange(.., "sl_l bs ws hc_l hs -> ws sl_l bs hc_l hs").contiguous()`` (a
   copy), _dim_zero_all_to_all (``torch.empty_like`` output: deepspeed/sequence/layer.py
   _dim_zero_all_to_all_op; its backward all-to-alls ``grad.contiguous()``), the reshape to [S, B, hc_l, hs]
   (a view); the copy dies as the function returns.
3. each of q, k, v ``rearrange(.., "sl bs hc_l hs -> bs hc_l sl hs").contiguous()`` (a copy; the all-to-all's
   output dies with the rebinding), then the core attention (transformers' sdpa_attention_forward) over the whole
   sequence with sp times fewer heads (kv heads max(kv / sp, 1)).
4. _partition_global_sequence on the context [B, S, hc_l·hs]: viewed [S, B, ..] and reshaped [sp, S/sp, B, em_l]
   ``.contiguous()`` (a copy unless B is 1), the all-to-all, ``rearrange(.., "ws sl_l bs em_l -> sl_l bs ws
   em_l")`` and a reshape to [S/sp, B, em] (a copy: ws and em_l are not adjacent); the all-to-all's output dies
   with the rebinding, the contiguous input as the function returns. The result is viewed [B, S/sp, em].
5. forward returns: ``kwargs`` (the gathered positions), the position list (last item first), then the attention's
   inputs and output unless the kernel saved them.

Backward, per copy above: CloneBackward passes the grad, a permute's backward is a view, a reshape's backward
reshapes the grad (a copy where the grad's memory order cannot be viewed so: the heads merge after the
all-to-all's backward, and, for a batch above one, where the batch and sequence dims trade places).
"""

from __future__ import annotations

from . import blocks as B
from .autograd import Autograd, Tensor
from .blocks_attention import Geometry
from .transformer import INT64


def local_geometry(g: Geometry, sp: int) -> Geometry:
    """The core attention's call on one rank: the whole sequence, heads / sp, kv heads max(kv / sp, 1)."""
    return Geometry(g.batch, g.seq, g.heads // sp, max(g.kv_heads // sp, 1), g.head_dim, g.b, g.v_head_dim)


def _view(ag: Autograd, x: Tensor, name: str, copy_grad: bool = False) -> Tensor:
    """A view (permute, reshape, rearrange) whose backward reshapes the grad: a copy of x's size when
    ``copy_grad`` (ViewBackward0 on a grad whose memory order cannot be viewed so)."""
    return B.heads_view(ag, x, copy_grad) if copy_grad else ag.view(x, name)


def _all_to_all(ag: Autograd, x: Tensor, name: str, grad_copy: bool) -> Tensor:
    """_dim_zero_all_to_all: ``torch.empty_like(input)`` filled by the collective; its backward all-to-alls
    ``grad.contiguous()`` (a temporary copy when ``grad_copy``) into a new tensor."""
    def backward(ctx, grad, node):
        tmp = ctx.new(f"grad.{name}.contiguous", x.nbytes) if grad_copy else None
        out = ctx.new(f"grad.{name}", x.nbytes)
        if tmp is not None:
            ctx.free(tmp)
        return (out,)

    return ag.op(name, x.nbytes, (x,), (), backward)


def _combine(ag: Autograd, x: Tensor, name: str, repeat: int, local_heads: int, grad_copy: bool) -> Tensor:
    """combine_sequence for one of q, k, v (x: [B, heads, S/sp, d], memory [B, S/sp, heads, d]): returns the
    all-to-all's output [S, B, hc_l, d] (see the module docstring, step 2; ``local_heads``: hc_l;
    ``grad_copy``: the all-to-all's backward copies its grad first, _grad_copies)."""
    t = _view(ag, x, f"{name}.sl_bs_hc_hs")
    if repeat > 1:  # repeat_interleave(f, dim=2): unsqueeze, expand, a contiguous copy; its backward sums
        rep = ag.op(f"{name}.repeat_interleave", x.nbytes * repeat, (t,), (),
                    lambda ctx, grad, node: (ctx.new(f"grad.{name}.repeat_interleave", x.nbytes),))
        ag.release(t)
        t = rep
    # the reshape splitting the heads is a view; its backward merges ws and hc_l again, which the all-to-all's
    # grad (memory [ws, S/sp, B, hc_l, d]) cannot view unless hc_l is 1: a copy
    split = _view(ag, t, f"{name}.split_heads", copy_grad=local_heads > 1)
    ag.release(t)
    moved = ag.view(split, f"{name}.ws_first")
    ag.release(split)
    copy = B.clone(ag, moved, f"{name}.combine_input")
    ag.release(moved)
    out = _all_to_all(ag, copy, f"{name}.combine_all_to_all", grad_copy)
    ag.release(copy)  # the function's ``input`` dies as it returns
    return out


def _grad_copies(net, gl: Geometry) -> tuple[bool, bool]:
    """Whether the all-to-all's backward copies the grad of q's (then k's and v's) [S, B, hc_l, d] output
    (``grad.contiguous()``): the grad is the core attention's, permuted back. CUDA's kernels and the math
    path return grads in their inputs' layout (the contiguous [B, hc_l, S, d] copies), and so does repeat_kv's
    backward: the permute is contiguous only for one sequence of one head. The CPU's flash kernel returns them
    in [B, S, hc_l, d] memory: contiguous for one sequence."""
    from .blocks_attention import dispatch

    kernel, g2, _ = dispatch(net.device, net.attention, net.sdpa_backend, gl, False, net.m.attention_dropout)
    one = net.s.batch == 1
    if kernel != "cpu_flash":
        return not (one and gl.heads == 1), not (one and gl.kv_heads == 1)
    return not one, not (one and (g2 is gl or gl.kv_heads == 1))


def v_grad_copies(net, g: Geometry) -> bool:
    """Whether the grad Ulysses hands back to v ([B, kv, S/sp, d]) makes v_proj's heads view copy
    (estimator/blocks.heads_view; q's and k's come back contiguous from RoPE's backward and always copy): a grad
    in [S/sp, B, kv, d] memory (the heads merged by a copy, or summed by repeat_interleave's backward) copies for
    B > 1; one straight from the all-to-all's backward (one local kv head: nothing merges) is in [kv, S/sp, B, d]
    memory and always copies."""
    sp = net.s.attn_seq // net.s.seq
    rep = sp // g.kv_heads if sp > g.kv_heads else 1
    return net.s.batch > 1 if rep > 1 or local_geometry(g, sp).kv_heads > 1 else True


def ulysses_attention(net, q: Tensor, k: Tensor, v: Tensor, g: Geometry, name: str, core) -> Tensor:
    """UlyssesSPAttentionHF.forward (the module docstring) around ``core(q, k, v, g_local)``, the interface it
    wraps (transformers' sdpa_attention_forward, given no mask: its [B, S, hc_l, d] output). ``g``: the model's
    geometry at the whole sequence. Returns the [B, S/sp, em] result."""
    ag, s = net.ag, net.s
    sp = s.attn_seq // s.seq
    gl = local_geometry(g, sp)
    positions = [ag.empty(f"{name}.position_ids_gathered.{i}", INT64 * s.batch * s.seq) for i in range(sp)]
    gathered = ag.empty(f"{name}.position_ids_cat", INT64 * s.batch * s.attn_seq)  # kwargs["position_ids"]
    rep = sp // g.kv_heads if sp > g.kv_heads else 1  # kv_replication_factor
    copies = _grad_copies(net, gl)
    combined = [_combine(ag, q, f"{name}.q", 1, gl.heads, copies[0]),
                _combine(ag, k, f"{name}.k", rep, gl.kv_heads, copies[1]),
                _combine(ag, v, f"{name}.v", rep, gl.kv_heads, copies[1])]
    layers = []
    for c, which, heads in zip(combined, "qkv", (gl.heads, gl.kv_heads, gl.kv_heads)):
        # rearrange(.., "sl bs hc_l hs -> bs hc_l sl hs").contiguous(): already contiguous for one sequence of
        # one head
        moved = ag.view(c, f"{name}.{which}_bhsd_view")
        layers.append(B.clone(ag, moved, f"{name}.{which}_layer") if s.batch > 1 or heads > 1 else ag.ref(moved))
        ag.release(moved)
        ag.release(c)
    context = core(*layers, gl)
    # _partition_global_sequence: [S, B, em_l] viewed, reshaped [ws, S/sp, B, em_l], .contiguous()
    shaped = _view(ag, context, f"{name}.context_ws")
    part_in = B.clone(ag, shaped, f"{name}.partition_input") if s.batch > 1 else ag.ref(shaped)
    ag.release(shaped)
    out = _all_to_all(ag, part_in, f"{name}.partition_all_to_all", grad_copy=True)
    moved = ag.view(out, f"{name}.sl_bs_ws_em")
    ag.release(out)
    result = B.clone(ag, moved, f"{name}.partition_output")  # the reshape merging ws and em_l copies
    ag.release(moved)
    ag.release(part_in)  # ``input`` dies as _partition_global_sequence returns
    ag.release(gathered)  # forward returns: kwargs, position_ids_list (last item first), the layers, context
    for t in reversed(positions):
        ag.release(t)
    for t in layers:
        ag.release(t)
    ag.release(context)
    view = _view(ag, result, f"{name}.bs_sl_em")
    ag.release(result)
    return view
