"""Development aid: which kernel F.scaled_dot_product_attention really runs, against
memplan.estimator.blocks_attention.sdpa_kernel, over a grid of dtypes, head_dims, grouped-query heads, masks
and dropout (the way transformers' sdpa_attention_forward calls it: enable_gqa without a mask, repeated k/v
with one). Runs on CUDA when available, else the CPU rule. Exit status 1 on any disagreement.

Usage: python tools/sdpa_kernel_probe.py
"""
from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from memplan.estimator import blocks_attention as A

device = "cuda" if torch.cuda.is_available() else "cpu"
KERNELS = {"_scaled_dot_product_flash_attention_for_cpu": "cpu_flash", "_scaled_dot_product_flash_attention": "flash",
           "_scaled_dot_product_efficient_attention": "efficient", "_scaled_dot_product_cudnn_attention": "cudnn",
           "_scaled_dot_product_attention_math": "math"}


class _Net:
    attention, sdpa_backend = "sdpa", None

    def __init__(self, dev, dtype):
        self.device, self.dtype = dev, dtype


def run(dtype, head_dim, gqa, mask, dropout, batch=2, seq=128, heads=8):
    kv = 2 if gqa else heads
    t = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    q = torch.randn(batch, heads, seq, head_dim, device=device, dtype=t, requires_grad=True)
    k = torch.randn(batch, kv, seq, head_dim, device=device, dtype=t, requires_grad=True)
    v = torch.randn(batch, kv, seq, head_dim, device=device, dtype=t, requires_grad=True)
    attn_mask = torch.ones(batch, 1, seq, seq, device=device, dtype=torch.bool).tril() if mask else None
    enable_gqa = A.use_gqa(A.Geometry(batch, seq, heads, kv, head_dim, 2), mask)  # transformers' use_gqa_in_sdpa
    if gqa and not enable_gqa:  # else it repeats k and v (repeat_kv)
        k, v = (x.repeat_interleave(heads // kv, 1) for x in (k, v))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout, is_causal=not mask,
                                       enable_gqa=enable_gqa)
    names = {e.key.removeprefix("aten::") for e in prof.key_averages()}
    real = next((KERNELS[n] for n in KERNELS if n in names), "?")
    g = A.Geometry(batch, seq, heads, kv if enable_gqa else heads, head_dim, 4 if dtype == "fp32" else 2)
    return real, A.sdpa_kernel(_Net(device, dtype), g, mask, dropout, enable_gqa)


bad = 0
print("torch", torch.__version__, "device", device, "cudnn", torch.backends.cudnn.version())
for dtype, head_dim, gqa, mask, dropout in itertools.product(("bf16", "fp16", "fp32"), (20, 64, 128, 256, 320),
                                                            (False, True), (False, True), (0.0, 0.1, 0.125)):
    real, model = run(dtype, head_dim, gqa, mask, dropout)
    bad += real != model
    print(f"{'  ' if real == model else '!!'} {dtype} d={head_dim:<3} gqa={gqa!s:5} mask={mask!s:5} p={dropout}: "
          f"torch {real:9} memplan {model}")
sys.exit(1 if bad else 0)
