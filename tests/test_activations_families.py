"""Saved tensors of Gemma 2/3, Phi-3, Qwen3-MoE, OLMo 2 and DeepSeek-V3: a toy by hand, the CPU measurement
(tools/saved_tensors.py, saved_tensors_hooks on tiny bf16 models, sdpa and eager), and properties.

Tolerance of the CPU comparison: none inside the layers (every byte of every layer is a listed term), and
outside the layers the loss labels (head.py counts 16 bytes per token, the CPU keeps one [S+1] int64 view)
plus up to 64 bytes of 0-dim tensors (the loss, Gemma's embedding scale, the aux loss's [E] sums).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.estimator.activations import layer_bytes_per_token, layer_fixed_bytes, layer_terms
from memplan.estimator.head import rope_terms, saved_terms
from memplan.hfconfig import model_from_config
from memplan.presets import load_model

NEW = ("gemma2", "gemma2-window-above-seq", "gemma3_text", "phi3", "phi3-window-dropout", "qwen3_moe",
       "qwen3_moe-aux-loss", "olmo2", "deepseek_v3", "deepseek_v3-no-q-lora")
SEQ = 128
SCALARS_BYTES = 64


def test_qwen3_moe_layer_by_hand():
    # h=16, d=8, q = 4·8 = 32, kv = 2·8 = 16, nh=4, E=4, k=2, I_e=6, bf16, flash (no mask). Per token:
    # input_layernorm 4h + 4 + 2h = 100; q/k/v input 2h = 32
    # q_norm 4q + 4·nh + 2q = 208; k_norm 4kv + 4·2 + 2kv = 104
    # q 2q = 64, k 2kv = 32, v 2kv = 32, out 2q = 64, logsumexp 4·nh = 16
    # post_attention_layernorm 100
    # router: input 2h = 32, softmax 4E = 16, topk 8k = 16
    # experts: perm 8k = 16, perm//k 16, sentinel k = 2, gathered 2kh = 64, gate_up 2·2k·I_e = 48,
    #          act and product 2·2k·I_e = 48, weights 2k = 4, down out 2kh = 64, inverse perm 16
    # total 100+32+208+104+64+32+32+64+16+100+32+16+16+16+16+2+64+48+48+4+64+16 = 1094; offsets 4E = 16 per layer
    cfg = {"model_type": "qwen3_moe", "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 8, "intermediate_size": 24, "moe_intermediate_size": 6, "num_experts": 4,
           "num_experts_per_tok": 2, "num_hidden_layers": 1, "vocab_size": 10}
    m = model_from_config(cfg, "toy", "test")
    assert layer_bytes_per_token(m, 2, "sdpa", 64) == 1094
    assert layer_fixed_bytes(m, 2, "sdpa", 64, 0) == 16


def test_gemma2_sliding_layer_by_hand():
    # h=16, nh=4, kv heads 2, d=8 (q=32, kv=16), I=24, window 8. Gemma norms: 4h + 4 + 4h = 132 each, four of
    # them = 528 (+ (1+w) fp32 4h = 64 bytes each per layer). q/k/v input 2h = 32; MLP input 2h = 32, 4·2I = 192
    # full layer (flash): q 64, k 32, v 32, out 64, lse 16 → 528 + 32 + 208 + 32 + 192 = 992
    # sliding layer at S=64 >= 8 (masked): q 64, k/v repeated 64 + 64, out 64, lse 16, bias 2·S = 128 → 1184
    cfg = {"model_type": "gemma2", "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 8, "intermediate_size": 24, "num_hidden_layers": 2, "vocab_size": 10, "sliding_window": 8}
    m = model_from_config(cfg, "toy", "test")
    assert m.layer_types == ("sliding_attention", "full_attention")
    assert layer_bytes_per_token(m, 2, "sdpa", 64, layer=0) == 1184
    assert layer_bytes_per_token(m, 2, "sdpa", 64, layer=1) == 992
    assert layer_bytes_per_token(m, 2, "sdpa", 64) == (1184 + 992) // 2  # the mean, what layers × it needs
    assert layer_bytes_per_token(m, 2, "sdpa", 8, layer=0) == 1184 - 128 + 16  # S=8: the bias is 2·8
    assert layer_bytes_per_token(m, 2, "sdpa", 4, layer=0) == 992  # S < window: no mask, as the full layer
    assert layer_fixed_bytes(m, 2, "sdpa", 64, 0) == 4 * 64


def _measured(family: str, attention: str) -> dict:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from saved_tensors import FAMILIES, measure

    return measure(family, attention, seq=SEQ), dict(FAMILIES[family])


@pytest.mark.parametrize("family", NEW)
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_layer_terms_match_saved_tensors_on_cpu(family, attention):
    """Each layer's bytes equal its terms with the CPU's kernels, byte for byte. The tool counts a storage in
    every layer that saves it, so each layer carries the RoPE cos/sin pair it uses (head.rope_terms, one pair
    per layer kind in Gemma 3), which the estimator counts once outside the layers."""
    row, cfg = _measured(family, attention)
    m = model_from_config(cfg, family, "test")
    pairs = len({m.is_sliding_layer(i) for i in range(m.num_layers)}) if m.family == "gemma3_text" else 1
    rope = rope_terms(m, 2)[0].bytes_per_token // pairs
    for i in range(m.num_layers):
        expected = (layer_bytes_per_token(m, 2, attention, SEQ, layer=i, kernel="cpu") + rope) * SEQ
        expected += layer_fixed_bytes(m, 2, attention, SEQ, i, kernel="cpu")
        assert row["bytes"][f"layer{i}"] == expected, (i, row["tensors"][f"layer{i}"])


@pytest.mark.parametrize("family", NEW)
def test_outside_terms_match_saved_tensors_on_cpu(family):
    """Outside the layers: embeddings, final norm, lm_head input, Gemma's soft-capped logits, the fp32
    log_softmax, Qwen3-MoE's aux loss; labels and 0-dim tensors within the stated tolerance."""
    row, cfg = _measured(family, "sdpa")
    m = model_from_config(cfg, family, "test")
    terms = [t for t in saved_terms(m, 2, SEQ) if not t.name.startswith(("rope", "loss.labels"))]
    expected = sum(t.bytes_per_token * SEQ + t.fixed_bytes for t in terms) + 8 * (SEQ + 1)
    assert 0 <= row["bytes"]["outside"] - expected <= SCALARS_BYTES
    if m.final_logit_softcapping is not None:
        assert any(t.name == "logits.softcap_tanh" for t in terms)


def test_cuda_kernels_where_they_differ_from_the_cpu():
    """MLA's sdpa: CUDA's memory-efficient kernel keeps q, k, v, out, logsumexp; the CPU's math path fp32
    copies and its own probabilities. Dropout masks: bool on CUDA, the dtype on the CPU."""
    m = load_model("deepseek-v3-4l")
    cuda = {t.name for t in layer_terms(m, 2, "sdpa", 4096, layer=3)}
    cpu = {t.name for t in layer_terms(m, 2, "sdpa", 4096, layer=3, kernel="cpu")}
    assert {"attn.q", "attn.k", "attn.v", "attn.out", "attn.logsumexp"} <= cuda and "attn.math_probs" in cpu
    phi = load_model("phi-3-mini").model_copy(update={"hidden_dropout": 0.1})
    masks = {k: next(t for t in layer_terms(phi, 2, "sdpa", 512, kernel=k) if t.name == "dropout_masks")
             for k in ("cuda", "cpu")}
    assert masks["cpu"].bytes_per_token == 2 * masks["cuda"].bytes_per_token == 4 * phi.hidden_size


def test_presets_layer_kinds():
    """Layers differ where the configs say: Gemma 2 alternates, Gemma 3 has 5 sliding to 1 full, Phi-3's
    window masks every layer from seq 2047, DeepSeek-V3's first 3 layers are dense."""
    g2, g3, phi, ds = (load_model(n) for n in ("gemma-2-9b", "gemma-3-4b", "phi-3-mini", "deepseek-v3"))
    assert [g2.is_sliding_layer(i) for i in range(4)] == [True, False, True, False]
    assert sum(g3.is_sliding_layer(i) for i in range(g3.num_layers)) == 29  # 34 layers, every 6th full
    assert layer_bytes_per_token(phi, 2, "sdpa", 2048) > layer_bytes_per_token(phi, 2, "sdpa", 2046)
    assert [ds.is_moe_layer(i) for i in range(5)] == [False, False, False, True, True]
    assert layer_fixed_bytes(ds, 2, "sdpa", 4096, 3) >= 4 * 256 * 7168  # the router's fp32 weight copy


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["gemma-2-2b", "gemma-3-4b", "phi-3-medium", "qwen3-30b-a3b", "olmo-2-7b",
                             "deepseek-v3-4l"]),
       seq=st.integers(1, 16384), attention=st.sampled_from(["sdpa", "eager"]), b=st.sampled_from([2, 4]))
def test_mean_layer_times_layers_covers_every_layer(name, seq, attention, b):
    m = load_model(name)
    per = [layer_bytes_per_token(m, b, attention, seq, layer=i) for i in range(m.num_layers)]
    mean = layer_bytes_per_token(m, b, attention, seq)
    assert sum(per) <= mean * m.num_layers < sum(per) + m.num_layers
    for i in range(m.num_layers):
        assert all(t.bytes_per_token >= 0 and t.fixed_bytes >= 0 for t in layer_terms(m, b, attention, seq, layer=i))
    assert layer_bytes_per_token(m, b, attention, seq, selective=True) <= mean
