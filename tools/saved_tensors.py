"""Development aid: what autograd saves for backward, per decoder layer and outside the layers, on the CPU.

Runs a tiny transformers model of each family forward with torch.autograd.graph.saved_tensors_hooks and
groups the unique storages saved while each decoder layer runs (parameters excluded); with --tensors it
prints them one per line: where (the innermost module running), shape, dtype, bytes of the storage.

    python tools/saved_tensors.py [FAMILY ...] [--tensors] [--seq N]

CPU kernels: torch's CPU sdpa saves what CUDA's FlashAttention saves without a mask; where they differ
(MLA's unequal head widths: CPU math in fp32, CUDA memory-efficient) memplan's estimator/activations_families.py
says so, and ``layer_terms(..., kernel="cpu")`` gives the CPU's tensors. With random initialisation the MoE
routing is near uniform; the routed tensors' sizes (T·k rows) do not depend on it.
"""
from __future__ import annotations

import json
import sys
import weakref

import torch
from transformers import AutoConfig, AutoModelForCausalLM

_SMALL = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=2, vocab_size=1000)
_DEEPSEEK = dict(model_type="deepseek_v3", **{**_SMALL, "num_key_value_heads": 8}, moe_intermediate_size=96,
                 n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=64, q_lora_rank=96,
                 qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, first_k_dense_replace=1,
                 n_shared_experts=1)
FAMILIES = {
    "llama": dict(model_type="llama", **_SMALL),
    "mistral": dict(model_type="mistral", **_SMALL, sliding_window=None),
    "qwen2": dict(model_type="qwen2", **_SMALL),
    "qwen3": dict(model_type="qwen3", **_SMALL, head_dim=32),
    "gpt2": dict(model_type="gpt2", n_embd=256, n_layer=2, n_head=8, vocab_size=1000, n_positions=2048),
    "gpt_neox": dict(model_type="gpt_neox", hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                     num_attention_heads=8, vocab_size=1000),
    "bloom": dict(model_type="bloom", hidden_size=256, n_layer=2, n_head=8, vocab_size=1000),
    "mixtral": dict(model_type="mixtral", **{**_SMALL, "intermediate_size": 352}, num_local_experts=4,
                    num_experts_per_tok=2),
    # ---- issue 16's families: windows below seq 128 so that sliding layers get their mask ----
    "gemma2": dict(model_type="gemma2", **_SMALL, head_dim=32, sliding_window=64),
    "gemma2-window-above-seq": dict(model_type="gemma2", **_SMALL, head_dim=32, sliding_window=4096),
    "gemma3_text": dict(model_type="gemma3_text", **_SMALL, head_dim=32, sliding_window=64, sliding_window_pattern=2,
                        final_logit_softcapping=30.0),
    "phi3": dict(model_type="phi3", **{**_SMALL, "num_key_value_heads": 8}, pad_token_id=0),
    "phi3-window-dropout": dict(model_type="phi3", **_SMALL, pad_token_id=0, sliding_window=64,
                                partial_rotary_factor=0.5, resid_pdrop=0.1),
    "qwen3_moe": dict(model_type="qwen3_moe", **{**_SMALL, "num_hidden_layers": 3}, head_dim=32,
                      moe_intermediate_size=96, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                      mlp_only_layers=[1]),
    "qwen3_moe-aux-loss": dict(model_type="qwen3_moe", **_SMALL, moe_intermediate_size=96, num_experts=8,
                               num_experts_per_tok=3, output_router_logits=True),
    "olmo2": dict(model_type="olmo2", **_SMALL),
    "deepseek_v3": _DEEPSEEK,
    "deepseek_v3-no-q-lora": {**_DEEPSEEK, "q_lora_rank": None, "n_shared_experts": 2, "norm_topk_prob": False},
}


def layers_of(model):
    base = getattr(model, "model", None) or getattr(model, "transformer", None) or model.gpt_neox
    return list(getattr(base, "layers", None) or base.h)


def measure(family: str, attn: str, seq: int = 128, dtype=torch.bfloat16) -> dict:
    """bytes_per_token / bytes / tensors per place ("layer0", ..., "outside") of FAMILIES[family]."""
    cfg = AutoConfig.for_model(**FAMILIES[family])
    cfg.use_cache = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)
    model.train()
    current = {"where": "outside"}
    names = {mod: name for name, mod in model.named_modules()}
    stack: list[str] = []
    saved: list[tuple] = []

    def pack(t):
        # a weak reference to what autograd keeps: a node whose outputs all died during the forward (topk's
        # discarded values) frees its saved tensors, and their memory may hold a later saved tensor
        st = t.untyped_storage()
        saved.append((current["where"], weakref.ref(t), st.data_ptr(), stack[-1] if stack else "", tuple(t.shape),
                      str(t.dtype).removeprefix("torch."), st.nbytes()))
        return t

    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(
                 lambda m, a: stack.append(names.get(m, "?"))),
             torch.nn.modules.module.register_module_forward_hook(lambda m, a, o: (stack.pop(), None)[1])]
    for i, layer in enumerate(layers_of(model)):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: current.update(where=f"layer{i}")))
        hooks.append(layer.register_forward_hook(lambda m, a, o: current.update(where="outside")))
    vocab = cfg.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, seq))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(input_ids=ids, labels=ids)
    finally:
        for h in hooks:
            h.remove()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    alive: dict[str, dict[int, tuple]] = {}
    for where, ref, ptr, *info in saved:  # still kept at the end of the forward; one entry per storage
        if ref() is not None and ptr not in params:
            alive.setdefault(where, {}).setdefault(ptr, tuple(info))
    res, total, tensors = {}, {}, {}
    for where, d in alive.items():
        kept = list(d.values())
        total[where] = sum(v[3] for v in kept)
        res[where] = total[where] / seq
        tensors[where] = kept
    out.loss.backward()
    return {"family": family, "attn": attn, "seq": seq, "bytes_per_token": res, "bytes": total,
            "tensors": tensors, "hidden": cfg.get_text_config().hidden_size, "config": FAMILIES[family]}


def _print_tensors(row: dict) -> None:
    print(f"# {row['family']} {row['attn']} seq {row['seq']} (bf16): where, shape, dtype, bytes per token")
    for where in sorted(row["tensors"], key=lambda w: (w == "outside", w)):
        print(f"## {where}: {row['bytes'][where]} bytes ({row['bytes_per_token'][where]:.2f} per token)")
        for module, shape, dtype, nbytes in row["tensors"][where]:
            print(f"{module:48} {str(list(shape)):22} {dtype:9} {nbytes / row['seq']:10.2f}")


if __name__ == "__main__":
    args = sys.argv[1:]
    listing = "--tensors" in args
    seq = int(args[args.index("--seq") + 1]) if "--seq" in args else 128
    fams = [a for a in args if a in FAMILIES] or list(FAMILIES)
    for fam in fams:
        for attn in ("sdpa", "eager"):
            try:
                row = measure(fam, attn, seq)
            except Exception as e:  # noqa: BLE001 - a dev tool reports and goes on
                print(json.dumps({"family": fam, "attn": attn, "error": str(e)[:200]}))
                continue
            if listing:
                _print_tensors(row)
            else:
                print(json.dumps({k: v for k, v in row.items() if k != "tensors"}))
