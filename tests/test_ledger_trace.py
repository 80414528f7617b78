"""The estimator's autograd ledger against the real allocation order of transformers' code on the CPU.

For each tiny model, one micro-step (forward, loss, backward, parameter grads kept as .grad) is recorded with
torch's profiler (memplan.verify.cputrace) and compared, event by event, with the allocations and frees the
estimator's autograd model issues (memplan.estimator.model_check) with the CPU's attention kernels. CUDA
kernels' internal temporaries and CPU-only scalars are left out on both sides; everything else must match
exactly: sizes, order, and which allocation each free releases.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from memplan.estimator import model_check
from memplan.verify import cputrace

#: (TINY config, batch, seq, dtype, attention): attn_implementation, with ":kernel" an sdpa kernel forced
#: (torch.nn.attention.sdpa_kernel); plain sdpa runs the CPU's flash kernel (math with dropout)
CASES = [
    ("llama", 1, 128, "bf16", "sdpa"),
    ("llama", 2, 64, "bf16", "sdpa"),
    ("llama_gqa", 2, 32, "bf16", "sdpa"),
    ("llama_gqa", 2, 32, "fp32", "sdpa"),
    ("llama_gqa", 1, 32, "fp16", "sdpa"),
    ("llama_gqa", 2, 32, "bf16", "eager"),
    ("llama_gqa", 1, 32, "fp16", "eager"),
    ("llama_gqa", 2, 32, "fp32", "eager"),
    ("llama_gqa", 2, 32, "bf16", "sdpa:math"),
    ("llama_gqa", 1, 32, "fp32", "sdpa:math"),
    ("llama_mha", 2, 32, "bf16", "sdpa"),
    ("llama_mha", 2, 32, "bf16", "eager"),
    ("llama_mha", 2, 32, "bf16", "sdpa:math"),
    ("llama_head_dim_20", 2, 32, "bf16", "sdpa"),
    ("llama_head_dim_20", 2, 32, "fp16", "sdpa:math"),
    ("llama_attention_bias", 2, 32, "bf16", "sdpa"),
    ("llama_mlp_bias", 2, 32, "bf16", "sdpa"),
    ("llama_tied", 2, 32, "bf16", "sdpa"),
    ("llama_tied", 2, 32, "bf16", "eager"),
    ("llama_dropout", 2, 32, "bf16", "sdpa"),
    ("llama_dropout", 2, 32, "bf16", "eager"),
    ("mistral", 2, 32, "bf16", "sdpa"),
    ("mistral", 1, 30, "fp32", "sdpa"),
    ("mistral", 2, 32, "bf16", "eager"),
    ("mistral", 1, 32, "fp16", "sdpa:math"),
    ("mistral_long_window", 2, 32, "bf16", "sdpa"),
    ("qwen2", 2, 32, "bf16", "sdpa"),
    ("qwen2", 2, 32, "bf16", "eager"),
    ("qwen3", 2, 32, "bf16", "sdpa"),
    ("qwen3", 1, 32, "fp32", "eager"),
    ("mixtral", 2, 32, "bf16", "sdpa"),
    ("mixtral", 1, 32, "fp32", "sdpa"),
    ("mixtral", 2, 32, "bf16", "eager"),
    ("mixtral_top1", 2, 32, "fp16", "sdpa"),
    ("qwen3_moe", 2, 32, "bf16", "sdpa"),
    ("qwen3_moe", 1, 32, "fp32", "sdpa"),
    ("qwen3_moe", 2, 32, "bf16", "eager"),
    ("qwen3_moe_unnormed", 2, 32, "bf16", "sdpa"),
    ("qwen3_moe_unnormed", 1, 32, "fp16", "sdpa"),
    ("deepseek_v3", 2, 32, "bf16", "sdpa"),
    ("deepseek_v3", 1, 32, "fp32", "sdpa"),
    ("deepseek_v3", 2, 32, "bf16", "eager"),
    ("deepseek_v3_plain", 2, 32, "bf16", "sdpa"),
    ("deepseek_v3_plain", 1, 32, "fp16", "eager"),
    ("gemma2", 2, 32, "bf16", "eager"),
    ("gemma2", 2, 32, "bf16", "sdpa"),
    ("gemma2", 1, 32, "fp32", "eager"),
    ("gemma2_long_window", 2, 32, "bf16", "sdpa"),
    ("gemma2_long_window", 2, 32, "bf16", "eager"),
    ("mistral_long_window", 2, 32, "bf16", "eager"),
    ("gemma3", 2, 32, "bf16", "sdpa"),
    ("gemma3", 2, 32, "bf16", "eager"),
    ("gemma3", 1, 32, "fp16", "sdpa:math"),
    ("phi3", 2, 32, "bf16", "sdpa"),
    ("phi3", 1, 32, "fp32", "eager"),
    ("phi3_window", 2, 32, "bf16", "sdpa"),
    ("phi3_window", 1, 32, "fp16", "eager"),
    ("olmo2", 2, 32, "bf16", "sdpa"),
    ("olmo2", 1, 32, "fp32", "sdpa"),
    ("olmo2", 2, 32, "bf16", "eager"),
    ("olmo2_bias", 1, 32, "fp16", "sdpa:math"),
    ("gpt2", 2, 32, "bf16", "sdpa"),
    ("gpt2", 2, 32, "bf16", "eager"),
    ("gpt2", 1, 32, "fp32", "eager"),
    ("gpt2_nodrop", 2, 32, "bf16", "sdpa"),
    ("gpt2_nodrop", 1, 32, "fp16", "sdpa:math"),
    ("gpt_neox", 2, 32, "bf16", "sdpa"),
    ("gpt_neox", 2, 32, "bf16", "eager"),
    ("gpt_neox_sequential", 2, 32, "bf16", "sdpa"),
    ("gpt_neox_sequential", 1, 32, "fp32", "eager"),
    ("bloom", 2, 32, "bf16", "eager"),
    ("bloom", 1, 30, "fp16", "eager"),
    ("bloom_dropout", 2, 32, "bf16", "eager"),
    ("bloom_dropout", 1, 32, "fp32", "eager"),
]


def _assert_same_events(real, predicted) -> None:
    """The two event lists agree (model_check.first_mismatch), else the first event where they part."""
    first = model_check.first_mismatch(real, predicted)
    assert first is None, (f"event {first}: real {real[first] if first < len(real) else None} vs predicted "
                           f"{predicted[first] if first < len(predicted) else None} ({len(real)} vs {len(predicted)})")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One intra-op thread: no per-thread reduction buffers, and CI's two cores are not oversubscribed."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


#: the same, every decoder layer checkpointed the non-reentrant way (transformers' gradient_checkpointing_enable
#: with use_reentrant=False, its default): the forward keeps handles, the backward recomputes each layer
CHECKPOINTED = [
    ("llama", 1, 128, "bf16", "sdpa"),
    ("llama", 2, 64, "bf16", "sdpa"),
    ("llama_gqa", 2, 32, "bf16", "eager"),
    ("llama_tied", 2, 32, "fp32", "sdpa"),
    ("mistral", 2, 32, "bf16", "sdpa"),
    ("mistral", 1, 32, "fp16", "eager"),
    ("qwen2", 2, 32, "bf16", "sdpa"),
    ("qwen3", 1, 32, "bf16", "sdpa"),
    ("mixtral", 2, 32, "bf16", "sdpa"),
    ("mixtral_top1", 1, 32, "fp32", "eager"),
    ("deepseek_v3", 2, 32, "bf16", "sdpa"),
    ("deepseek_v3_plain", 1, 32, "bf16", "eager"),
    ("olmo2", 2, 32, "bf16", "sdpa"),
    ("phi3_window", 2, 32, "bf16", "sdpa"),
    ("gemma2", 2, 32, "bf16", "eager"),
    ("gemma3", 2, 32, "bf16", "sdpa"),
    ("gpt2", 2, 32, "bf16", "sdpa"),
    ("gpt2_nodrop", 2, 32, "bf16", "eager"),
    ("gpt_neox", 2, 32, "bf16", "sdpa"),
    ("gpt_neox_sequential", 1, 32, "fp32", "eager"),
    ("bloom", 2, 32, "bf16", "eager"),
    ("bloom_dropout", 1, 32, "bf16", "eager"),
]


@pytest.mark.parametrize(("tiny", "batch", "seq", "dtype", "attention", "checkpointing"),
                         [(*c, False) for c in CASES] + [(*c, True) for c in CHECKPOINTED])
def test_micro_step_matches_cpu_trace(tiny, batch, seq, dtype, attention, checkpointing):
    cfg = model_check.TINY[tiny]
    attention, _, kernel = attention.partition(":")
    model = cputrace.tiny_causal_lm(cfg, dtype, attention)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    step = cputrace.micro_step(model, batch, seq, cfg["vocab_size"], sdpa_backend=kernel or None)
    real = cputrace.net_events(cputrace.record(step))
    predicted = model_check.model_events(cfg, batch=batch, seq=seq, dtype=dtype, attention=attention, device="cpu",
                                         sdpa_backend=kernel or None, checkpointing=checkpointing)
    _assert_same_events(real, predicted)


#: a full backward hook (register_full_backward_hook, a no-op) on every decoder layer, as profilers and memplan
#: verify's timeline markers until session 25 put them: torch's BackwardHook keeps each layer's output gradient
#: until its input gradient is done (estimator/layer_hooks.py)
LAYER_HOOKED = [
    ("llama", 2, 64, "bf16", "sdpa"),
    ("llama_tied", 2, 32, "fp32", "eager"),
    ("mixtral", 2, 32, "bf16", "sdpa"),
    ("deepseek_v3", 2, 32, "bf16", "sdpa"),
    ("gemma2", 2, 32, "bf16", "eager"),
    ("phi3_window", 2, 32, "bf16", "sdpa"),
    ("olmo2", 2, 32, "bf16", "sdpa"),
    ("gpt2", 2, 32, "bf16", "sdpa"),
    ("gpt_neox", 2, 32, "bf16", "sdpa"),
    ("bloom", 2, 32, "bf16", "eager"),
]


@pytest.mark.parametrize(("tiny", "batch", "seq", "dtype", "attention"), LAYER_HOOKED)
def test_layer_backward_hooks_match_cpu_trace(tiny, batch, seq, dtype, attention):
    from memplan.verify import hfbuild

    cfg = model_check.TINY[tiny]
    model = cputrace.tiny_causal_lm(cfg, dtype, attention)
    layers = hfbuild.decoder_layers(model)
    assert layers
    for layer in layers:
        layer.register_full_backward_hook(lambda *_: None)
    step = cputrace.micro_step(model, batch, seq, cfg["vocab_size"])
    real = cputrace.net_events(cputrace.record(step))
    predicted = model_check.model_events(cfg, batch=batch, seq=seq, dtype=dtype, attention=attention, device="cpu",
                                         layer_hooks=True)
    unhooked = model_check.model_events(cfg, batch=batch, seq=seq, dtype=dtype, attention=attention, device="cpu")
    assert predicted != unhooked  # the hooks change the order of events, or the case checks nothing
    _assert_same_events(real, predicted)


#: peft LoRA on the tiny models (issue 14): (TINY config, batch, seq, dtype, attention, checkpointing, targets, rank,
#: dropout, adapter dtype). fp32 adapters are peft's autocast_adapter_dtype (kept under ZeRO-3); adapters in the
#: training dtype are what DeepSpeed's cast leaves at ZeRO 0-2. Checkpointing adds enable_input_require_grads.
LORA_CASES = [
    ("llama_gqa", 2, 32, "bf16", "sdpa", False, ("q_proj", "v_proj"), 8, 0.0, "fp32"),
    ("llama_gqa", 2, 32, "bf16", "sdpa", False, ("all-linear",), 8, 0.0, "fp32"),
    ("llama_gqa", 2, 32, "bf16", "sdpa", False, ("q_proj", "v_proj"), 8, 0.1, "fp32"),
    ("llama_gqa", 2, 32, "bf16", "sdpa", False, ("all-linear",), 4, 0.1, "bf16"),
    ("llama_gqa", 2, 32, "bf16", "sdpa", True, ("all-linear",), 8, 0.0, "fp32"),
    ("llama_gqa", 2, 32, "bf16", "sdpa", True, ("q_proj", "v_proj"), 8, 0.1, "bf16"),
    ("llama_gqa", 2, 32, "bf16", "eager", False, ("q_proj", "v_proj"), 8, 0.0, "bf16"),
    ("llama_tied", 2, 32, "bf16", "sdpa", False, ("all-linear",), 8, 0.0, "bf16"),
    ("qwen3", 2, 32, "bf16", "sdpa", False, ("all-linear",), 8, 0.05, "fp32"),
    ("mixtral", 2, 32, "bf16", "sdpa", False, ("q_proj", "v_proj"), 8, 0.0, "fp32"),
    ("gpt2", 2, 32, "bf16", "sdpa", False, ("c_attn",), 8, 0.1, "fp32"),
    ("gpt_neox", 2, 32, "bf16", "sdpa", False, ("query_key_value",), 8, 0.0, "bf16"),
    ("phi3", 2, 32, "bf16", "sdpa", True, ("qkv_proj",), 8, 0.1, "fp32"),
    ("olmo2", 2, 32, "bf16", "sdpa", True, ("q_proj", "v_proj"), 8, 0.1, "fp32"),
    ("gemma2", 2, 32, "bf16", "eager", False, ("all-linear",), 8, 0.0, "bf16"),
    ("deepseek_v3", 2, 32, "bf16", "sdpa", True, ("q_a_proj", "kv_b_proj", "o_proj"), 8, 0.0, "bf16"),
]


@pytest.mark.parametrize(("tiny", "batch", "seq", "dtype", "attention", "checkpointing", "targets", "rank", "dropout",
                          "adapter_dtype"), LORA_CASES)
def test_lora_micro_step_matches_cpu_trace(tiny, batch, seq, dtype, attention, checkpointing, targets, rank, dropout,
                                           adapter_dtype):
    """peft's lora.Linear (estimator/peft_linear.py) on a frozen base, event for event: the cast input, dropout,
    lora_A / lora_B, the scaled sum and its cast back; the frozen linears' saved weights; the head's input kept
    until the forward returns; with checkpointing, the embedding output as a leaf with its .grad."""
    peft = pytest.importorskip("peft")
    from memplan.specs import LoraSpec

    cfg = model_check.TINY[tiny]
    model = cputrace.tiny_causal_lm(cfg, dtype, attention)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = peft.LoraConfig(r=rank, lora_alpha=16, lora_dropout=dropout, task_type="CAUSAL_LM",
                             target_modules="all-linear" if targets == ("all-linear",) else list(targets))
    model = peft.get_peft_model(model, config, autocast_adapter_dtype=adapter_dtype == "fp32")
    real = cputrace.net_events(cputrace.record(cputrace.micro_step(model, batch, seq, cfg["vocab_size"])))
    predicted = model_check.model_events(cfg, batch=batch, seq=seq, dtype=dtype, attention=attention, device="cpu",
                                         checkpointing=checkpointing, adapter_dtype=adapter_dtype,
                                         lora=LoraSpec(rank=rank, targets=targets, dropout=dropout))
    _assert_same_events(real, predicted)


#: LoRA that peft 0.21 routes through lora.ParamWrapper (estimator/peft_param.py): the MoE families' router weight
#: and fused experts (all-linear, or the expert projections by name), with and without checkpointing, fp32 or
#: 16-bit adapters: (TINY config, checkpointing, targets, rank, adapter dtype)
PARAM_WRAPPER_CASES = [
    ("mixtral", False, ("all-linear",), 8, "fp32"),
    ("mixtral", True, ("all-linear",), 8, "fp32"),
    ("mixtral", False, ("all-linear",), 4, "bf16"),
    ("mixtral", True, ("all-linear",), 16, "bf16"),
    ("mixtral", False, ("q_proj", "w2"), 8, "fp32"),
    ("mixtral_top1", False, ("all-linear",), 8, "fp32"),
    ("qwen3_moe", False, ("all-linear",), 8, "fp32"),
    ("qwen3_moe_unnormed", True, ("all-linear",), 8, "bf16"),
    ("deepseek_v3", False, ("all-linear",), 8, "fp32"),
    ("deepseek_v3", True, ("kv_b_proj", "down_proj", "gate_proj", "up_proj"), 8, "bf16"),
    ("deepseek_v3_plain", True, ("all-linear",), 4, "bf16"),
]


@pytest.mark.parametrize(("tiny", "checkpointing", "targets", "rank", "adapter_dtype"), PARAM_WRAPPER_CASES)
def test_param_wrapper_micro_step_matches_cpu_trace(tiny, checkpointing, targets, rank, adapter_dtype):
    """peft's lora.ParamWrapper event for event: the proxy's factors (or the router's delta), the registration's
    check evaluation, the cached baddbmm of each expert stack (or W + delta) saved by what reads it, the cache
    emptied as the outermost wrapper returns, and BaddbmmBackward0's grads with the reshape copy for lora_B."""
    peft = pytest.importorskip("peft")
    from memplan.specs import LoraSpec

    cfg = model_check.TINY[tiny]
    model = cputrace.tiny_causal_lm(cfg, "bf16", "sdpa")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = peft.LoraConfig(r=rank, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                             target_modules="all-linear" if targets == ("all-linear",) else list(targets))
    model = peft.get_peft_model(model, config, autocast_adapter_dtype=adapter_dtype == "fp32")
    real = cputrace.net_events(cputrace.record(cputrace.micro_step(model, 2, 32, cfg["vocab_size"])))
    predicted = model_check.model_events(cfg, batch=2, seq=32, dtype="bf16", attention="sdpa", device="cpu",
                                         checkpointing=checkpointing, adapter_dtype=adapter_dtype,
                                         lora=LoraSpec(rank=rank, alpha=16, targets=targets))
    _assert_same_events(real, predicted)


def test_param_wrapper_trainable_parameters_are_peft_s():
    """The adapters peft adds through lora.ParamWrapper, by name and shape in named_parameters() order, and the
    dense MLPs / shared experts it leaves alone (its MoE conversion moves gate_proj / up_proj / down_proj to
    target_parameters): train_set.train_set against get_peft_model on the tiny MoE configs."""
    peft = pytest.importorskip("peft")
    from memplan.estimator.train_set import train_set
    from memplan.hfconfig import model_from_config
    from memplan.specs import LoraSpec

    for tiny in ("mixtral", "qwen3_moe", "deepseek_v3", "deepseek_v3_plain"):
        spec = model_from_config(dict(model_check.TINY[tiny]), "tiny", "tiny test config")
        ts = train_set(spec, LoraSpec(rank=4, alpha=16, targets=("all-linear",)), ())
        mine = [(t.name, tuple(t.shape)) for t, trains in ts.tensors if trains]
        model = peft.get_peft_model(cputrace.tiny_causal_lm(model_check.TINY[tiny], "bf16", "sdpa"),
                                    peft.LoraConfig(r=4, lora_alpha=16, target_modules="all-linear"))
        theirs = [(n.removeprefix("base_model.model."), tuple(p.shape)) for n, p in model.named_parameters()
                  if p.requires_grad]
        assert mine == theirs, tiny


#: Ulysses sequence parallelism (estimator/ulysses.py): (TINY config, batch, seq, sp, checkpointing, extra config).
#: sp 4 over 2 kv heads replicates them; a batch of one and one local head make some copies views
ULYSSES_CASES = [
    ("llama_gqa", 2, 64, 2, False, {}),
    ("llama_gqa", 1, 64, 2, False, {}),
    ("llama_gqa", 2, 64, 4, False, {}),
    ("llama_gqa", 1, 128, 4, True, {}),
    ("llama_mha", 1, 64, 4, False, {}),
    ("qwen2", 2, 64, 2, True, {}),
    ("qwen3", 2, 64, 2, False, {}),
    ("mistral", 2, 64, 2, False, {}),  # window 16 <= S/sp: the model builds its mask, the wrapper drops it
    ("mixtral", 1, 64, 2, False, {"head_dim": 16}),  # UlyssesSPAttentionHF reads config.head_dim
    ("qwen3_moe", 2, 64, 2, False, {}),
    ("gemma2", 2, 64, 2, False, {}),
    ("gemma3", 1, 64, 2, True, {}),
    ("phi3", 2, 64, 2, False, {}),
    ("olmo2", 1, 64, 2, False, {}),
]


@pytest.mark.parametrize(("tiny", "batch", "seq", "sp", "checkpointing", "extra"), ULYSSES_CASES)
def test_ulysses_micro_step_matches_cpu_trace(tiny, batch, seq, sp, checkpointing, extra):
    """DeepSpeed's UlyssesSPAttentionHF around sdpa, event for event: the gathered positions, each of q, k, v
    copied and all-to-all'd, the contiguous layers, the context's partition and its copies; in backward the
    all-to-alls of the grads and the reshapes that copy them."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("deepspeed")
    pytest.importorskip("einops")
    cfg = {**model_check.TINY[tiny], **extra}
    args = {"config": cfg, "batch": batch, "seq": seq, "sp": sp, "checkpointing": checkpointing}
    run = subprocess.run([sys.executable, "-m", "memplan.verify.cputrace_ulysses", json.dumps(args)],
                         check=False, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])  # both sides from one interpreter (set order)
    real, predicted = ([tuple(e) for e in out[k]] for k in ("real", "predicted"))
    assert len(real) > 100
    _assert_same_events(real, predicted)
