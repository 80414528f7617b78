"""One micro-step of a transformers causal LM in the autograd model: embeddings, decoder layers, norm, head, loss.

``forward`` mirrors ``*ForCausalLM.forward`` → ``*Model.forward`` → each ``*DecoderLayer.forward`` of
transformers 5.17 (Llama-style families: llama, mistral, qwen2, qwen3, mixtral): where the Python code binds and
rebinds variables, the model takes and drops references, so tensors die where the real ones die. The loss is
``ForCausalLMLoss`` (loss/loss_utils.py): ``logits.float()``, labels padded and shifted, ``cross_entropy``
(log_softmax + nll_loss). What the training loop keeps of the output object is the caller's business
(estimator/program.py). Symbols as in blocks.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..specs import ModelSpec
from . import blocks as B
from .autograd import Autograd, Tensor

INT64 = 8


@dataclass(frozen=True, slots=True)
class Shape:
    """Sizes of one micro-step on this rank."""

    batch: int  # sequences per micro-step
    seq: int  # tokens per sequence this rank holds (seq / sp)
    attn_seq: int  # tokens per sequence inside attention (the full sequence under Ulysses)
    b: int  # bytes of the training dtype
    positions_given: bool = False  # the loop passes position_ids (Ulysses shards): [B, S] rows, none made

    @property
    def pos_batch(self) -> int:
        """Rows of position_ids: the batch when the caller passes them, else 1 (arange(S).unsqueeze(0))."""
        return self.batch if self.positions_given else 1

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


class Params:
    """The model's parameters as autograd leaves (their bytes live in the model states, not here)."""

    def __init__(self, ag: Autograd, model: ModelSpec, b: int, trainable):
        from ..params import parameter_tensors

        self.by_name: dict[str, Tensor] = {}
        for t in parameter_tensors(model):
            self.by_name[t.name] = ag.param(t.name, t.numel * b, trainable(t.name))
        if model.tie_word_embeddings:
            self.by_name["lm_head.weight"] = self.by_name[next(iter(self.by_name))]

    def __getitem__(self, name: str) -> Tensor:
        return self.by_name[name]

    def get(self, name: str) -> Tensor | None:
        return self.by_name.get(name)


@dataclass
class Output:
    """What ``*ForCausalLM.forward`` returns: the loss and the logits (the CausalLMOutputWithPast)."""

    loss: Tensor
    logits: Tensor


def positions(ag: Autograd, s: Shape) -> Tensor | None:
    """position_ids and the packed-sequence check of create_causal_mask (masking_utils
    find_packed_sequence_indices: diff with a prepended value, != 1, cumsum; all temporaries). Without
    position_ids given, LlamaModel.forward makes them: arange(S) + past_seen_tokens → [1, S] int64.
    Returns the tensor the model allocated (None when the caller passed position_ids)."""
    rows = s.batch  # _preprocess_mask_arguments expands position_ids to the batch first
    made = None
    if not s.positions_given:
        arange = ag.empty("position_ids.arange", INT64 * s.seq)
        made = ag.empty("position_ids", INT64 * s.seq)
        ag.release(arange)
    first = ag.empty("mask.first_position", INT64 * rows)  # position_ids[:, :1] - 1
    prepended = ag.empty("mask.positions_prepended", INT64 * rows * (s.seq + 1))
    diff = ag.empty("mask.positions_diff", INT64 * rows * s.seq)
    ag.release(prepended)
    ne = ag.empty("mask.positions_ne", rows * s.seq)
    packed = ag.empty("mask.packed_sequences", INT64 * rows * s.seq)
    for t in (ne, first, diff, packed):
        ag.release(t)
    return made


def rotary(ag: Autograd, m: ModelSpec, s: Shape) -> tuple[Tensor, Tensor]:
    """LlamaRotaryEmbedding.forward under no_grad: positions as fp32 [P, 1, S] (P rows of position_ids),
    freqs = inv_freq [P, d/2, 1] @ positions [P, d/2, S], emb = cat(freqs, freqs) [P, S, d], cos and sin in
    fp32 times attention_scaling, cast to the training dtype. Returns (cos, sin) [P, S, d]; every layer's
    RoPE saves them."""
    d, rows = m.head_dim, s.pos_batch
    with_grad, ag.grad_enabled = ag.grad_enabled, False
    pos = ag.empty("rope.positions", B.FP32 * rows * s.seq)
    freqs = ag.empty("rope.freqs", B.FP32 * rows * (d // 2) * s.seq)
    emb = ag.empty("rope.emb", B.FP32 * rows * s.seq * d)
    out = []
    for which in ("cos", "sin"):
        raw = ag.empty(f"rope.{which}_fp32", B.FP32 * rows * s.seq * d)
        out.append(ag.empty(f"rope.{which}_scaled", B.FP32 * rows * s.seq * d))
        ag.release(raw)
    cos = B.to_dtype(ag, out[0], s.b * rows * s.seq * d, "rope.cos")
    sin = B.to_dtype(ag, out[1], s.b * rows * s.seq * d, "rope.sin")
    for t in (pos, freqs, emb, *out):
        ag.release(t)
    ag.grad_enabled = with_grad
    return cos, sin


def llama_attention(ag: Autograd, m: ModelSpec, s: Shape, p: Params, x: Tensor, i: int, cos: Tensor,
                    sin: Tensor) -> Tensor:
    """LlamaAttention.forward: q/k/v projections (views to [B, heads, S, d]), RoPE on q and k, the
    attention kernel, the output projection."""
    pre, t, b = f"model.layers.{i}.self_attn", s.tokens, s.b
    bias = m.attention_bias
    proj = []
    for which, width in (("q", m.q_dim), ("k", m.kv_dim), ("v", m.kv_dim)):
        z = B.linear(ag, x, p[f"{pre}.{which}_proj.weight"], b * t * width, f"{pre}.{which}_proj",
                     p.get(f"{pre}.{which}_proj.bias") if bias else None)
        # .view(hidden_shape).transpose(1, 2): q and k reach RoPE, whose grads come back in the kernel's
        # [B, heads, S, d] layout, so the view's backward (a reshape of the transposed grad) copies them
        proj.append(B.heads_view(ag, z, copy_grad=which != "v"))
        ag.release(z)
    qv, kv, vv = proj
    qr = B.rotate_half_embed(ag, qv, cos, sin, f"{pre}.q")
    kr = B.rotate_half_embed(ag, kv, cos, sin, f"{pre}.k")
    ag.release(qv)
    ag.release(kv)
    out = B.flash_attention(ag, qr, kr, vv, heads=m.num_heads, kv_heads=m.num_kv_heads, seq=s.attn_seq,
                            batch=s.batch, head_dim=m.head_dim, b=b, name=f"{pre}.attn")
    for z in (qr, kr, vv):
        ag.release(z)
    o_in = ag.view(out)  # transpose(1, 2).contiguous() and reshape: already [B, S, nh, d]
    ag.release(out)
    y = B.linear(ag, o_in, p[f"{pre}.o_proj.weight"], b * t * m.hidden_size, f"{pre}.o_proj",
                 p.get(f"{pre}.o_proj.bias") if m.attention_out_bias else None)
    ag.release(o_in)
    return y


def llama_mlp(ag: Autograd, m: ModelSpec, s: Shape, p: Params, x: Tensor, i: int) -> Tensor:
    """LlamaMLP.forward: down(act(gate(x)) · up(x))."""
    pre, t, b, n = f"model.layers.{i}.mlp", s.tokens, s.b, m.intermediate_size
    gate = B.linear(ag, x, p[f"{pre}.gate_proj.weight"], b * t * n, f"{pre}.gate_proj")
    act = B.silu(ag, gate, f"{pre}.act")
    ag.release(gate)
    up = B.linear(ag, x, p[f"{pre}.up_proj.weight"], b * t * n, f"{pre}.up_proj")
    prod = B.mul(ag, act, up, b * t * n, f"{pre}.act_up")
    ag.release(act)
    ag.release(up)
    y = B.linear(ag, prod, p[f"{pre}.down_proj.weight"], b * t * m.hidden_size, f"{pre}.down_proj")
    ag.release(prod)
    return y


def llama_layer(ag: Autograd, m: ModelSpec, s: Shape, p: Params, x: Tensor, i: int, cos: Tensor,
                sin: Tensor) -> Tensor:
    """LlamaDecoderLayer.forward; ``x`` stays referenced by the caller during the call."""
    pre = f"model.layers.{i}"
    residual = ag.ref(x)
    h = B.rmsnorm(ag, x, p[f"{pre}.input_layernorm.weight"], s.b, f"{pre}.input_layernorm")
    a = llama_attention(ag, m, s, p, h, i, cos, sin)
    ag.release(h)
    h = B.add(ag, residual, a, f"{pre}.attn_residual")
    ag.release(a)
    ag.release(residual)
    residual = ag.ref(h)
    h2 = B.rmsnorm(ag, h, p[f"{pre}.post_attention_layernorm.weight"], s.b, f"{pre}.post_attention_layernorm")
    ag.release(h)
    y = llama_mlp(ag, m, s, p, h2, i)
    ag.release(h2)
    out = B.add(ag, residual, y, f"{pre}.mlp_residual")
    ag.release(y)
    ag.release(residual)
    return out


def embedding(ag: Autograd, m: ModelSpec, s: Shape, weight: Tensor) -> Tensor:
    """nn.Embedding: the looked-up rows [T, h]. EmbeddingBackward0 (embedding_dense_backward on CUDA) builds
    the whole table's grad [V, h] in the weight's dtype; on CUDA it first sorts the int64 indices [T]
    (embedding_backward_cuda_kernel: sorted indices and their original positions, freed before it returns)."""
    t = s.tokens

    def backward(ctx, grad, node):
        tmp = [ctx.new("embedding.sorted_indices.tmp", INT64 * t), ctx.new("embedding.orig_indices.tmp", INT64 * t)]
        gw = ctx.new("grad.embedding.weight", weight.nbytes)
        for x in tmp:
            ctx.free(x)
        return (gw,)

    return ag.op("embedding", s.b * t * m.hidden_size, (weight,), (), backward)


def causal_lm_loss(ag: Autograd, m: ModelSpec, s: Shape, logits: Tensor) -> Tensor:
    """ForCausalLMLoss: logits.float() [T, V] fp32 (freed when the function returns), labels padded
    [B, S+1] and shifted [B, S] int64, cross_entropy = log_softmax (saves its fp32 output) + nll_loss.
    Backward: nll_loss's grad zeros [T, V] fp32, log_softmax's grad [T, V] fp32, the cast back [T, V]."""
    t, v = s.tokens, m.vocab_size
    f32 = B.to_dtype(ag, logits, B.FP32 * t * v, "loss.logits_fp32")
    padded = ag.empty("loss.labels_padded", INT64 * s.batch * (s.seq + 1), component="logits_loss")
    # labels[..., 1:].contiguous(): a copy unless the batch is 1 (a [1, S] slice is already contiguous)
    shifted = (ag.empty("loss.labels_shifted", INT64 * t, component="logits_loss") if s.batch > 1
               else ag.view(padded, "loss.labels_shifted", INT64 * t))
    flat = ag.view(f32)
    lsm = ag.op("loss.log_softmax", B.FP32 * t * v, (flat,), ("out",),
                lambda ctx, grad, node: (ctx.new("grad.loss.log_softmax", B.FP32 * t * v),),
                component="logits_loss")
    loss = ag.op("loss.nll", B.FP32, (lsm,), (shifted,),
                 lambda ctx, grad, node: (ctx.new("grad.loss.nll", B.FP32 * t * v),), component="logits_loss")
    ag.release(lsm)
    ag.release(flat)
    ag.release(f32)  # ForCausalLMLoss returns: logits (fp32), labels, shift_labels die
    ag.release(padded)
    ag.release(shifted)
    return loss


def llama_forward(ag: Autograd, m: ModelSpec, s: Shape, p: Params, layer_fn=None) -> Output:
    """LlamaForCausalLM.forward(input_ids, labels): the output object (loss and logits).

    ``layer_fn(i, x, run)`` wraps each decoder layer's call (checkpointing, ZeRO-3 gathering); it must call
    ``run(x)`` once and return its output."""
    emb = embedding(ag, m, s, p["model.embed_tokens.weight"])
    pos_ids = positions(ag, s)
    cos, sin = rotary(ag, m, s)
    hidden = ag.ref(emb)
    for i in range(m.num_layers):
        def run(x, i=i):
            return llama_layer(ag, m, s, p, x, i, cos, sin)
        new = layer_fn(i, hidden, run) if layer_fn else run(hidden)
        ag.release(hidden)
        hidden = new
    normed = B.rmsnorm(ag, hidden, p["model.norm.weight"], s.b, "model.norm")
    ag.release(hidden)
    for t in (pos_ids, emb, cos, sin):  # LlamaModel.forward returns: its locals die in co_varnames order
        ag.release(t)
    head_in = ag.view(normed)  # hidden_states[:, slice(0, None), :]
    ag.release(normed)
    logits = B.linear(ag, head_in, p["lm_head.weight"], s.b * s.tokens * m.vocab_size, "lm_head")
    ag.release(head_in)
    logits_comp(ag, logits)
    loss = causal_lm_loss(ag, m, s, logits)
    return Output(loss, logits)


def logits_comp(ag: Autograd, logits: Tensor) -> None:
    """Label the logits' allocation as the head's (component logits_loss)."""
    ag.ledger.components[logits.storage.tid] = "logits_loss"
