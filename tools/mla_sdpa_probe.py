"""Development aid (GPU): the kernel F.scaled_dot_product_attention runs for DeepSeek-V3's MLA shapes (q and k of
qk_nope + qk_rope = 192, v of 128 per head: transformers 5.17 DeepseekV3Attention through sdpa_attention_forward,
causal, no mask), with the bytes its forward saves and its backward allocates.

Usage: python tools/mla_sdpa_probe.py   (prints one JSON line per case)
"""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

KERNELS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
           "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math")


def case(b: int, heads: int, seq: int, dqk: int, dv: int, dtype=torch.bfloat16) -> dict:
    q = torch.randn(b, heads, seq, dqk, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, heads, seq, dqk, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(b, heads, seq, dv, device="cuda", dtype=dtype, requires_grad=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.1)
    torch.cuda.synchronize()
    after_fwd = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    names = sorted({e.key for e in prof.key_averages() if e.key.removeprefix("aten::") in KERNELS})
    return {"b": b, "heads": heads, "seq": seq, "dqk": dqk, "dv": dv, "kernels": names,
            "forward_kept_bytes": after_fwd - before, "out_bytes": out.numel() * out.element_size(),
            "backward_peak_above_start_bytes": torch.cuda.max_memory_allocated() - after_fwd}


if __name__ == "__main__":
    for shape in ((1, 128, 1024, 192, 128), (2, 128, 2048, 192, 128), (1, 16, 4096, 192, 128), (1, 32, 2048, 128, 128)):
        print(json.dumps(case(*shape)))
