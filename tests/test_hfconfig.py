"""hfconfig: transformers' defaults for missing keys, the seed's GPT2Model config, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.errors import InputError
from memplan.hfconfig import FAMILIES, load_config_file, model_from_config, transformers_config
from memplan.params import parameter_tensors
from memplan.presets import load_model

SEED_CONFIG = Path(__file__).resolve().parents[1] / "examples" / "seed-176b" / "176b_config.json"
SMALL = {"hidden_size": 8, "intermediate_size": 12, "num_hidden_layers": 2, "num_attention_heads": 4,
         "vocab_size": 10}


def _hf_config(cfg: dict):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers.AutoConfig.for_model(**cfg)


def test_hand_defaults_llama():
    # LlamaConfig: kv heads None → heads; head_dim None → hidden/heads = 8/4 = 2; untied; 2048 positions
    m = model_from_config({"model_type": "llama", **SMALL}, "toy", "test")
    assert (m.num_kv_heads, m.head_dim, m.tie_word_embeddings, m.max_position_embeddings) == (4, 2, False, 2048)


def test_hand_defaults_qwen3_head_dim_128_and_qwen2_qkv_bias():
    # (both default num_key_value_heads to 32, not to the heads: give it)
    assert model_from_config({"model_type": "qwen3", **SMALL, "num_key_value_heads": 2}, "t", "t").head_dim == 128
    qwen2 = model_from_config({"model_type": "qwen2", **SMALL, "num_key_value_heads": 2}, "t", "t")
    assert (qwen2.attention_bias, qwen2.attention_out_bias) == (True, False)


def test_hand_defaults_gpt2_inner_is_4h_and_tied():
    m = model_from_config({"model_type": "gpt2", "n_embd": 8, "n_head": 2}, "t", "t")
    assert (m.intermediate_size, m.num_layers, m.max_position_embeddings, m.tie_word_embeddings) == (32, 12, 1024, True)


@pytest.mark.parametrize("family", FAMILIES)
def test_defaults_equal_transformers(family):
    """A config holding only model_type gets exactly the sizes transformers' config class fills in."""
    ours = model_from_config({"model_type": family}, family, "test")
    hf = _hf_config({"model_type": family})
    heads = hf.num_attention_heads
    assert ours.hidden_size == hf.hidden_size
    assert ours.num_layers == hf.num_hidden_layers
    assert ours.num_heads == heads
    assert ours.num_kv_heads == (getattr(hf, "num_key_value_heads", None) or heads)
    assert ours.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // heads)
    assert ours.vocab_size == hf.vocab_size
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    if family == "gpt2":
        assert ours.intermediate_size == (hf.n_inner or 4 * hf.hidden_size)
    elif family == "bloom":
        assert ours.intermediate_size == 4 * hf.hidden_size
    else:
        assert ours.intermediate_size == hf.intermediate_size
    if family != "bloom":
        assert ours.max_position_embeddings == hf.max_position_embeddings
    if family == "gpt_neox":
        assert ours.rotary_pct == hf.rope_parameters["partial_rotary_factor"]
        assert ours.parallel_residual == hf.use_parallel_residual
    if family == "mixtral":
        assert (ours.num_experts, ours.num_experts_per_tok) == (hf.num_local_experts, hf.num_experts_per_tok)
    _assert_dropouts_as_transformers(ours, hf)


def _assert_dropouts_as_transformers(ours, hf):
    """The probabilities the modules' Dropout layers / dropout= arguments get from the config."""
    if ours.family == "gpt2":
        assert (ours.hidden_dropout, ours.attention_dropout, ours.embedding_dropout) == (
            hf.resid_pdrop, hf.attn_pdrop, hf.embd_pdrop)
    elif ours.family in ("gpt_neox", "bloom"):
        embedding = hf.hidden_dropout if ours.family == "gpt_neox" else 0.0
        assert (ours.hidden_dropout, ours.attention_dropout, ours.embedding_dropout) == (
            hf.hidden_dropout, hf.attention_dropout, embedding)
    else:
        assert (ours.hidden_dropout, ours.attention_dropout, ours.embedding_dropout) == (0.0, hf.attention_dropout, 0.0)


@pytest.mark.parametrize(
    "cfg",
    [
        {"model_type": "gpt2", "resid_pdrop": 0.2, "attn_pdrop": 0.0, "embd_pdrop": 0.3},
        {"model_type": "gpt_neox", "hidden_dropout": 0.2, "attention_dropout": 0.1},
        {"model_type": "bloom", "hidden_dropout": 0.2, "attention_dropout": 0.1},
        {"model_type": "llama", "attention_dropout": 0.1},
    ],
)
def test_dropouts_as_transformers(cfg):
    _assert_dropouts_as_transformers(model_from_config(cfg, "t", "t"), _hf_config(cfg))


@pytest.mark.parametrize(
    "cfg",
    [
        {"model_type": "gpt_neox", "rotary_pct": 0.5},
        {"model_type": "gpt_neox", "rotary_pct": 0.5, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                                           "partial_rotary_factor": 0.3}},
        {"model_type": "gpt_neox", "use_parallel_residual": False},
    ],
)
def test_gpt_neox_rotary_and_residual_as_transformers(cfg):
    ours, hf = model_from_config(cfg, "t", "t"), _hf_config(cfg)
    assert ours.rotary_pct == hf.rope_parameters["partial_rotary_factor"]
    assert ours.parallel_residual == hf.use_parallel_residual


def test_bloom_n_embed_and_gpt2_generic_keys_as_transformers():
    bloom = {"model_type": "bloom", "n_embed": 32, "n_layer": 3, "num_attention_heads": 4}
    assert model_from_config(bloom, "t", "t").hidden_size == _hf_config(bloom).hidden_size == 32
    gpt2 = {"model_type": "gpt2", "hidden_size": 12, "num_hidden_layers": 3, "num_attention_heads": 2,
            "max_position_embeddings": 77}
    ours, hf = model_from_config(gpt2, "t", "t"), _hf_config(gpt2)
    assert (ours.hidden_size, ours.num_layers, ours.num_heads, ours.max_position_embeddings) == (
        hf.n_embd, hf.n_layer, hf.n_head, hf.n_positions)


def test_seed_config_is_the_176b_preset():
    # The seed file says architectures GPT2Model, no model_type, generic keys, no n_inner → gpt2 with 4h MLP.
    seed = load_config_file(SEED_CONFIG)
    preset = load_model("176b")
    assert seed.family == "gpt2" and seed.intermediate_size == 4 * 12288
    assert parameter_tensors(seed) == parameter_tensors(preset)


def test_transformers_config_of_the_seed():
    keys = transformers_config(json.loads(SEED_CONFIG.read_text()))
    assert keys["model_type"] == "gpt2"
    hf = _hf_config(keys)
    assert (hf.n_embd, hf.n_layer, hf.n_head, hf.n_positions, hf.n_inner) == (12288, 96, 96, 32768, None)


def test_seed_config_matches_gpt2config_on_meta():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = json.loads(SEED_CONFIG.read_text())
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.GPT2Config(**cfg))
    theirs = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert [(t.name, t.shape) for t in parameter_tensors(load_config_file(SEED_CONFIG))] == theirs


# ---- bad input: one InputError naming the config key ----

@pytest.mark.parametrize(
    ("cfg", "field"),
    [
        ({"model_type": "t5"}, "model.model_type"),
        ({"hidden_size": 8}, "model.model_type"),
        ({"architectures": ["LlamaForCausalLM"]}, "model.model_type"),
        ({"model_type": "llama", "hidden_size": 0}, "model.hidden_size"),
        ({"model_type": "llama", "hidden_size": -4096}, "model.hidden_size"),
        ({"model_type": "llama", "hidden_size": 4096.0}, "model.hidden_size"),
        ({"model_type": "llama", "num_hidden_layers": True}, "model.num_hidden_layers"),
        ({"model_type": "llama", "vocab_size": "32000"}, "model.vocab_size"),
        ({"model_type": "llama", "intermediate_size": 2**40}, "model.intermediate_size"),
        ({"model_type": "llama", "tie_word_embeddings": "yes"}, "model.tie_word_embeddings"),
        ({"model_type": "llama", "num_attention_heads": 3}, "model.num_attention_heads"),
        ({"model_type": "gpt2", "n_head": 0}, "model.n_head"),
        ({"model_type": "gpt2", "num_attention_heads": 5}, "model.num_attention_heads"),
        ({"model_type": "gpt2", "n_embd": 768, "hidden_size": 1024}, "model.hidden_size"),
        ({"model_type": "gpt2", "add_cross_attention": True}, "model.add_cross_attention"),
        ({"model_type": "bloom", "n_layer": -1}, "model.n_layer"),
        ({"model_type": "gpt_neox", "rotary_pct": 1.5}, "model.rotary_pct"),
        ({"model_type": "mixtral", "num_local_experts": 0}, "model.num_local_experts"),
        ({"model_type": "gpt2", "attn_pdrop": 1.0}, "model.attn_pdrop"),
        ({"model_type": "llama", "attention_dropout": -0.1}, "model.attention_dropout"),
        ({"model_type": "mixtral", "num_experts": 2, "num_experts_per_tok": 3}, "model.num_experts_per_tok"),
    ],
)
def test_bad_config_names_the_key(cfg, field):
    with pytest.raises(InputError) as err:
        model_from_config(cfg, "bad", "test")
    assert err.value.field == field
    assert "\n" not in str(err.value)


def test_gqa_must_divide_heads():
    with pytest.raises(InputError) as err:
        model_from_config({"model_type": "llama", **SMALL, "num_key_value_heads": 3}, "bad", "test")
    assert err.value.field == "model.num_key_value_heads"
    with pytest.raises(InputError) as err:  # Qwen2Config defaults num_key_value_heads to 32, which 4 heads can't use
        model_from_config({"model_type": "qwen2", **SMALL}, "bad", "test")
    assert err.value.field == "model.num_key_value_heads"


def test_unknown_model_type_lists_allowed():
    with pytest.raises(InputError, match="allowed: llama, mistral, qwen2"):
        model_from_config({"model_type": "falcon"}, "bad", "test")


@pytest.mark.parametrize("text", ["{", "[1, 2]", "", "\"llama\"", "{\"model_type\": \"llama\",}", "[" * 100_000])
def test_malformed_json_file_is_one_line_naming_the_file(tmp_path, monkeypatch, text):
    # a relative name: an error shortens a path of over 80 characters (as a pytest-xdist worker's tmp_path can be)
    monkeypatch.chdir(tmp_path)
    path = Path("config.json")
    path.write_text(text)
    with pytest.raises(InputError) as err:
        load_config_file(path)
    assert err.value.field == "model" and str(path) in str(err.value) and "\n" not in str(err.value)


def test_missing_and_binary_files(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        load_config_file(tmp_path / "nope.json")
    path = tmp_path / "bin.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(InputError):
        load_config_file(path)


_junk = st.one_of(st.none(), st.booleans(), st.integers(-10, 0), st.floats(allow_nan=True), st.text(max_size=5),
                  st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=2), st.integers(), max_size=2))


@settings(max_examples=200, deadline=None)
@given(family=st.sampled_from(FAMILIES), key=st.sampled_from(
    ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size", "n_embd",
     "n_layer", "n_head", "n_positions", "max_position_embeddings", "num_local_experts", "tie_word_embeddings"]),
    value=_junk)
def test_junk_values_never_escape_as_other_errors(family, key, value):
    try:
        spec = model_from_config({"model_type": family, key: value}, "junk", "test")
    except InputError as err:
        assert "\n" not in str(err)
    else:  # a junk value can only be accepted where the family ignores the key (or None means "default")
        assert spec.family == family


# ---- the families of issue 16: transformers' derivations, and their bad values ----

def test_gemma_layer_types_and_gemma3_text_config_as_transformers():
    g2 = {"model_type": "gemma2", "num_hidden_layers": 5}
    g3 = {"model_type": "gemma3_text", "num_hidden_layers": 8, "sliding_window_pattern": 3, "sliding_window": 512}
    for cfg in (g2, g3):
        ours, hf = model_from_config(cfg, "t", "t"), _hf_config(cfg)
        assert list(ours.layer_types) == hf.layer_types
        assert [ours.is_sliding_layer(i) for i in range(ours.num_layers)] == [
            t == "sliding_attention" for t in hf.layer_types]
        assert (ours.sliding_window, ours.final_logit_softcapping, ours.query_pre_attn_scalar) == (
            hf.sliding_window, hf.final_logit_softcapping, hf.query_pre_attn_scalar)
        assert ours.pad_token_id == hf.pad_token_id and ours.scale_embeddings
    assert model_from_config(g2, "t", "t").attn_logit_softcapping == _hf_config(g2).attn_logit_softcapping
    wrapped = model_from_config({"model_type": "gemma3", "text_config": {k: v for k, v in g3.items()
                                                                          if k != "model_type"}}, "t", "src")
    assert wrapped.model_copy(update={"source": "src"}) == model_from_config(g3, "t", "src")
    assert "vision tower" in wrapped.source
    hf3 = _hf_config({"model_type": "gemma3", "text_config": {"num_hidden_layers": 8}}).text_config
    assert list(model_from_config({"model_type": "gemma3", "text_config": {"num_hidden_layers": 8}}, "t",
                                  "t").layer_types) == hf3.layer_types


@pytest.mark.parametrize("cfg", [
    {"model_type": "qwen3_moe", "head_dim": 128, "num_local_experts": 16, "num_experts_per_tok": 4},
    {"model_type": "qwen3_moe", "use_sliding_window": True, "sliding_window": 1024, "mlp_only_layers": [0, 3]},
    {"model_type": "deepseek_v3", "num_local_experts": 64, "q_lora_rank": None, "num_key_value_heads": None},
    {"model_type": "phi3", "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
    {"model_type": "olmo2", "num_key_value_heads": 8},
])
def test_moe_mla_and_rope_fields_as_transformers(cfg):
    ours, hf = model_from_config(cfg, "t", "t"), _hf_config(cfg)
    assert ours.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    assert ours.num_kv_heads == hf.num_key_value_heads
    assert ours.sliding_window == getattr(hf, "sliding_window", None)
    if ours.family == "qwen3_moe":
        assert (ours.num_experts, ours.num_experts_per_tok, ours.moe_intermediate_size) == (
            hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size)
        assert [ours.is_moe_layer(i) for i in range(ours.num_layers)] == [
            i not in hf.mlp_only_layers and (i + 1) % hf.decoder_sparse_step == 0 for i in range(hf.num_hidden_layers)]
    if ours.family == "deepseek_v3":
        assert ours.num_experts == hf.n_routed_experts and ours.q_lora_rank == hf.q_lora_rank
        assert ours.q_dim == hf.num_attention_heads * hf.qk_head_dim
        assert [ours.is_moe_layer(i) for i in range(ours.num_layers)] == [
            i >= hf.first_k_dense_replace for i in range(hf.num_hidden_layers)]
    if ours.family == "phi3":
        assert ours.rotary_pct == hf.rope_parameters["partial_rotary_factor"] and ours.fused_qkv


NEW_FAMILY_BAD = [
    ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 5}, "model.num_experts_per_tok"),
    ({"model_type": "qwen3_moe", "num_local_experts": 4, "num_experts_per_tok": 5}, "model.num_experts_per_tok"),
    ({"model_type": "deepseek_v3", "n_routed_experts": 8, "n_group": 2, "topk_group": 1, "num_experts_per_tok": 9},
     "model.num_experts_per_tok"),
    ({"model_type": "deepseek_v3", "kv_lora_rank": 0}, "model.kv_lora_rank"),
    ({"model_type": "deepseek_v3", "kv_lora_rank": None}, "model.kv_lora_rank"),
    ({"model_type": "deepseek_v3", "q_lora_rank": 0}, "model.q_lora_rank"),
    ({"model_type": "deepseek_v3", "n_group": 3}, "model.n_group"),
    ({"model_type": "deepseek_v3", "topk_group": 9}, "model.topk_group"),
    ({"model_type": "deepseek_v3", "num_key_value_heads": 8}, "model.num_key_value_heads"),
    ({"model_type": "deepseek_v3", "first_k_dense_replace": -1}, "model.first_k_dense_replace"),
    ({"model_type": "gemma2", "sliding_window": 0}, "model.sliding_window"),
    ({"model_type": "gemma2", "sliding_window": None}, "model.sliding_window"),
    ({"model_type": "gemma3_text", "sliding_window": 0}, "model.sliding_window"),
    ({"model_type": "gemma3", "text_config": {"sliding_window": 0}}, "model.text_config.sliding_window"),
    ({"model_type": "gemma3", "text_config": [1]}, "model.text_config"),
    ({"model_type": "gemma3_text", "sliding_window_pattern": 0}, "model.sliding_window_pattern"),
    ({"model_type": "gemma2", "num_hidden_layers": 2, "layer_types": ["full_attention"]}, "model.layer_types"),
    ({"model_type": "gemma2", "layer_types": "sliding"}, "model.layer_types"),
    ({"model_type": "gemma2", "final_logit_softcapping": 0}, "model.final_logit_softcapping"),
    ({"model_type": "gemma2", "num_attention_heads": 7, "num_key_value_heads": 1}, "model.num_attention_heads"),
    ({"model_type": "gemma2", "use_bidirectional_attention": True}, "model.use_bidirectional_attention"),
    ({"model_type": "phi3", "sliding_window": 0}, "model.sliding_window"),
    ({"model_type": "phi3", "vocab_size": 100}, "model.pad_token_id"),
    ({"model_type": "phi3", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "model.rope_scaling"),
    ({"model_type": "phi3", "partial_rotary_factor": 0}, "model.partial_rotary_factor"),
    ({"model_type": "qwen3_moe", "use_sliding_window": True, "sliding_window": 0}, "model.sliding_window"),
    ({"model_type": "qwen3_moe", "decoder_sparse_step": 0}, "model.decoder_sparse_step"),
    ({"model_type": "qwen3_moe", "mlp_only_layers": [-1]}, "model.mlp_only_layers"),
    ({"model_type": "qwen3_moe", "router_aux_loss_coef": -1}, "model.router_aux_loss_coef"),
    ({"model_type": "olmo2", "pad_token_id": 50304}, "model.pad_token_id"),
    ({"model_type": "olmo2", "hidden_size": 16}, "model.num_attention_heads"),
    ({"model_type": "llama", "vocab_size": 8, "pad_token_id": 8}, "model.pad_token_id"),
]


@pytest.mark.parametrize(("cfg", "field"), NEW_FAMILY_BAD)
def test_bad_new_family_config_names_the_key(cfg, field):
    with pytest.raises(InputError) as err:
        model_from_config(cfg, "bad", "test")
    assert err.value.field == field
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("cfg", "field"), [case for case in NEW_FAMILY_BAD if case[1] in (
    "model.num_experts_per_tok", "model.kv_lora_rank", "model.sliding_window", "model.text_config.sliding_window")])
def test_bad_new_fields_exit_2_with_one_line(tmp_path, cfg, field):
    """`memplan estimate --model CONFIG.json` on the issue's bad values: exit 2, one line naming model.<key>."""
    from test_bad_input import run_main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    rc, out, err = run_main(["estimate", "--model", str(path), "--seq", "1024", "--gpus", "8", "--sp", "1"])
    assert rc == 2 and out == ""
    # the CLI names a config key under its flag: model.<key> is shown as "--model <key>"
    shown = field.replace("model.", "--model ", 1)
    assert err.count("\n") == 1 and err.startswith(f"memplan: error: {shown}: "), err


@settings(max_examples=150, deadline=None)
@given(family=st.sampled_from(["gemma2", "gemma3_text", "gemma3", "phi3", "qwen3_moe", "olmo2", "deepseek_v3"]),
       key=st.sampled_from(["layer_types", "sliding_window", "final_logit_softcapping", "mlp_only_layers",
                            "decoder_sparse_step", "num_experts", "n_routed_experts", "kv_lora_rank", "q_lora_rank",
                            "n_group", "topk_group", "first_k_dense_replace", "pad_token_id", "rope_scaling",
                            "text_config", "head_dim", "norm_topk_prob", "moe_intermediate_size"]),
       value=_junk)
def test_junk_in_new_fields_never_escapes(family, key, value):
    try:
        spec = model_from_config({"model_type": family, key: value}, "junk", "test")
    except InputError as err:
        assert "\n" not in str(err)
    else:
        assert spec.family in (family, "gemma3_text")
