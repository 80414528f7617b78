"""Mixtral (transformers 5.17 modeling_mixtral.py): Mistral's attention and layer with MixtralSparseMoeBlock
as the MLP, the router (MixtralTopKRouter) and the experts through grouped_mm_experts_forward
(integrations/moe.py, the default experts implementation; see blocks_moe). Symbols as in blocks_moe.py.
"""

from __future__ import annotations

from .. import blocks as B
from .. import blocks_linear as BL
from .. import blocks_moe as M
from .. import peft_param as PW
from ..autograd import Tensor
from ..transformer import Net, Output
from . import llama

INT64, INT32 = M.INT64, M.INT32


def router(net: Net, x: Tensor, i: int, renormalize: bool = True, weight_bytes: int = B.FP32
           ) -> tuple[Tensor, Tensor, Tensor]:
    """MixtralTopKRouter.forward on x [T, h] (a module with its weight: ZeRO-3's hooks around all of it):
    logits = F.linear (the training dtype [T, E]), softmax of logits.float() (the copy dies once softmax has
    run), topk, values /= values.sum(-1, keepdim). Returns (router_logits, top_k_weights, top_k_index); the
    weights are what gradients reach. Qwen3MoeTopKRouter is the same code with the division only when
    norm_topk_prob (``renormalize``) and the weights cast to the logits' dtype (``weight_bytes``: a copy unless
    that is fp32; Mixtral's stay fp32)."""
    name = f"model.layers.{i}.mlp.gate.weight"
    acts = PW.activations(net, (name,))  # peft's lora.ParamWrapper on the router's weight (peft_param.py)
    read = PW.reader(net, acts)
    return net.module(f"model.layers.{i}.mlp.gate",
                      lambda z: PW.run_wrapped(net, acts, lambda: _router(net, z, read, i, renormalize, weight_bytes)),
                      x, params=(net.p[name],), hooked=1)


def _router(net: Net, x: Tensor, read, i: int, renormalize: bool, weight_bytes: int
            ) -> tuple[Tensor, Tensor, Tensor]:
    ag, m, s = net.ag, net.m, net.s
    pre, t, e, k = f"model.layers.{i}.mlp.gate", s.tokens, m.num_experts, m.num_experts_per_tok
    xr = ag.view(x)  # hidden_states.reshape(-1, hidden_dim): a view node of its own
    logits = BL.linear(ag, xr, read(f"{pre}.weight"), s.b * t * e, pre)  # F.linear(hidden_states, self.weight)
    ag.release(xr)
    f32 = B.to_dtype(ag, logits, B.FP32 * t * e, f"{pre}.logits_fp32")  # Qwen3: softmax(dtype=float) converts
    probs = ag.op(f"{pre}.softmax", B.FP32 * t * e, (f32,), ("out",),
                  lambda ctx, grad, node: (ctx.new(f"grad.{pre}.softmax", B.FP32 * t * e),))
    ag.release(f32)
    values, indices = M.topk(ag, probs, t, k, f"{pre}.topk")
    if renormalize:
        total = M.sum_last(ag, values, B.FP32 * t, f"{pre}.topk_sum")
        normed = M.div_inplace(ag, values, total, f"{pre}.normalized")
        ag.release(values)
        ag.release(total)  # the sum is a temporary of the statement
        values = normed
    weights = B.to_dtype(ag, values, weight_bytes * t * k, f"{pre}.weights")  # the fp32 values die if cast
    ag.release(values)
    ag.release(probs)  # router_probs: a local until the function returns
    return logits, weights, indices


def experts(net: Net, x: Tensor, weights: Tensor, index: Tensor, i: int, wb: int, read=None) -> Tensor:
    """grouped_mm_experts_forward(x [T, h], top_k_index, top_k_weights): the routed rows sorted by expert,
    gathered, through gate_up (grouped_mm, masked_fill), act(gate)·up, down (grouped_mm, masked_fill),
    weighted in the routing weights' dtype (``wb`` bytes: fp32 for Mixtral, the training dtype for
    Qwen3-MoE), unsorted, summed over the k choices and cast back; its locals die as it returns. ``read``:
    how it reads self.gate_up_proj and self.down_proj (peft_param.reader: through peft's ParamWrappers)."""
    ag, m, s, p = net.ag, net.m, net.s, net.p
    read = read or p.__getitem__
    pre = f"model.layers.{i}.mlp.experts"
    t, e, k, h, n, b = s.tokens, m.num_experts, m.num_experts_per_tok, m.hidden_size, m.expert_intermediate_size, s.b
    wo = max(wb, b)  # the product's dtype (type promotion)
    rows = t * k
    expert_ids_g = ag.empty(f"{pre}.sorted_ids", INT64 * rows)  # torch.sort: values, then indices
    perm = ag.empty(f"{pre}.perm", INT64 * rows)
    if net.device == "cpu":  # the CPU sort's index arange; CUDA's cub radix sort temporaries are not modelled
        ag.release(ag.empty(f"{pre}.sort_arange.tmp", INT64 * rows))
    token_of = ag.empty(f"{pre}.token_index", INT64 * rows)  # perm // num_top_k
    gathered = M.index_rows(ag, net, x, token_of, rows, b * h, f"{pre}.gathered")
    ag.release(token_of)
    w_flat = ag.view(weights)  # top_k_weights.reshape(-1)
    sample_w = M.index_rows(ag, net, w_flat, perm, rows, wb, f"{pre}.sample_weights")
    ag.release(w_flat)
    histc_input = ag.empty(f"{pre}.histc_input", INT32 * rows)  # .float() on the CPU, .int() on CUDA
    per_expert = ag.empty(f"{pre}.tokens_per_expert", INT32 * e)
    offsets = ag.empty(f"{pre}.offsets", INT32 * e)  # cumsum(dtype=int32)
    sentinel = ag.empty(f"{pre}.sentinel_mask", rows)  # (expert_ids_g >= E).unsqueeze(-1), bool
    up_w = read(f"{pre}.gate_up_proj")  # selected_weights = self.gate_up_proj, before the pre-mask
    selected = M.masked_fill(ag, gathered, sentinel, f"{pre}.premask", in_place=True)
    ag.release(gathered)
    up_out = M.grouped_mm(ag, selected, up_w, offsets, b * rows * 2 * n, f"{pre}.gate_up", e)
    proj = M.masked_fill(ag, up_out, sentinel, f"{pre}.gate_up_masked")
    ag.release(up_out)
    gate, up = M.chunk2(ag, proj, f"{pre}.chunk")  # _default_apply_gate
    ag.release(proj)
    act = net.container(f"{pre}.act_fn", lambda z: B.silu(ag, z, f"{pre}.act"), gate)
    prod = B.mul(ag, act, up, b * rows * n, f"{pre}.act_up")
    for z in (act, gate, up):
        ag.release(z)
    down = M.grouped_mm(ag, prod, read(f"{pre}.down_proj"), offsets, b * rows * h, f"{pre}.down", e)
    ag.release(prod)
    proj = M.masked_fill(ag, down, sentinel, f"{pre}.down_masked")
    ag.release(down)
    sw = ag.view(sample_w)  # .unsqueeze(-1)
    weighted = M.weight_rows(ag, net, proj, sw, wo * rows * h, b, f"{pre}.weighted", wb)
    ag.release(sw)
    inv_perm = ag.empty(f"{pre}.inv_perm", INT64 * rows)  # empty_like(perm); inv_perm[perm] = arange(S)
    ag.release(ag.empty(f"{pre}.arange", INT64 * rows))
    unsorted = M.index_rows(ag, net, weighted, inv_perm, rows, wo * h, f"{pre}.unsorted")
    # weighted_out = weighted_out[inv_perm]; a checkpoint's recompute stops inside this index (it saves the
    # layer's last tensor): the assignment never runs and the old weighted_out dies with the frame's locals
    stopped = ag.suppress
    if not stopped:
        ag.release(weighted)
    # .view(T, k, h).sum(1): SumBackward1 expands the grad to [T, k, h], which the view's backward reshapes
    # to [S, h]: a copy unless k is 1
    summed = ag.op(f"{pre}.sum", wo * t * h, (unsorted,), (),
                   lambda ctx, grad, node: (ctx.new(f"grad.{pre}.sum", unsorted.nbytes) if k > 1 else
                                            ag.view(grad, f"grad.{pre}.sum", unsorted.nbytes),))
    out = B.to_dtype(ag, summed, b * t * h, f"{pre}.out")
    # the function returns: expert_ids_g, perm, selected, sample_weights_g, histc_input, tokens_per_expert,
    # offsets, sentinel_mask, proj_out, weighted_out, inv_perm, final_hidden_states (co_varnames order)
    for z in (expert_ids_g, perm, selected, sample_w, histc_input, per_expert, offsets, sentinel, proj,
              weighted if stopped else unsorted, inv_perm, summed):
        ag.release(z)
    return out


def wrapped_experts(net: Net, x: Tensor, weights: Tensor, index: Tensor, i: int, wb: int) -> Tensor:
    """experts() inside the ParamWrappers peft puts around the experts module, when it adapts them."""
    pre = f"model.layers.{i}.mlp.experts"
    acts = PW.activations(net, (f"{pre}.gate_up_proj", f"{pre}.down_proj"))
    read = PW.reader(net, acts)
    return PW.run_wrapped(net, acts, lambda: experts(net, x, weights, index, i, wb, read))


def moe(net: Net, x: Tensor, i: int) -> Tensor:
    """MixtralSparseMoeBlock, a ZeRO-3 leaf module by DeepSpeed's default (Net.leaf): one fetch of the router's
    and the experts' parameters around the whole block."""
    p, pre = net.p, f"model.layers.{i}.mlp"
    params = (p[f"{pre}.gate.weight"], p[f"{pre}.experts.gate_up_proj"], p[f"{pre}.experts.down_proj"])
    return net.leaf(pre, lambda z: block(net, z, i), x, params)


def block(net: Net, x: Tensor, i: int, renormalize: bool = True, weight_bytes: int = B.FP32) -> Tensor:
    """MixtralSparseMoeBlock.forward (no router jitter in the default config), and Qwen3MoeSparseMoeBlock's,
    which is the same with its router's options (see router): view to [T, h], the router, the experts, reshape
    back; router_logits (the ``_``) and top_k_weights die as it returns."""
    ag = net.ag
    flat = ag.view(x)
    logits, weights, index = router(net, flat, i, renormalize, weight_bytes)
    pre = f"model.layers.{i}.mlp.experts"
    # self.experts(hidden_states, top_k_index, top_k_weights): both float inputs carry its backward hook
    out = net.module(pre, lambda z, w: wrapped_experts(net, z, w, index, i, weight_bytes), flat, weights,
                     params=(net.p[f"{pre}.gate_up_proj"], net.p[f"{pre}.down_proj"]))
    ag.release(flat)
    for z in (logits, weights, index):
        ag.release(z)
    return out


def forward(net: Net) -> Output:
    """MixtralForCausalLM.forward (output_router_logits False: no auxiliary loss)."""
    return llama.forward(net, mlp_fn=moe)
