"""The forward of one pipeline stage: memplan.verify.pipeline's modules (verify/pipeline.py ``_modules``) run in
turn by PipelineModule.forward (``inputs = layer(inputs)`` for each local spec: the previous output dies unless
something saved it), in the autograd model.

- TokenEmbedding: ``F.embedding(ids, weight)`` (EmbeddingBackward saves the ids: the forward's input clone).
- LlamaPositions: ``torch.arange(S).unsqueeze(0).expand(B, -1).contiguous()`` (a copy when B > 1), passed on
  with the hidden states.
- LlamaLayer: the stage's shared rotary (StageRotary) computes (cos, sin) from the position ids it is handed
  at the forward's first layer and keeps them, and the position ids object as its key, until the next forward's
  first layer replaces them; then transformers' decoder layer with no attention mask (families/llama.py
  ``layer``), its output passed on with the position ids.
- GPT2Positions: ``drop(hidden + wpe(arange(S)).unsqueeze(0))``; GPT2Layer: transformers' GPT2Block, no mask.
- LlamaFinalNorm / GPT2FinalNorm on the hidden states; LMHead: ``F.linear(hidden, weight)`` (the tied
  embedding's weight under a TiedLayerSpec); the loss_fn ForCausalLMLoss (causal_lm.causal_lm_loss).

Returns what the stage sends on ((hidden, position ids) or (hidden,)), or on the last stage (logits,), which
the engine hands to the loss_fn (estimator/pipeline.py).
Symbols as in blocks.py. Pure: no torch.
"""

from __future__ import annotations

from . import blocks_gpt as G
from .autograd import Autograd, Tensor
from .causal_lm import embedding, logits_comp
from .transformer import Net, rotary

INT64 = 8


def stage_forward(ag: Autograd, ins: tuple, pipe, net_of) -> tuple:
    """Run the stage's specs on ``ins`` (the forward's input clones); ``net_of(ag)`` makes the Net."""
    net = net_of(ag)
    m, s, stage = net.m, net.s, pipe.stage
    gpt2 = m.family == "gpt2"
    if stage.first:
        (ids,) = ins
        embed = "transformer.wte" if gpt2 else "model.embed_tokens"
        w = net.p[f"{embed}.weight"]
        hidden = net.module(embed, lambda: embedding(ag, m, s, w, name="wte" if gpt2 else "embedding", indices=ids,
                                                                   cuda=net.device == "cuda"),
                            params=(w,))
        pos = None
        if gpt2:
            hidden = _gpt2_positions(net, hidden)
        else:
            pos = _llama_positions(ag, s)
    else:
        hidden, pos = ins
        ag.ref(hidden)
        if pos is not None:
            ag.ref(pos)
    for i in stage.layers:
        if gpt2:
            from .families.gpt2 import block

            new = net.container(f"transformer.h.{i}", lambda z, i=i: block(net, z, i, None), hidden)
        else:
            from .families.llama import layer

            cos, sin = _stage_rotary(ag, net, pipe, pos)
            new = net.container(f"model.layers.{i}", lambda z, i=i, cos=cos, sin=sin: layer(net, z, i, cos, sin, None),
                                hidden)
        ag.release(hidden)
        hidden = new
    if not stage.head:
        return (hidden, pos) if not gpt2 else (hidden,)
    ag.release(pos)
    normed = net.layernorm(hidden, "transformer.ln_f") if gpt2 else net.rmsnorm(hidden, "model.norm")
    ag.release(hidden)
    logits = net.linear(normed, "lm_head", m.vocab_size)
    ag.release(normed)
    logits_comp(ag, logits)
    return (logits,)


def _llama_positions(ag: Autograd, s) -> Tensor:
    """LlamaPositions: arange(S) [S] int64, expanded to [B, S] and made contiguous (a copy when B > 1)."""
    arange = ag.empty("pipe.positions.arange", INT64 * s.seq)
    if s.batch == 1:
        return arange
    pos = ag.empty("pipe.positions", INT64 * s.batch * s.seq)
    ag.release(arange)
    return pos


def _gpt2_positions(net: Net, hidden: Tensor) -> Tensor:
    """GPT2Positions: ``drop(hidden + wpe(arange(S)).unsqueeze(0))``; the token embedding's output dies."""
    from .families.gpt2 import dropout

    ag, m, s = net.ag, net.m, net.s
    pos = ag.empty("pipe.positions.arange", INT64 * s.seq)
    wpe = net.p["transformer.wpe.weight"]
    pe = net.module("transformer.wpe", lambda: embedding(ag, m, s, wpe, rows=s.seq, name="wpe", indices=pos,
                                                                   cuda=net.device == "cuda"),
                    params=(wpe,))
    ag.release(pos)
    summed = G.add_broadcast(ag, hidden, pe, "transformer.embeddings")
    ag.release(pe)
    out = dropout(net, summed, m.embedding_dropout, "transformer.drop")
    ag.release(summed)
    ag.release(hidden)
    return out


def _stage_rotary(ag: Autograd, net: Net, pipe, pos: Tensor) -> tuple[Tensor, Tensor]:
    """StageRotary.__call__: (cos, sin) for ``pos``, computed at the forward's first layer and cached with the
    position ids as the key (the previous forward's pair and key die as the new ones are bound)."""
    if pipe.rotary_key is pos:
        return pipe.rotary_value
    if not pipe.rotary_made:  # the module, made at the first call under torch.device(hidden.device)
        pipe.rotary_made = True
        _rotary_module(ag, net.m)
    value = rotary(ag, net.m, net.s)
    old_key, old_value = pipe.rotary_key, pipe.rotary_value
    pipe.rotary_key, pipe.rotary_value = ag.ref(pos), value
    ag.release(old_key)
    for t in old_value or ():
        ag.release(t)
    return value


def _rotary_module(ag: Autograd, m) -> None:
    """LlamaRotaryEmbedding(config) on the device: the default rope init's ``1.0 / (base ** (torch.arange(0, dim,
    2).float() / dim))`` (the arange as fp32, the division, the power, the reciprocal, times attention_scaling:
    [d/2] fp32 temporaries), registered as inv_freq, and ``original_inv_freq = inv_freq.clone()``: two [d/2]
    fp32 tensors kept for the run."""
    n = 4 * (m.head_dim // 2)
    arange = ag.empty("rope.init.arange", n)
    ratio = ag.empty("rope.init.ratio", n)
    ag.release(arange)
    power = ag.empty("rope.init.power", n)
    ag.release(ratio)
    inverse = ag.empty("rope.init.reciprocal", n)
    ag.empty("rope.inv_freq", n)  # kept by the module
    ag.release(power)
    ag.release(inverse)
    ag.empty("rope.original_inv_freq", n)  # kept by the module
