"""LoRA / frozen parameters in the phase model (estimator/lora.py): toys by hand, peft's real modules on the CPU
(parameter counts, and the tensors autograd saves, through saved_tensors_hooks as tools/saved_tensors.py does),
hypothesis properties of the state bytes, and the measured LoRA rows of the fit split (never the check split).
"""

from __future__ import annotations

import sys
import weakref
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.accuracy import compare_rows, iter_rows, job_of_row
from memplan.estimator.activations import layer_terms
from memplan.estimator.head import rope_terms
from memplan.estimator.layout import rank_share
from memplan.estimator.lora import apply, layer_place
from memplan.estimator.train_set import job_train_set, train_set
from memplan.estimator.phases import model_states
from memplan.hfconfig import model_from_config
from memplan.presets import load_model
from memplan.specs import Job, Layout, LoraSpec, TrainingSpec, ZeroSpec

ROWS = Path(__file__).resolve().parent.parent / "benchmarks" / "accuracy"
TOOLS = Path(__file__).resolve().parent.parent / "tools"
SEQ = 64
#: the brief's worst-case bar on peak allocated (tests/test_accuracy.py)
ALLOC_WORST = 0.03


def _tiny(family: str):
    sys.path.insert(0, str(TOOLS))
    from saved_tensors import FAMILIES

    return dict(FAMILIES[family]), model_from_config(dict(FAMILIES[family]), family, "test")


def _job(model, lora=None, freeze=(), stage=0, world=1, checkpointing="none", dtype="bf16") -> Job:
    training = TrainingSpec(seq_len=SEQ, lora=lora, freeze=freeze, zero=ZeroSpec(stage=stage),
                            checkpointing=checkpointing, dtype=dtype)
    return Job(model=model, training=training, layout=Layout(world=world))


# ---- toys by hand ----------------------------------------------------------------------------------------


def test_one_adapted_linear_states_by_hand():
    """llama toy (h 256, q 256, 2 layers), r 4 on q_proj only: A (4 × 256) and B (256 × 4) per layer. ZeRO-0
    bf16 AdamW: fp32 master and two fp32 states of the adapters, their bf16 grads; every base weight in bf16."""
    _, m = _tiny("llama")
    job = _job(m, LoraSpec(rank=4, targets=("q_proj",)))
    adapters = m.num_layers * (4 * m.hidden_size + m.q_dim * 4)
    ts = job_train_set(job.training, m)
    assert ts.trainable_params == adapters
    base = sum(t.numel for t, _ in train_set(m, None, ()).tensors)
    assert ts.frozen_params == base
    st = model_states(job, rank_share(job))
    assert (st.master_fp32, st.optimizer_states, st.grads_full) == (4 * adapters, 8 * adapters, 2 * adapters)
    assert st.params_16bit == 2 * (base + adapters)


def test_zero2_and_zero3_partition_the_trainable_parameters_only():
    _, m = _tiny("llama")
    lora = LoraSpec(rank=4, targets=("q_proj", "v_proj"))
    ts = train_set(m, lora, ())
    adapters = ts.trainable_params
    z2 = model_states(_job(m, lora, stage=2, world=2), rank_share(_job(m, lora, stage=2, world=2)))
    pad = -(-adapters // 4) * 4  # stage_1_and_2.py: the flat group padded to 2N elements
    assert z2.master_fp32 == 4 * pad // 2 and z2.optimizer_states == 8 * pad // 2
    assert z2.params_16bit == 2 * pad + 2 * ts.frozen_params
    z3 = model_states(_job(m, lora, stage=3, world=2), rank_share(_job(m, lora, stage=3, world=2)))
    trained = sum(-(-t.numel // 2) for t, trains in ts.tensors if trains)
    frozen = sum(-(-t.numel // 2) for t, trains in ts.tensors if not trains)
    assert z3.master_fp32 == 4 * trained and z3.grads_resident == 2 * trained
    assert z3.params_16bit == 2 * (trained + frozen)


def test_bias_dora_and_modules_to_save_by_hand():
    """qwen2 toy (q/k/v biases): bias lora_only trains the adapted linears' biases; DoRA adds a magnitude
    (out features) per adapted linear; modules_to_save lm_head adds a trainable copy beside the frozen one."""
    _, m = _tiny("qwen2")
    plain = train_set(m, LoraSpec(rank=2, targets=("q_proj",)), ()).trainable_params
    assert plain == m.num_layers * (2 * m.hidden_size + m.q_dim * 2)
    assert train_set(m, LoraSpec(rank=2, targets=("q_proj",), bias="lora_only"), ()).trainable_params == (
        plain + m.num_layers * m.q_dim)
    assert train_set(m, LoraSpec(rank=2, targets=("q_proj",), use_dora=True), ()).trainable_params == (
        plain + m.num_layers * m.q_dim)
    saved = train_set(m, LoraSpec(rank=2, targets=("q_proj",), modules_to_save=("lm_head",)), ())
    head = m.vocab_size * m.hidden_size if not m.tie_word_embeddings else 0
    assert saved.trainable_params == plain + head
    assert saved.frozen_params == train_set(m, LoraSpec(rank=2, targets=("q_proj",)), ()).frozen_params


def test_saved_tensors_by_hand():
    """llama toy, q_proj adapted with r 4, bf16. Against full training the layer loses both norms' bf16
    normed x (weight · x with a frozen weight), the MLP's input and down_proj's input (frozen linears), and
    gains lora_A's r-wide output; q/k/v's input stays (lora_A keeps it, undropped). With dropout it is
    lora_A's own dropped copy and mask instead."""
    _, m = _tiny("llama")
    h, i, b, r = m.hidden_size, m.intermediate_size, 2, 4
    full = sum(t.bytes_per_token for t in layer_terms(m, b, "sdpa", SEQ))
    lora = LoraSpec(rank=r, targets=("q_proj",))
    place = layer_place(_job(m, lora).training, m)
    kept = sum(t.bytes_per_token for t in apply(layer_terms(m, b, "sdpa", SEQ), place, b, lora))
    assert kept == full - 2 * b * h - b * h - b * i + b * r
    dropped = LoraSpec(rank=r, targets=("q_proj",), dropout=0.1)
    with_dropout = sum(t.bytes_per_token for t in apply(layer_terms(m, b, "sdpa", SEQ), place, b, dropped))
    assert with_dropout == kept - b * h + (b + 1) * h


# ---- peft itself on the CPU --------------------------------------------------------------------------------


def _peft_model(cfg: dict, lora: LoraSpec | None, freeze_names=frozenset(), cast: bool = True):
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**cfg)
    config.use_cache = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.train()
    for name, p in model.named_parameters():
        if name in freeze_names:
            p.requires_grad_(False)
    if lora is not None:
        targets = "all-linear" if "all-linear" in lora.targets else list(lora.targets)
        model = get_peft_model(model, LoraConfig(r=lora.rank, target_modules=targets, lora_dropout=lora.dropout,
                                                 bias=lora.bias, use_dora=lora.use_dora, task_type="CAUSAL_LM",
                                                 modules_to_save=list(lora.modules_to_save) or None))
        if cast:  # DeepSpeedEngine._cast_module_mixed_precision (ZeRO 0-2): the fp32 adapters to bf16
            model.to(torch.bfloat16)
    return model


CASES = [("llama", LoraSpec(rank=4, targets=("q_proj", "v_proj")), True),
         ("llama", LoraSpec(rank=8, targets=("all-linear",), dropout=0.1), True),
         ("llama", LoraSpec(rank=4, targets=("q_proj", "v_proj")), False),  # ZeRO-3: adapters stay fp32
         ("gpt_neox", LoraSpec(rank=4, targets=("query_key_value",)), True),
         ("gpt_neox", LoraSpec(rank=4, targets=("dense_4h_to_h",), dropout=0.05), True),
         ("qwen2", LoraSpec(rank=4, targets=("k_proj", "down_proj"), bias="all"), True)]


#: DoRA and modules_to_save: counted (their saved tensors are not modelled beyond the adapters' own)
COUNTED = [*CASES, ("llama", LoraSpec(rank=4, targets=("q_proj",), use_dora=True), True),
           ("llama", LoraSpec(rank=4, targets=("q_proj",), modules_to_save=("lm_head",)), True),
           ("qwen2", LoraSpec(rank=2, targets=("q_proj", "o_proj"), bias="lora_only"), True)]


@pytest.mark.parametrize("family,lora,cast", COUNTED)
def test_parameter_counts_match_peft(family, lora, cast):
    cfg, m = _tiny(family)
    model = _peft_model(cfg, lora, cast=cast)
    ts = train_set(m, lora, ())
    assert ts.trainable_params == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert ts.frozen_params == sum(p.numel() for p in model.parameters() if not p.requires_grad)


def _saved_per_layer(model, layers, seq: int) -> dict[str, int]:
    """Bytes of the unique non-parameter storages autograd keeps at the end of forward, per decoder layer."""
    import torch

    where = {"now": "outside"}
    saved = []

    def pack(t):
        saved.append((where["now"], weakref.ref(t), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()))
        return t

    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_pre_hook(lambda mod, a, i=i: where.update(now=f"layer{i}")))
        hooks.append(layer.register_forward_hook(lambda mod, a, o: where.update(now="outside")))
    ids = torch.randint(0, 1000, (1, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids)
    for hook in hooks:
        hook.remove()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    alive: dict[str, dict[int, int]] = {}
    for place, ref, ptr, nbytes in saved:
        if ref() is not None and ptr not in params:
            alive.setdefault(place, {}).setdefault(ptr, nbytes)
    del out
    return {k: sum(v.values()) for k, v in alive.items()}


@pytest.mark.parametrize("family,lora,cast", CASES)
def test_saved_tensors_match_peft_on_cpu(family, lora, cast):
    """Each layer's saved bytes equal lora.apply on the family's terms: layer 0 with its input not requiring
    grad (no checkpointing, frozen embedding), the others as every layer. The CPU's LayerNorm keeps its mean
    and rstd in the input dtype (2 + 2 bytes, CUDA: fp32); the tool counts RoPE's cos/sin pair in each layer."""
    from memplan.estimator.lora import adapter_dtype_bytes

    sys.path.insert(0, str(TOOLS))
    from saved_tensors import layers_of

    cfg, m = _tiny(family)
    model = _peft_model(cfg, lora, cast=cast)
    measured = _saved_per_layer(model, layers_of(model.base_model.model), SEQ)
    job = _job(m, lora, stage=0 if cast else 3)
    a = adapter_dtype_bytes(job.training)
    terms = layer_terms(m, 2, "sdpa", SEQ)
    rope = rope_terms(m, 2)[0].bytes_per_token if m.position_embedding == "rope" else 0
    place = layer_place(job.training, m)
    for i, first in ((0, False), (1, True)):
        kept = apply(terms, place, 2, lora, first, a, m.parallel_residual, kernel="cpu")
        stats = sum(4 for t in kept if t.name.endswith(".stats"))
        rotates = any(t.name.startswith("attn.") for t in kept)  # a grad-free attention keeps no cos/sin
        expected = (sum(t.bytes_per_token for t in kept) - stats + rope * rotates) * SEQ
        assert measured[f"layer{i}"] == expected, (i, [t.name for t in kept])


def test_frozen_groups_match_torch_on_cpu():
    """--freeze embeddings,norms without an adapter: the norms' normed x and the embedding's indices go."""
    from memplan.params import frozen_names

    sys.path.insert(0, str(TOOLS))
    from saved_tensors import layers_of

    cfg, m = _tiny("llama")
    names = frozen_names(m, ("embeddings", "norms"))
    model = _peft_model(cfg, None, names)
    measured = _saved_per_layer(model, layers_of(model), SEQ)
    job = _job(m, freeze=("embeddings", "norms"))
    terms = layer_terms(m, 2, "sdpa", SEQ)
    rope = rope_terms(m, 2)[0].bytes_per_token
    for i, first in ((0, False), (1, True)):
        kept = apply(terms, layer_place(job.training, m), 2, None, first)
        assert measured[f"layer{i}"] == (sum(t.bytes_per_token for t in kept) + rope) * SEQ, i
    assert job_train_set(job.training, m).frozen_params == sum(
        p.numel() for p in model.parameters() if not p.requires_grad)


# ---- properties ----------------------------------------------------------------------------------------------


def _state_bytes(job: Job) -> int:
    s = model_states(job, rank_share(job))
    return s.params_16bit + s.master_fp32 + s.optimizer_states + s.grads_resident + s.grads_full + s.host_bytes


TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@settings(max_examples=60, deadline=None)
@given(stage=st.sampled_from([0, 1, 2, 3]), world=st.sampled_from([1, 2, 8]), rank=st.integers(1, 256),
       targets=st.sets(st.sampled_from(TARGETS), min_size=1), extra=st.sampled_from(TARGETS))
def test_lora_never_costs_more_state_than_full_training(stage, world, rank, targets, extra):
    """LoRA holds no more state than full training of the same job; a superset of targets or a larger rank
    (more trainable parameters) never holds less."""
    m = load_model("qwen2.5-0.5b")
    lora = LoraSpec(rank=rank, targets=tuple(sorted(targets)))
    adapted = _state_bytes(_job(m, lora, stage=stage, world=world))
    assert adapted <= _state_bytes(_job(m, None, stage=stage, world=world))
    wider = LoraSpec(rank=rank, targets=tuple(sorted(targets | {extra})))
    assert _state_bytes(_job(m, wider, stage=stage, world=world)) >= adapted
    assert _state_bytes(_job(m, LoraSpec(rank=rank + 1, targets=lora.targets), stage=stage, world=world)) >= adapted


# ---- the measured rows (fit split and hand-written matrices only) ----------------------------------------------


def _fit_rows(lora_only: bool) -> list[dict]:
    out = []
    for row in iter_rows(ROWS):
        if row.get("split") == "check" or row.get("status") != "ok":
            continue
        t = job_of_row(row).training
        if t.lora is not None or (not lora_only and t.freeze):
            out.append(row)
    return out


def test_measured_rows_parameter_counts():
    """verify records requires_grad counts (worker.py); train_set gives the same on every fit LoRA/freeze row."""
    rows = [r for r in _fit_rows(False) if r.get("trainable_params") is not None]
    assert rows
    for row in rows:
        job = job_of_row(row)
        ts = job_train_set(job.training, job.model)
        assert (ts.trainable_params, ts.frozen_params) == (row["trainable_params"], row["frozen_params"]), row["name"]


def _lora_points(moe: bool):
    rows = [r for r in _fit_rows(True) if bool(job_of_row(r).model.num_experts) == moe]
    return compare_rows(rows)


def test_measured_lora_rows_within_the_bar():
    """Dense families: issue 14's bars (1 % median, 3 % worst) on every studied LoRA row."""
    points = _lora_points(moe=False)
    assert len(points) >= 12
    worst = max(points, key=lambda c: abs(c.error))
    assert abs(worst.error) <= ALLOC_WORST, (worst.name, f"{worst.error:+.2%}")
    errors = sorted(abs(c.error) for c in points)
    assert errors[len(errors) // 2] <= 0.01


def test_measured_moe_lora_rows_within_the_bar():
    """MoE families (peft's lora.ParamWrapper on the router and the fused experts under ZeRO 0-2, lora.Linear on
    the attention): the same bar on every studied LoRA row."""
    points = _lora_points(moe=True)
    assert points
    assert max(abs(c.error) for c in points) <= ALLOC_WORST


def test_estimate_json_shows_trainable_and_frozen_counts(capsys):
    """issue 14: --json carries trainable_params and frozen_params; the adapters add to the base, which freezes."""
    import json as _json

    from memplan.cli import main as cli_main

    def counts(*extra):
        assert cli_main(["estimate", "--model", "qwen2.5-0.5b", "--seq", "1024", "--json", *extra]) == 0
        d = _json.loads(capsys.readouterr().out)
        return d["trainable_params"], d["frozen_params"]

    full_trainable, full_frozen = counts()
    trainable, frozen = counts("--lora-rank", "8", "--lora-targets", "q_proj,v_proj")
    assert full_frozen == 0 and frozen == full_trainable  # the whole base is frozen
    assert 0 < trainable < full_trainable / 100


@pytest.mark.parametrize(("argv", "adapter", "field"), [
    (["--lora-rank", "0", "--lora-targets", "q_proj"], None, "--lora-rank"),
    (["--lora-rank", "-8", "--lora-targets", "q_proj"], None, "--lora-rank"),
    (["--lora-rank", "8", "--lora-targets", "foo_proj"], None, "--lora-targets"),
    (["--lora-rank", "8", "--lora-dropout", "1.5"], None, "--lora-dropout"),
    (["--peft-config", "{FILE}"], '{"r": 8, "target_modules": ', "--peft-config"),
    (["--peft-config", "{FILE}"], '{"r": 0, "target_modules": ["q_proj"]}', "--peft-config"),
    (["--peft-config", "{FILE}"], '{"r": 8, "target_modules": ["foo_proj"]}', "--peft-config"),
    (["--peft-config", "{FILE}"], '[8, "q_proj"]', "--peft-config"),
])
def test_bad_adapter_input_exits_2_with_one_line(argv, adapter, field, tmp_path, capsys):
    """issue 14: a rank of 0, a target the model lacks, a malformed adapter_config.json → exit 2, one line."""
    from memplan.cli import main as cli_main

    path = tmp_path / "adapter_config.json"
    if adapter is not None:
        path.write_text(adapter)
    argv = [str(path) if a == "{FILE}" else a for a in argv]
    with pytest.raises(SystemExit) as exc:
        raise SystemExit(cli_main(["estimate", "--model", "llama-3.2-1b", *argv]))
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert exc.value.code == 2 and captured.out == ""
    assert len(lines) == 1 and lines[0].startswith(f"memplan: error: {field}"), lines


def test_plan_searches_with_the_adapter_fixed(capsys):
    """issue 14: plan keeps --lora-* fixed; a ranked row's figure is the estimate of that row's job with the adapter."""
    import json as _json

    from memplan.cli import main as cli_main

    common = ["--model", "llama-3.2-1b", "--gpus", "8", "--seq", "2048"]
    assert cli_main(["plan", *common, "--gpu", "h100-80g", "--lora-rank", "8", "--lora-targets", "q_proj,v_proj",
                     "--top", "2", "--json"]) == 0
    plan = _json.loads(capsys.readouterr().out)
    assert any("adapter fixed: LoRA rank 8" in a for a in plan["assumptions"]["notes"])
    row = plan["candidates"][0]
    flags = ["--zero", str(row["zero"]), "--tp", str(row["tp"]), "--pp", str(row["pp"]), "--sp", str(row["sp"]),
             "--offload-optimizer", row["offload_optimizer"], "--offload-param", row["offload_param"],
             "--checkpointing", row["checkpointing"], "--attention", row["attention"],
             "--micro-batch", str(row["micro_batch"]), "--grad-accum", str(row["grad_accum"])]
    assert cli_main(["estimate", *common, *flags, "--lora-rank", "8", "--lora-targets", "q_proj,v_proj", "--json"]) == 0
    with_adapter = _json.loads(capsys.readouterr().out)
    assert cli_main(["estimate", *common, *flags, "--json"]) == 0
    full = _json.loads(capsys.readouterr().out)
    assert row["peak_allocated_bytes"] == with_adapter["peak_allocated_bytes"] < full["peak_allocated_bytes"]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize(("targets", "refused"), [(("all-linear",), True), (("q_proj", "v_proj"), False)])
def test_moe_dropout_refusal_is_pefts(family, targets, refused):
    """peft turns all-linear on a fused-expert MoE into lora.ParamWrapper targets (the router's weight, the experts),
    and ParamWrapper refuses lora_dropout != 0: memplan refuses what the installed peft refuses, and only that."""
    from memplan.estimator import model_check
    from memplan.hfconfig import model_from_config as from_config
    from memplan.peftconfig import check_adapter_options

    cfg = dict(model_check.TINY[family])
    m = from_config(cfg, family, "test")
    lora = LoraSpec(rank=4, targets=targets, dropout=0.05)
    try:
        check_adapter_options(m.family, targets, lora.dropout)
        ours = False
    except ValueError:
        ours = True
    assert ours == refused
    pytest.importorskip("peft")
    try:
        _peft_model(cfg, lora)
        theirs = False
    except ValueError as err:
        theirs = "ParamWrapper" in str(err)
    assert theirs == ours
