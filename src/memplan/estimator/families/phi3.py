"""Phi-3 (transformers 5.17 modeling_phi3.py): Llama's model and layer with Phi3Attention's fused qkv_proj (q, k
and v are slices of one output), apply_rotary_pos_emb over the first rotary_dim = head_dim ·
partial_rotary_factor dims (q[..., :rd] and q[..., rd:], a cat after RoPE), a sliding-window mask as Mistral's
(Phi3Model picks create_sliding_window_causal_mask when config.sliding_window is set), Phi3MLP's fused
gate_up_proj (chunk(2), up · act(gate)), and the residual dropouts (resid_pdrop, 0 by default: F.dropout
returns its input). Symbols as in blocks.py.
"""

from __future__ import annotations

from .. import blocks as B
from .. import blocks_attention as A
from .. import blocks_moe as M
from ..autograd import Tensor
from ..transformer import Net, Output
from . import llama


def _split(net: Net, x: Tensor, name: str) -> tuple[Tensor, Tensor]:
    """x[..., :rd], x[..., rd:] for one of q, k (Phi-3's apply_rotary_pos_emb). A slice over the whole last
    dim is an alias (AliasBackward0 passes the grad on); the empty x_pass still has a SliceBackward0, whose
    zeros are x's size."""
    ag = net.ag
    d, rd = net.m.head_dim, _rotary_dim(net)
    rot_bytes = x.nbytes * rd // d
    x_rot = ag.view(x) if rd == d else B.slice_view(ag, x, rot_bytes, f"{name}.x_rot")
    return x_rot, B.slice_view(ag, x, x.nbytes - rot_bytes, f"{name}.x_pass")


def _rope(net: Net, x_rot: Tensor, x_pass: Tensor, cos: Tensor, sin: Tensor, name: str) -> Tensor:
    """cat([(x_rot·cos) + (rotate_half(x_rot)·sin), x_pass])."""
    ag = net.ag
    r = B.rotate_half_embed(ag, x_rot, cos, sin, name)
    out = B.cat2(ag, r, x_pass, f"{name}.embed")
    ag.release(r)
    return out


def _rotary_dim(net: Net) -> int:
    m = net.m
    return int(m.head_dim * m.rotary_pct)


def attention(net: Net, x: Tensor, i: int, cos: Tensor, sin: Tensor, mask: Tensor | None
              ) -> tuple[Tensor, Tensor | None]:
    """Phi3Attention.forward: qkv_proj, the q / k / v slices viewed as heads, RoPE, the attention interface,
    o_proj; its locals (qkv, the states) die as it returns."""
    ag, m = net.ag, net.m
    pre = f"model.layers.{i}.self_attn"
    g = llama.geometry(net)
    dropout = m.attention_dropout
    v_copies = A.grad_copies(net, g, mask is not None, dropout)[2]
    t_b = net.s.b * net.s.tokens
    qkv = net.linear(x, f"{pre}.qkv_proj", m.q_dim + 2 * m.kv_dim, m.attention_bias)
    parts = [B.slice_view(ag, qkv, t_b * w, f"{pre}.{n}_slice") for n, w in (("q", m.q_dim), ("k", m.kv_dim),
                                                                             ("v", m.kv_dim))]
    # .view(hidden_shape).transpose(1, 2): RoPE's grads come back contiguous (a copy), v's as the kernel gives it
    qv, kv, vv = (B.heads_view(ag, z, copy_grad=w != "v" or v_copies) for w, z in zip("qkv", parts))
    for z in parts:
        ag.release(z)
    q_rot, q_pass = _split(net, qv, f"{pre}.q")  # all four slices before either product
    k_rot, k_pass = _split(net, kv, f"{pre}.k")
    qr = _rope(net, q_rot, q_pass, cos, sin, f"{pre}.q")
    kr = _rope(net, k_rot, k_pass, cos, sin, f"{pre}.k")
    for z in (q_rot, q_pass, k_rot, k_pass, qv, kv):  # apply_rotary_pos_emb returns; the states rebound
        ag.release(z)
    y, weights = llama.attend(net, qr, kr, vv, mask, g, pre, bshd=(False, False, True))  # q, k from cat
    for z in (qkv, qr, kr, vv):
        ag.release(z)
    return y, weights


def mlp(net: Net, x: Tensor, i: int) -> Tensor:
    """Phi3MLP, a module without parameters of its own (Net.container)."""
    return net.container(f"model.layers.{i}.mlp", lambda z: _mlp(net, z, i), x)


def _mlp(net: Net, x: Tensor, i: int) -> Tensor:
    """Phi3MLP.forward: gate_up_proj, chunk(2), up · activation_fn(gate) (a module), down_proj."""
    ag, m, s = net.ag, net.m, net.s
    pre, n = f"model.layers.{i}.mlp", m.intermediate_size
    up_states = net.linear(x, f"{pre}.gate_up_proj", 2 * n)
    gate, up = M.chunk2(ag, up_states, f"{pre}.chunk")
    ag.release(up_states)
    act = net.container(f"{pre}.activation_fn", lambda z: B.silu(ag, z, f"{pre}.act"), gate)
    prod = B.mul(ag, up, act, s.b * s.tokens * n, f"{pre}.up_act")
    ag.release(act)
    ag.release(up)
    y = net.linear(prod, f"{pre}.down_proj", m.hidden_size)
    ag.release(prod)
    ag.release(gate)
    return y


def forward(net: Net) -> Output:
    """Phi3ForCausalLM.forward: LlamaForCausalLM's with Phi-3's attention and MLP."""
    return llama.forward(net, mlp_fn=mlp, attn_fn=attention, block=layer)


def layer(net: Net, x: Tensor, i: int, cos: Tensor, sin: Tensor, mask: Tensor | None, mlp_fn=mlp,
          attn_fn=attention) -> Tensor:
    """Phi3DecoderLayer.forward: Llama's with each sublayer's output through its dropout module
    (resid_attn_dropout, resid_mlp_dropout: nn.Dropout(resid_pdrop), modules without parameters) before the
    residual add."""
    return llama.layer(net, x, i, cos, sin, mask, mlp_fn, attn_fn,
                       dropouts=(f"model.layers.{i}.resid_attn_dropout", f"model.layers.{i}.resid_mlp_dropout"))
