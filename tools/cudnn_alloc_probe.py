"""Development aid (GPU only): the allocations torch's cuDNN attention makes, against the model in
memplan.estimator.blocks_kernels.cudnn_attention, over head_dims, sequence lengths, batches and grouped-query
heads, called the way transformers' sdpa_attention_forward calls it (q, k, v [B, S, h, d] in memory,
transposed to [B, h, S, d]; the grad arrives through the output's transpose). Each case is recorded with
torch.cuda.memory._record_memory_history; the allocations the forward and the backward make are listed in
order and compared with the model's. Exit status 1 on any disagreement, 2 without CUDA.

Usage: python tools/cudnn_alloc_probe.py
"""
from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from memplan.estimator import blocks_attention as A
from memplan.estimator import blocks_kernels as K

if not torch.cuda.is_available():
    print("cudnn_alloc_probe: needs CUDA", file=sys.stderr)
    sys.exit(2)


def allocations(fn) -> list[int]:
    """Sizes of the blocks ``fn`` allocates, in order (the caching allocator's requested sizes)."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=100000)
    fn()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return [e["size"] for trace in snap["device_traces"] for e in trace if e["action"] == "alloc"]


def model(g: A.Geometry, kv: int) -> tuple[list[int], list[int]]:
    """The forward's and the backward's allocations blocks_kernels.cudnn_attention makes."""
    rows = K.FP32 * g.batch * g.heads * g.seq
    fwd = [8, 8, g.bytes(), rows, K.CUDNN_FWD_WORKSPACE_BYTES]
    bwd = [g.bytes(), g.bytes(), g.bytes(kv), g.bytes(kv), K.cudnn_bwd_workspace_bytes(g, masked=False)]
    return fwd, bwd


def run(head_dim: int, seq: int, batch: int, gqa: bool, heads: int = 32) -> bool:
    kv = heads // 4 if gqa else heads
    dev, t = "cuda", torch.bfloat16
    q, k, v = (torch.randn(batch, seq, h, head_dim, device=dev, dtype=t).transpose(1, 2).requires_grad_()
               for h in (heads, kv, kv))
    grad = torch.randn(batch, seq, heads, head_dim, device=dev, dtype=t).transpose(1, 2)
    out = []

    def forward():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa))

    fwd = allocations(forward)
    bwd = allocations(lambda: out[0].backward(grad))
    want = model(A.Geometry(batch, seq, heads, kv, head_dim, 2), kv)
    ok = (fwd, bwd) == want
    print(f"{'  ' if ok else '!!'} d={head_dim:<3} S={seq:<5} B={batch} gqa={gqa!s:5} torch fwd {fwd} bwd {bwd}"
          + ("" if ok else f"\n   memplan fwd {want[0]} bwd {want[1]}"))
    return ok


print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version(), torch.cuda.get_device_name())
bad = sum(not run(d, s, b, gqa) for d, s, b, gqa in itertools.product((64, 128), (1024, 4096), (1, 2),
                                                                       (False, True)))
sys.exit(1 if bad else 0)
