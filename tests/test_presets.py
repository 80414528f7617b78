"""Presets: the required set, their sources, load_model's errors, and published parameter counts."""

from __future__ import annotations

import json
import math

import pytest

from memplan.errors import InputError
from memplan.params import count_params
from memplan.presets import PRESETS_DIR, list_presets, load_model

REQUIRED = {
    "176b", "gpt3-175b", "bloom-176b", "llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b", "llama-3-70b",
    "llama-3-405b", "llama-3.2-1b", "mistral-7b", "qwen2.5-0.5b", "qwen2.5-7b", "qwen2.5-72b", "mixtral-8x7b",
    "qwen3-0.6b", "qwen3-1.7b", "pythia-1b", "bloom-560m", "bloom-1b7", "gpt2-xl", "gpt2-large", "tinymixtral",
}
#: issue 16's families
REQUIRED_FAMILIES = {
    "gemma-2-2b", "gemma-2-9b", "gemma-3-4b", "phi-3-mini", "phi-3-medium", "qwen3-30b-a3b", "olmo-2-1b", "olmo-2-7b",
    "deepseek-v3", "deepseek-v3-4l",
}

#: published parameter counts, exact (each model's Hugging Face page "Model size" / safetensors total, or paper)
PUBLISHED_EXACT = {
    "llama-2-7b": 6_738_415_616,  # meta-llama/Llama-2-7b-hf
    "llama-2-13b": 13_015_864_320,  # meta-llama/Llama-2-13b-hf
    "llama-2-70b": 68_976_648_192,  # meta-llama/Llama-2-70b-hf
    "llama-3-8b": 8_030_261_248,  # meta-llama/Meta-Llama-3-8B
    "llama-3-70b": 70_553_706_496,  # meta-llama/Meta-Llama-3-70B
    "llama-3-405b": 405_853_388_800,  # meta-llama/Llama-3.1-405B
    "llama-3.2-1b": 1_235_814_400,  # meta-llama/Llama-3.2-1B (tied embeddings counted once)
    "mistral-7b": 7_241_732_096,  # mistralai/Mistral-7B-v0.1
    "mixtral-8x7b": 46_702_792_704,  # mistralai/Mixtral-8x7B-v0.1
    "qwen2.5-0.5b": 494_032_768,  # Qwen/Qwen2.5-0.5B
    "qwen2.5-7b": 7_615_616_512,  # Qwen/Qwen2.5-7B
    "qwen2.5-72b": 72_706_203_648,  # Qwen/Qwen2.5-72B
    "pythia-1b": 1_011_781_632,  # Biderman et al. 2023 (Pythia), Table 1 / EleutherAI/pythia-1b
    "bloom-176b": 176_247_271_424,  # bigscience/bloom model card
    "bloom-560m": 559_214_592,  # bigscience/bloom-560m model card
    "bloom-1b7": 1_722_408_960,  # bigscience/bloom-1b7 model card
    "gpt2-xl": 1_557_611_200,  # openai-community/gpt2-xl
    "gpt2-large": 774_030_080,  # openai-community/gpt2-large
    "gemma-2-2b": 2_614_341_888,  # google/gemma-2-2b
    "gemma-2-9b": 9_241_705_984,  # google/gemma-2-9b
    "phi-3-mini": 3_821_079_552,  # microsoft/Phi-3-mini-4k-instruct
    "phi-3-medium": 13_960_238_080,  # microsoft/Phi-3-medium-4k-instruct
    "qwen3-30b-a3b": 30_532_122_624,  # Qwen/Qwen3-30B-A3B
    "olmo-2-1b": 1_484_916_736,  # allenai/OLMo-2-0425-1B
    "olmo-2-7b": 7_298_617_344,  # allenai/OLMo-2-1124-7B
}

#: published only as a rounded size: (nominal params, relative tolerance the rounding allows)
PUBLISHED_NOMINAL = {
    "gpt3-175b": (175e9, 0.01),  # Brown et al. 2020, Table 2.1: "175.0B"
    "176b": (176e9, 0.01),  # the seed's name for its GPT-style model
    "qwen3-0.6b": (0.6e9, 0.05),  # Qwen/Qwen3-0.6B: "Number of Parameters: 0.6B"
    "qwen3-1.7b": (1.7e9, 0.05),  # Qwen/Qwen3-1.7B: "Number of Parameters: 1.7B"
    "tinymixtral": (1e9, 0.10),  # invented: "~1B"
    # google/gemma-3-4b-pt: "4B" with its ~0.42B SigLIP vision tower, which the text preset leaves out
    "gemma-3-4b": (3.9e9, 0.01),
    # deepseek-ai/DeepSeek-V3: "671B total" for the main model (the 14B multi-token-prediction module aside)
    "deepseek-v3": (671e9, 0.001),
}


def test_required_presets_exist():
    assert REQUIRED <= set(list_presets())
    assert REQUIRED_FAMILIES <= set(list_presets())


@pytest.mark.parametrize("name", sorted(REQUIRED_FAMILIES))
def test_family_preset_source_and_count_on_meta(name):
    """Each issue-16 preset names its Hugging Face repository, and transformers builds exactly count_params."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from memplan.hfconfig import transformers_config

    transformers.logging.set_verbosity_error()
    cfg = json.loads((PRESETS_DIR / f"{name}.json").read_text())
    assert "/" in cfg["_memplan_source"].split()[0] or cfg["_memplan_source"].startswith("INVENTED")
    config = transformers.AutoConfig.for_model(**transformers_config(cfg))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == count_params(load_model(name)).total_params


def test_cut_deepseek_is_dense_then_moe():
    m, full = load_model("deepseek-v3-4l"), load_model("deepseek-v3")
    assert "INVENTED" in m.source and m.num_layers == 4 and full.num_layers == 61
    assert [m.is_moe_layer(i) for i in range(4)] == [False, False, False, True]
    assert m.model_copy(update={"num_layers": 61}) == full.model_copy(update={"name": m.name, "source": m.source})


@pytest.mark.parametrize("name", sorted(REQUIRED | REQUIRED_FAMILIES))
def test_preset_records_its_source_and_type(name):
    cfg = json.loads((PRESETS_DIR / f"{name}.json").read_text())
    assert len(cfg["_memplan_source"]) > 20
    assert cfg["model_type"] == load_model(name).family
    assert load_model(name).source == cfg["_memplan_source"]


def test_invented_preset_says_so():
    assert "INVENTED" in load_model("tinymixtral").source


@pytest.mark.parametrize("name", sorted(PUBLISHED_EXACT))
def test_parameter_count_equals_published(name):
    assert count_params(load_model(name)).total_params == PUBLISHED_EXACT[name]


@pytest.mark.parametrize("name", sorted(PUBLISHED_NOMINAL))
def test_parameter_count_near_nominal(name):
    nominal, rel = PUBLISHED_NOMINAL[name]
    assert math.isclose(count_params(load_model(name)).total_params, nominal, rel_tol=rel)


def test_seed_shape_of_176b():
    m = load_model("176b")
    assert (m.family, m.hidden_size, m.num_layers, m.num_heads, m.max_position_embeddings, m.vocab_size) == (
        "gpt2", 12288, 96, 96, 32768, 50257)


def test_unknown_preset_lists_presets():
    with pytest.raises(InputError) as err:
        load_model("llama-9")
    assert err.value.field == "model"
    assert "unknown preset 'llama-9'" in str(err.value) and "llama-2-7b" in str(err.value)
    assert "path to a config.json" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("bad", ["", "   "])
def test_empty_name(bad):
    with pytest.raises(InputError):
        load_model(bad)


def test_path_to_config(tmp_path):
    cfg = json.loads((PRESETS_DIR / "qwen3-0.6b.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in cfg.items() if k != "_memplan_source"}))
    m = load_model(str(path))
    assert m.name == str(path) and str(path) in m.source
    assert count_params(m) == count_params(load_model("qwen3-0.6b"))


def test_missing_path_is_input_error(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        load_model(str(tmp_path / "config.json"))


def test_presets_are_package_data():
    # src/memplan/models is how an installed package finds the presets (a symlink to models/ in a checkout)
    assert PRESETS_DIR.name == "models" and PRESETS_DIR.is_dir()
    assert PRESETS_DIR.parent.name == "memplan"
