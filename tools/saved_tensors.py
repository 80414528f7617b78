"""Development aid: bytes saved for backward per decoder layer, per token, on the CPU.

Runs a tiny transformers model of each family forward with torch.autograd.graph.saved_tensors_hooks and
groups the unique storages saved while each decoder layer runs. Usage: python tools/saved_tensors.py
"""
from __future__ import annotations

import json
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

FAMILIES = {
    "llama": dict(model_type="llama", hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=1000),
    "mistral": dict(model_type="mistral", hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=2, vocab_size=1000, sliding_window=None),
    "qwen2": dict(model_type="qwen2", hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, vocab_size=1000),
    "qwen3": dict(model_type="qwen3", hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=32, vocab_size=1000),
    "gpt2": dict(model_type="gpt2", n_embd=256, n_layer=2, n_head=8, vocab_size=1000, n_positions=2048),
    "gpt_neox": dict(model_type="gpt_neox", hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                     num_attention_heads=8, vocab_size=1000),
    "bloom": dict(model_type="bloom", hidden_size=256, n_layer=2, n_head=8, vocab_size=1000),
    "mixtral": dict(model_type="mixtral", hidden_size=256, intermediate_size=352, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=2, vocab_size=1000, num_local_experts=4,
                    num_experts_per_tok=2),
}


def layers_of(model):
    base = getattr(model, "model", None) or getattr(model, "transformer", None) or model.gpt_neox
    return list(getattr(base, "layers", None) or base.h)


def measure(family: str, attn: str, seq: int = 128, dtype=torch.bfloat16) -> dict:
    cfg = AutoConfig.for_model(**FAMILIES[family])
    cfg.use_cache = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype, attn_implementation=attn)
    current = {"where": "outside"}
    saved: dict[str, dict[int, int]] = {}

    def pack(t):
        st = t.untyped_storage()
        saved.setdefault(current["where"], {})[st.data_ptr()] = st.nbytes()
        return t

    hooks = []
    for i, layer in enumerate(layers_of(model)):
        hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: current.update(where=f"layer{i}")))
        hooks.append(layer.register_forward_hook(lambda m, a, o: current.update(where="outside")))
    ids = torch.randint(0, cfg.vocab_size, (1, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(input_ids=ids, labels=ids)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    res = {}
    for where, d in saved.items():
        res[where] = sum(n for ptr, n in d.items() if ptr not in params) / seq
    out.loss.backward()
    return {"family": family, "attn": attn, "seq": seq, "bytes_per_token": res,
            "hidden": cfg.hidden_size, "config": FAMILIES[family]}


if __name__ == "__main__":
    fams = sys.argv[1:] or list(FAMILIES)
    for fam in fams:
        for attn in ("sdpa", "eager"):
            try:
                print(json.dumps(measure(fam, attn)))
            except Exception as e:  # noqa: BLE001 - a dev tool reports and goes on
                print(json.dumps({"family": fam, "attn": attn, "error": str(e)[:200]}))
