"""The estimator's allocation sequence for a bare forward + backward (no DeepSpeed), in the form the CPU trace
comparison uses (memplan.verify.cputrace, tests/test_ledger_trace.py): (±bytes, name, partner) per event, with
the CUDA kernels' internal temporaries (names ending in ".tmp") left out. Pure."""

from __future__ import annotations

from ..hfconfig import model_from_config
from ..ledger import Ledger, block_bytes
from .autograd import Autograd, Tensor
from .families import forward
from .transformer import Net, Params, Shape

#: the CPU trace drops tensors this small (wrapped scalars; memplan.verify.cputrace.SCALAR_BYTES)
SCALAR_BYTES = 8

#: bytes per element of each training dtype
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 200, "max_position_embeddings": 256}

#: tiny configs of each family and variant for the comparison (transformers config kwargs); small enough
#: that one CPU step takes tens of milliseconds (bf16 matmuls are slow on CPUs without bf16 units)
TINY = {
    "llama": {"model_type": "llama", "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
              "max_position_embeddings": 512},
    "llama_gqa": _LLAMA,
    "llama_mha": {**_LLAMA, "num_key_value_heads": 4},
    "llama_head_dim_20": {**_LLAMA, "head_dim": 20},  # q_dim 80 ≠ hidden; not a multiple of 8
    "llama_attention_bias": {**_LLAMA, "attention_bias": True},
    "llama_mlp_bias": {**_LLAMA, "mlp_bias": True},
    "llama_tied": {**_LLAMA, "tie_word_embeddings": True},
    "llama_dropout": {**_LLAMA, "attention_dropout": 0.25},
    "mistral": {**_LLAMA, "model_type": "mistral", "sliding_window": 16},  # seq >= window: a mask
    "mistral_long_window": {**_LLAMA, "model_type": "mistral", "sliding_window": 4096},  # no mask
    "qwen2": {**_LLAMA, "model_type": "qwen2"},
    "qwen3": {**_LLAMA, "model_type": "qwen3", "head_dim": 16},
    "mixtral": {**_LLAMA, "model_type": "mixtral", "intermediate_size": 96, "num_local_experts": 4,
                "num_experts_per_tok": 2},
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": 160, "vocab_size": 200,
             "n_positions": 64},  # GPT2Config's dropouts (0.1)
    "gpt2_nodrop": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_inner": 160,
                    "vocab_size": 200, "n_positions": 64, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "gpt_neox": {"model_type": "gpt_neox", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "intermediate_size": 160, "vocab_size": 200, "max_position_embeddings": 256},  # rotary_pct 0.25
    "gpt_neox_sequential": {"model_type": "gpt_neox", "hidden_size": 64, "num_hidden_layers": 2,
                            "num_attention_heads": 4, "intermediate_size": 160, "vocab_size": 200,
                            "max_position_embeddings": 256, "use_parallel_residual": False, "rotary_pct": 1.0,
                            "attention_bias": False, "hidden_dropout": 0.1, "attention_dropout": 0.1},
    "bloom": {"model_type": "bloom", "hidden_size": 64, "n_layer": 2, "n_head": 4, "vocab_size": 200},
    "bloom_dropout": {"model_type": "bloom", "hidden_size": 96, "n_layer": 2, "n_head": 6, "vocab_size": 200,
                      "hidden_dropout": 0.1, "attention_dropout": 0.1},  # 6 heads: not a power of two
    "mixtral_top1": {**_LLAMA, "model_type": "mixtral", "intermediate_size": 48, "num_local_experts": 3,
                     "num_experts_per_tok": 1, "num_key_value_heads": 4},
    # layer 1 dense (mlp_only_layers); renormalised top-k as Qwen3-30B-A3B, and without
    "qwen3_moe": {**_LLAMA, "model_type": "qwen3_moe", "head_dim": 16, "intermediate_size": 96,
                  "moe_intermediate_size": 48, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
                  "mlp_only_layers": [1]},
    "qwen3_moe_unnormed": {**_LLAMA, "model_type": "qwen3_moe", "head_dim": 16, "moe_intermediate_size": 40,
                           "num_experts": 3, "num_experts_per_tok": 1, "norm_topk_prob": False},
    # MLA with unequal q/k and v widths (24 / 12), the q latent, interleaved RoPE, a dense first layer, then
    # grouped routing (2 groups, 1 used) over 4 experts and a shared expert; and without the q latent, with
    # rotate_half RoPE, one group, unnormalised weights, two shared experts and no dense layer
    "deepseek_v3": {**_LLAMA, "model_type": "deepseek_v3", "intermediate_size": 96, "moe_intermediate_size": 32,
                    "num_key_value_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                    "qk_rope_head_dim": 8, "v_head_dim": 12, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "n_group": 2, "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1,
                    "norm_topk_prob": True},
    "olmo2": {**_LLAMA, "model_type": "olmo2"},  # q/k norms over the whole width, norms after attention / MLP
    "olmo2_bias": {**_LLAMA, "model_type": "olmo2", "attention_bias": True, "num_key_value_heads": 4},
    "phi3": {**_LLAMA, "model_type": "phi3", "pad_token_id": 0},  # fused qkv and gate_up, no window
    "phi3_window": {**_LLAMA, "model_type": "phi3", "pad_token_id": 0, "sliding_window": 16,
                    "partial_rotary_factor": 0.5},
    # sliding and full layers (window 16 <= S: masks), soft-capped scores and logits, query_pre_attn_scalar
    "gemma2": {**_LLAMA, "model_type": "gemma2", "head_dim": 16, "pad_token_id": 0, "sliding_window": 16,
               "query_pre_attn_scalar": 16, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    "gemma2_long_window": {**_LLAMA, "model_type": "gemma2", "head_dim": 16, "pad_token_id": 0,
                           "sliding_window": 4096, "query_pre_attn_scalar": 16},  # sdpa: no masks; eager: both
    "gemma3": {**_LLAMA, "model_type": "gemma3_text", "head_dim": 16, "pad_token_id": 0, "sliding_window": 16,
               "query_pre_attn_scalar": 16, "layer_types": ["sliding_attention", "full_attention"]},
    "deepseek_v3_plain": {**_LLAMA, "model_type": "deepseek_v3", "moe_intermediate_size": 24,
                          "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 8, "qk_nope_head_dim": 8,
                          "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 3, "num_experts_per_tok": 1,
                          "n_group": 1, "topk_group": 1, "n_shared_experts": 2, "first_k_dense_replace": 0,
                          "norm_topk_prob": False, "rope_interleave": False},
}


def micro_step(config: dict, batch: int, seq: int, dtype: str = "bf16", attention: str = "sdpa",
               device: str = "cpu", sdpa_backend: str | None = None, checkpointing: bool = False,
               lora=None, adapter_dtype: str = "fp32", sp: int = 1, layer_hooks: bool = False
               ) -> tuple[Ledger, dict[str, Tensor]]:
    """The ledger of one loss-loop micro-step of ``config`` (forward, loss, backward) as the autograd model
    issues it, with the attention kernels ``device`` runs (``sdpa_backend``: one forced, as
    torch.nn.attention.sdpa_kernel does), and each parameter's gradient (what .grad keeps) by name.
    ``checkpointing``: every decoder layer checkpointed the non-reentrant way (transformers' default).
    ``lora``: a LoraSpec applied as peft's get_peft_model applies it (the base frozen), with the adapters in
    ``adapter_dtype`` (fp32: peft's autocast_adapter_dtype; the training dtype: as DeepSpeed casts them).
    ``sp``: Ulysses over that many ranks, this rank holding seq / sp tokens and passing position_ids.
    ``layer_hooks``: a full backward hook on every decoder layer (estimator/layer_hooks.py)."""
    from .checkpoint import nonreentrant

    spec = model_from_config(dict(config), "tiny", "tiny test config")
    b = DTYPE_BYTES[dtype]
    ledger = Ledger()
    grads: dict[str, Tensor] = {}
    ag = Autograd(ledger, on_param_grad=lambda param, grad: grads.__setitem__(param.name, grad))
    if lora is None:
        params = Params(ag, spec, b, lambda name: True)
    else:
        from .train_set import train_set

        ab = DTYPE_BYTES[adapter_dtype]
        ts = train_set(spec, lora, ())
        trains = {t.name: tr for t, tr in ts.tensors}
        adapters = tuple((t.name, t.numel * ab) for t, tr in ts.tensors if ".lora_" in t.name)
        params = Params(ag, spec, b, lambda name: trains.get(name, False), adapters, ab, lora.rank, lora.dropout,
                        ts.wrapped)
    layer_fn = nonreentrant(ag) if checkpointing else None
    net = Net(ag, spec, Shape(batch, seq // sp, seq, b, positions_given=sp > 1), params, layer_fn=layer_fn, attention=attention, device=device,
              dtype=dtype, sdpa_backend=sdpa_backend)
    net.input_require_grads = checkpointing  # gradient_checkpointing_enable → enable_input_require_grads
    if layer_hooks:
        from .layer_hooks import LayerBackwardHooks

        net.layer_hooks = LayerBackwardHooks()
    out = forward(net)
    leaves = ag.take_leaves()
    ag.release(out.logits)
    loss = out.loss
    ag.backward(loss, 4)
    ag.release(loss)
    ag.release_leaves(leaves)
    return ledger, grads


def model_events(config: dict, batch: int, seq: int, dtype: str = "bf16", attention: str = "sdpa",
                 device: str = "cpu", sdpa_backend: str | None = None, kernel_temporaries: bool = False,
                 blocks: bool = False, checkpointing: bool = False, lora=None, adapter_dtype: str = "fp32",
                 sp: int = 1, layer_hooks: bool = False) -> list[tuple[int, str, int]]:
    """(±bytes, name, partner) of ``micro_step``'s ledger in the form the trace comparisons use:
    ``partner`` is, for a free, the index of its allocation in the returned list (-1 for an allocation).
    Kernel temporaries (.tmp) and scalars are left out unless ``kernel_temporaries`` (the CUDA comparison,
    memplan.verify.cudatrace); ``blocks``: sizes rounded to the caching allocator's 512-byte blocks."""
    ledger, _ = micro_step(config, batch, seq, dtype, attention, device, sdpa_backend, checkpointing, lora,
                           adapter_dtype, sp, layer_hooks)
    events: list[tuple[int, str, int]] = []
    at: dict[int, int] = {}
    for ev in ledger.events:
        tid = ev if ev >= 0 else ~ev
        size = block_bytes(ledger.sizes[tid]) if blocks else ledger.sizes[tid]
        if not kernel_temporaries and (ledger.names[tid].endswith(".tmp") or ledger.sizes[tid] <= SCALAR_BYTES):
            continue
        if size == 0:
            continue
        if ev >= 0:
            at[tid] = len(events)
            events.append((size, ledger.names[tid], -1))
        else:
            events.append((-size, ledger.names[tid], at[tid]))
    return events


def first_mismatch(real: list[tuple[int, str, int]], predicted: list[tuple[int, str, int]]) -> int | None:
    """Index of the first event whose size, or (for a free) whose allocation, differs; None when they agree."""
    for i in range(max(len(real), len(predicted))):
        if i >= len(real) or i >= len(predicted):
            return i
        if real[i][0] != predicted[i][0] or real[i][2] != predicted[i][2]:
            return i
    return None
