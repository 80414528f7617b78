"""parameter_tensors / count_params: toy cases by hand, and the real module tree on the meta device."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan.hfconfig import model_from_config, transformers_config
from memplan.params import count_params, linear_modules, parameter_tensors
from memplan.presets import PRESETS_DIR, list_presets, load_model

TOY_LLAMA = {
    "model_type": "llama", "hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 10,
}


def test_toy_llama_by_hand():
    # h=8, ffn=12, heads=4 → head_dim=2, kv_heads=2 → kv_dim=4, vocab=10, 2 layers, untied lm_head.
    # per layer: q 8·8=64, k 4·8=32, v 4·8=32, o 8·8=64 → attention 192
    #            gate 12·8=96, up 96, down 8·12=96 → mlp 288;  two RMSNorms 2·8=16  → 192+288+16 = 496
    # embeddings 10·8=80, final norm 8, lm_head 10·8=80 → total 80 + 2·496 + 8 + 80 = 1160
    counts = count_params(model_from_config(TOY_LLAMA, "toy", "test"))
    assert counts.per_layer_params == 496
    assert counts.embedding_params == 80
    assert counts.final_norm_params == 8
    assert counts.lm_head_params == 80
    assert counts.total_params == 1160
    assert counts.largest_tensor_numel == 96


def test_toy_llama_tied_names_and_order():
    model = model_from_config({**TOY_LLAMA, "num_hidden_layers": 1, "tie_word_embeddings": True}, "toy", "test")
    names = [t.name for t in parameter_tensors(model)]
    assert names == [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
        "model.norm.weight",
    ]
    assert count_params(model).lm_head_params == 0  # tied: lm_head is the embedding, counted once


def test_toy_llama_roles():
    model = model_from_config({**TOY_LLAMA, "num_hidden_layers": 1}, "toy", "test")
    roles = [t.role for t in parameter_tensors(model)]
    assert roles == ["embedding", "attn_in", "attn_in", "attn_in", "attn_out", "mlp_in", "mlp_in", "mlp_out",
                     "norm", "norm", "norm", "lm_head"]


_ROLE_OF_NAME = {  # the module names each role stands for, across the families
    "attn_in": ("q_proj", "k_proj", "v_proj", "c_attn", "query_key_value", "qkv_proj", "q_b_proj", "kv_b_proj"),
    "attn_out": ("o_proj", "attn.c_proj", "attention.dense", "self_attention.dense"),
    "attn_latent": ("q_a_proj", "kv_a_proj_with_mqa"),
    "mlp_in": ("gate_proj", "up_proj", "c_fc", "dense_h_to_4h", "experts.gate_up_proj", "mlp.gate_up_proj"),
    "mlp_out": ("down_proj", "mlp.c_proj", "dense_4h_to_h", "experts.down_proj"),
    "router": ("mlp.gate.weight",),
    "norm": ("norm", "ln_"),
    "embedding": ("embed_tokens", "wte", "word_embeddings.weight", "embed_in"),
    "position": ("wpe",),
    "lm_head": ("lm_head",),
}


@pytest.mark.parametrize("name", list_presets())
def test_roles_agree_with_names(name):
    for t in parameter_tensors(load_model(name)):
        assert any(part in t.name for part in _ROLE_OF_NAME[t.role]), (t.name, t.role)
        outside = ("embedding", "position", "lm_head")
        assert t.role in (*outside, "norm") if t.layer is None else t.role not in outside


def test_toy_gpt2_by_hand():
    # h=8, 1 layer, n_inner None → 4h = 32, positions 16, vocab 10, tied lm_head.
    # layer: ln_1 2·8=16, c_attn 8·24+24=216, c_proj 8·8+8=72, ln_2 16, c_fc 8·32+32=288, c_proj 32·8+8=264 → 872
    # embeddings: wte 10·8=80 + wpe 16·8=128 = 208; ln_f 16 → total 208 + 872 + 16 = 1096
    cfg = {"model_type": "gpt2", "n_embd": 8, "n_layer": 1, "n_head": 2, "n_positions": 16, "vocab_size": 10}
    counts = count_params(model_from_config(cfg, "toy", "test"))
    assert (counts.embedding_params, counts.per_layer_params, counts.final_norm_params) == (208, 872, 16)
    assert (counts.lm_head_params, counts.total_params) == (0, 1096)


@pytest.mark.parametrize("name", list_presets())
def test_counts_add_up(name):
    model = load_model(name)
    c = count_params(model)
    assert c.total_params == sum(t.numel for t in parameter_tensors(model))
    if len(set(c.layer_params)) == 1:  # all layers alike (DeepSeek-V3's dense first layers: test_layer_params_add_up)
        assert c.total_params == (
            c.embedding_params + model.num_layers * c.per_layer_params + c.final_norm_params + c.lm_head_params
        )
    layers = {t.layer for t in parameter_tensors(model)} - {None}
    assert layers == set(range(model.num_layers))


# ---- ground truth: the module tree transformers builds, on the meta device (no memory, no weights) ----

#: a DeepSeek-V3 shape: MLA (q and kv latents), 8 routed experts in 2 groups, 2 shared, one dense first layer
TOY_DEEPSEEK = {
    "model_type": "deepseek_v3", "hidden_size": 8, "intermediate_size": 12, "moe_intermediate_size": 4,
    "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 10, "kv_lora_rank": 6,
    "q_lora_rank": 5, "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 3, "n_routed_experts": 8,
    "n_shared_experts": 2, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
}

FAMILY_TOYS = {
    "llama-bias": {**TOY_LLAMA, "attention_bias": True, "mlp_bias": True},
    "llama-head-dim": {**TOY_LLAMA, "head_dim": 4},
    "mistral": {**TOY_LLAMA, "model_type": "mistral"},
    "qwen2": {**TOY_LLAMA, "model_type": "qwen2", "tie_word_embeddings": True},
    "qwen3": {**TOY_LLAMA, "model_type": "qwen3", "head_dim": 4},
    "qwen3-bias-default-head": {**TOY_LLAMA, "model_type": "qwen3", "attention_bias": True},
    "mixtral": {**TOY_LLAMA, "model_type": "mixtral", "num_local_experts": 3, "num_experts_per_tok": 2},
    "gpt2-inner": {"model_type": "gpt2", "n_embd": 8, "n_layer": 2, "n_head": 2, "n_inner": 20, "vocab_size": 10},
    "gpt2-untied": {"model_type": "gpt2", "n_embd": 8, "n_layer": 2, "n_head": 2, "tie_word_embeddings": False},
    "gpt_neox-nobias": {"model_type": "gpt_neox", "hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
                        "intermediate_size": 20, "vocab_size": 10, "attention_bias": False},
    "gpt_neox-tied": {"model_type": "gpt_neox", "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                      "intermediate_size": 20, "vocab_size": 10, "tie_word_embeddings": True},
    "bloom-untied": {"model_type": "bloom", "hidden_size": 8, "n_layer": 2, "n_head": 2, "vocab_size": 10,
                     "tie_word_embeddings": False},
    # ---- the families of issue 16 (pad_token_id inside the toy vocabulary: nn.Embedding asserts it) ----
    "gemma2-tied": {**TOY_LLAMA, "model_type": "gemma2", "head_dim": 4, "num_hidden_layers": 3, "pad_token_id": 0},
    "gemma2-untied-bias": {**TOY_LLAMA, "model_type": "gemma2", "head_dim": 2, "tie_word_embeddings": False,
                           "attention_bias": True, "pad_token_id": 9},
    "gemma3-text": {**TOY_LLAMA, "model_type": "gemma3_text", "head_dim": 4, "num_hidden_layers": 7,
                    "sliding_window_pattern": 3, "pad_token_id": 0},
    "gemma3-multimodal": {"model_type": "gemma3", "text_config": {**TOY_LLAMA, "head_dim": 4, "pad_token_id": 0}},
    "phi3": {**TOY_LLAMA, "model_type": "phi3", "pad_token_id": 3},
    "phi3-mha-window-partial": {**TOY_LLAMA, "model_type": "phi3", "num_key_value_heads": None, "pad_token_id": None,
                                "sliding_window": 4, "partial_rotary_factor": 0.5, "tie_word_embeddings": True},
    "qwen3_moe-dense-layer": {**TOY_LLAMA, "model_type": "qwen3_moe", "num_hidden_layers": 3, "num_experts": 4,
                              "num_experts_per_tok": 2, "moe_intermediate_size": 6, "mlp_only_layers": [1]},
    "qwen3_moe-sparse-step-bias": {**TOY_LLAMA, "model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 3,
                                   "num_experts_per_tok": 3, "decoder_sparse_step": 2, "attention_bias": True,
                                   "head_dim": 6},
    "olmo2": {**TOY_LLAMA, "model_type": "olmo2", "pad_token_id": 1},
    "olmo2-bias-tied": {**TOY_LLAMA, "model_type": "olmo2", "attention_bias": True, "tie_word_embeddings": True,
                        "pad_token_id": None},
    "deepseek_v3-q-lora-shared": {**TOY_DEEPSEEK},
    "deepseek_v3-no-q-lora-bias": {**TOY_DEEPSEEK, "q_lora_rank": None, "attention_bias": True, "first_k_dense_replace": 0},
    "deepseek_v3-all-dense-tied": {**TOY_DEEPSEEK, "first_k_dense_replace": 5, "tie_word_embeddings": True},
}


def _meta_tensors(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    return [(n, tuple(p.shape)) for n, p in _meta_model(cfg).named_parameters()]


def _meta_model(cfg: dict):
    """AutoModelForCausalLM.from_config on the meta device (a gemma3 config: its text model, as memplan reads it)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = transformers.AutoConfig.for_model(**transformers_config(cfg))
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _ours(model) -> list[tuple[str, tuple[int, ...]]]:
    return [(t.name, t.shape) for t in parameter_tensors(model)]


@pytest.mark.parametrize("name", list_presets())
def test_preset_matches_transformers_on_meta(name):
    cfg = json.loads((PRESETS_DIR / f"{name}.json").read_text())
    assert _ours(load_model(name)) == _meta_tensors(cfg)


@pytest.mark.parametrize("toy", sorted(FAMILY_TOYS))
def test_family_toy_matches_transformers_on_meta(toy):
    cfg = FAMILY_TOYS[toy]
    assert _ours(model_from_config(cfg, toy, "test")) == _meta_tensors(cfg)


# ---- property: any small config of any family builds exactly the tensors we list ----

def _random_config(draw) -> dict:
    family = draw(st.sampled_from(["llama", "mistral", "qwen2", "qwen3", "mixtral", "gpt2", "gpt_neox", "bloom"]))
    heads = draw(st.sampled_from([1, 2, 4]))
    kv = draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0]))
    hidden = heads * draw(st.sampled_from([2, 4]))
    cfg = {"model_type": family, "vocab_size": draw(st.integers(3, 17)), "tie_word_embeddings": draw(st.booleans())}
    layers, ffn = draw(st.integers(1, 3)), draw(st.integers(1, 9))
    if family == "gpt2":
        return {**cfg, "n_embd": hidden, "n_head": heads, "n_layer": layers, "n_positions": draw(st.integers(1, 9)),
                "n_inner": draw(st.sampled_from([None, ffn]))}
    if family == "bloom":
        return {**cfg, "hidden_size": hidden, "n_head": heads, "n_layer": layers}
    cfg.update(hidden_size=hidden, num_attention_heads=heads, num_hidden_layers=layers, intermediate_size=ffn)
    if family == "gpt_neox":
        return {**cfg, "attention_bias": draw(st.booleans())}
    cfg.update(num_key_value_heads=kv)
    if draw(st.booleans()):  # an explicit head_dim (qwen2 and mixtral read it with getattr)
        cfg["head_dim"] = draw(st.sampled_from([2, 6]))
    if family in ("llama", "qwen3"):
        cfg["attention_bias"] = draw(st.booleans())
    if family == "llama":
        cfg["mlp_bias"] = draw(st.booleans())
    if family == "mixtral":
        experts = draw(st.integers(1, 4))
        cfg.update(num_local_experts=experts, num_experts_per_tok=draw(st.integers(1, experts)))
    return cfg


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=st.composite(_random_config)())
def test_random_small_configs_match_transformers_on_meta(cfg):
    assert _ours(model_from_config(cfg, "random", "hypothesis")) == _meta_tensors(cfg)


# ---- the families of issue 16: LoRA's Linear modules, layers that differ, random small configs ----

def _linear_names(model) -> list[str]:
    """What peft's LoRA can wrap: nn.Linear and GPT-2's Conv1D modules, in named_modules() order (a tied lm_head
    is the embedding)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    tied = model.config.get_text_config().tie_word_embeddings
    return [n for n, mod in model.named_modules()
            if isinstance(mod, (torch.nn.Linear, Conv1D)) and not (n == "lm_head" and tied)]


@pytest.mark.parametrize("toy", sorted(FAMILY_TOYS))
def test_linear_modules_are_the_real_linears(toy):
    """Packed 3-D experts and the MoE routers (bare nn.Parameter) are not Linear; every nn.Linear is listed."""
    cfg = FAMILY_TOYS[toy]
    assert list(linear_modules(model_from_config(cfg, toy, "test"))) == _linear_names(_meta_model(cfg))


def test_deepseek_layers_differ_and_add_up():
    # TOY_DEEPSEEK, h=8: MLA attention = q_a 5·8 + q_a_norm 5 + q_b (2·6)·5 + kv_a (6+2)·8 + kv_norm 6
    #   + kv_b (2·(4+3))·6 + o 8·(2·3) = 40 + 5 + 60 + 64 + 6 + 84 + 48 = 307; two layer norms 16
    # layer 0 dense MLP 3·8·12 = 288 → 611; layers 1-2: experts 8·(2·4·8) + 8·(8·4) = 512 + 256, router 8·8 = 64,
    # shared experts (width 2·4 = 8) 3·8·8 = 192 → 307 + 16 + 1024 = 1347
    counts = count_params(model_from_config(TOY_DEEPSEEK, "toy", "test"))
    assert counts.layer_params == (611, 1347, 1347)
    assert counts.per_layer_params == 611
    assert counts.total_params == 80 + 611 + 2 * 1347 + 8 + 80


@pytest.mark.parametrize("name", list_presets())
def test_layer_params_add_up(name):
    model = load_model(name)
    c = count_params(model)
    assert len(c.layer_params) == model.num_layers and c.layer_params[0] == c.per_layer_params
    assert c.total_params == c.embedding_params + sum(c.layer_params) + c.final_norm_params + c.lm_head_params
    # the final norm: one RMSNorm weight, or a LayerNorm's weight and bias
    assert c.final_norm_params == model.hidden_size * (2 if model.norm == "layernorm" else 1)


def _random_new_family(draw) -> dict:
    family = draw(st.sampled_from(["gemma2", "gemma3_text", "phi3", "qwen3_moe", "olmo2", "deepseek_v3"]))
    heads = draw(st.sampled_from([1, 2, 4]))
    vocab = draw(st.integers(3, 17))
    cfg = {"model_type": family, "vocab_size": vocab, "tie_word_embeddings": draw(st.booleans()),
           "num_hidden_layers": draw(st.integers(1, 4)), "num_attention_heads": heads,
           "hidden_size": heads * draw(st.sampled_from([2, 4])), "intermediate_size": draw(st.integers(1, 9)),
           "pad_token_id": draw(st.sampled_from([None, 0, vocab - 1]))}
    if family == "deepseek_v3":
        groups = draw(st.sampled_from([1, 2]))
        experts = groups * draw(st.integers(2, 3))
        return {**cfg, "num_key_value_heads": heads, "kv_lora_rank": draw(st.integers(1, 5)),
                "q_lora_rank": draw(st.sampled_from([None, 3])), "qk_nope_head_dim": draw(st.integers(1, 3)),
                "qk_rope_head_dim": draw(st.sampled_from([2, 4])), "v_head_dim": draw(st.integers(1, 3)),
                "n_routed_experts": experts, "n_group": groups, "topk_group": draw(st.integers(1, groups)),
                "num_experts_per_tok": draw(st.integers(1, experts)), "n_shared_experts": draw(st.integers(1, 2)),
                "first_k_dense_replace": draw(st.integers(0, 2)), "moe_intermediate_size": draw(st.integers(1, 5)),
                "attention_bias": draw(st.booleans())}
    cfg["num_key_value_heads"] = draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0]))
    if family in ("gemma2", "gemma3_text"):
        cfg["head_dim"] = draw(st.sampled_from([2, 4]))
        cfg["attention_bias"] = draw(st.booleans())
    if family == "gemma3_text":
        cfg["sliding_window_pattern"] = draw(st.integers(1, 3))
    if family == "qwen3_moe":
        experts = draw(st.integers(0, 4))
        cfg.update(num_experts=experts, num_experts_per_tok=draw(st.integers(1, max(1, experts))),
                   moe_intermediate_size=draw(st.integers(1, 5)), decoder_sparse_step=draw(st.integers(1, 2)),
                   mlp_only_layers=draw(st.lists(st.integers(0, 3), max_size=2)))
    if family in ("olmo2", "qwen3_moe"):
        cfg["attention_bias"] = draw(st.booleans())
    return cfg


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=st.composite(_random_new_family)())
def test_random_new_family_configs_match_transformers_on_meta(cfg):
    model = model_from_config(cfg, "random", "hypothesis")
    meta = _meta_model(cfg)
    assert _ours(model) == [(n, tuple(p.shape)) for n, p in meta.named_parameters()]
    assert list(linear_modules(model)) == _linear_names(meta)
