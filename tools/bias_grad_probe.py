"""Development aid (GPU): the caching-allocator transients of a linear's backward, with C++ stacks.

The GPU traces of BLOOM and Qwen2 (benchmarks/accuracy/rows-h200-14-traces.jsonl) show an allocation of
T·out·8 bytes, freed at once, right after a biased linear's input and weight grads, which the CPU trace does not
have. This runs F.linear forward and backward on CUDA for a few shapes and dtypes, with and without a bias, under
torch.cuda.memory._record_memory_history(stacks="all"), and prints every allocation freed before the next one
with its size in units of T·out and the innermost C++/Python frames that made it.

Usage: python tools/bias_grad_probe.py
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def frames_of(e, n=12):
    out = []
    for fr in e.get("frames") or ():
        name = fr.get("name", "")
        if any(s in name for s in ("c10::", "record_trace", "malloc", "Allocator", "allocate")):
            continue
        out.append(f"{name[:90]}")
        if len(out) >= n:
            break
    return out


def probe(t: int, n_in: int, n_out: int, dtype, bias: bool) -> None:
    x = torch.randn(t, n_in, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn(n_out, n_in, device="cuda", dtype=dtype, requires_grad=True)
    b = torch.randn(n_out, device="cuda", dtype=dtype, requires_grad=True) if bias else None
    y = F.linear(x, w, b)
    g = torch.randn_like(y)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=100000, stacks="all")
    y.backward(g)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    ev = snap["device_traces"][0]
    print(f"== T {t} in {n_in} out {n_out} {dtype} bias {bias}: T*out = {t * n_out}")
    for k, e in enumerate(ev):
        if e["action"] != "alloc":
            continue
        print(f"  alloc {e['size']:>12} = {e['size'] / (t * n_out):.3f} T*out bytes")
        for f in frames_of(e):
            print("      ", f)


def main() -> None:
    for dtype in (torch.float16, torch.bfloat16):
        for bias in (True, False):
            probe(2048, 1024, 4096, dtype, bias)
    probe(4096, 896, 896, torch.bfloat16, True)
    probe(1024, 1024, 1024, torch.float16, True)


if __name__ == "__main__":
    main()
