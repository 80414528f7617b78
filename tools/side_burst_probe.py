"""GPU probe: how a burst of device-to-device copies on a side stream shares the GPU with queued compute kernels.

The timing replay (estimator/gpu_time) has to know when an emulated ZeRO-3 gather's copies (torch's fake process
group: one ``Memcpy DtoD`` per rank on the all-gather stream) complete while the compute stream has work queued,
because the host waits on that stream's events (the coordinator's fetch events). Two behaviours have been seen:

- benchmarks/timing/kernels-h100.json "side_stream": one copy beside bf16 8192³ or fp32 4096³ products runs during
  the next product and stretches it by about its own duration;
- benchmarks/timing/kernel-timeline-h100-fixed/lone2-s10-031.raw.json.gz: eight 501 MiB copies beside Llama-3-405B
  width bf16 products (cuBLAS ``nvjet ... coop`` kernels) ran one between each two products.

This queues ``N_COMPUTE`` kernels of one kind on the default stream, then, after the second is launched, a burst of
``n`` copies of ``mib`` MiB each on a side stream with an event after each, and reports every compute kernel's and
every copy's end (ms from the first kernel's start), for each kind × n × size. Also the kernel names cuBLAS picks
(torch.profiler, one run per kind).

Session 27 added attention kernels (``attention_kinds``): a causal sdpa forward and its backward at 32K tokens and
4 heads of 128 (Mistral-7B's attention under Ulysses sp 8), on the kernel sdpa picks (cuDNN on the H100) and on
flash; each launches many waves of blocks, where a product launches about one.

Usage (GPU machine): python tools/side_burst_probe.py OUT.jsonl [KIND ...]   (default: every kind)
"""
from __future__ import annotations

import json
import sys

import torch

N_COMPUTE = 12
DEV = "cuda"


def kinds() -> dict:
    """Compute kernels to queue: name -> a zero-argument callable launching one."""
    torch.backends.cuda.matmul.allow_tf32 = False
    bf = torch.bfloat16
    a = torch.randn(8192, 8192, device=DEV, dtype=bf)
    b = torch.randn(8192, 8192, device=DEV, dtype=bf)
    x = torch.randn(2048, 16384, device=DEV, dtype=bf)  # a Llama-3-405B MLP product at 2K tokens
    w = torch.randn(16384, 26624, device=DEV, dtype=bf)
    f = torch.randn(4096, 4096, device=DEV)
    g = torch.randn(4096, 4096, device=DEV)
    e = torch.randn(64 * 2**20, device=DEV)  # 256 MiB fp32
    return {"bf16_8192": lambda: a @ b, "bf16_405b_mlp": lambda: x @ w, "fp32_4096": lambda: f @ g,
            "add_256mib": lambda: e.add_(1.0), **attention_kinds()}


def attention_kinds() -> dict:
    """Causal attention at 32K tokens, 4 query heads and one key/value head of 128 (repeated, as
    transformers' sdpa path does for grouped-query heads): forward and backward, sdpa's own pick and flash."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    shape = (1, 4, 32768, 128)
    q, k, v = (torch.randn(shape, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = {}
    for label, backends in (("sdpa", None), ("flash", [SDPBackend.FLASH_ATTENTION])):
        def fwd(backends=backends):
            if backends is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o = fwd()
        g = torch.randn_like(o)
        out[f"{label}_fwd_32k"] = lambda fwd=fwd: fwd().detach()
        out[f"{label}_bwd_32k"] = lambda o=o, g=g: torch.autograd.grad(o, (q, k, v), g, retain_graph=True)
    return out


def run(launch, n: int, mib: int, side: torch.cuda.Stream) -> dict:
    src = torch.empty(mib * 2**20 // 2, device=DEV, dtype=torch.bfloat16)
    dst = [torch.empty_like(src) for _ in range(n)]
    launch()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    ends, copies = [], []
    start.record()
    for i in range(N_COMPUTE):
        launch()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        ends.append(ev)
        if i == 1:
            with torch.cuda.stream(side):
                for d in dst:
                    d.copy_(src)
                    ce = torch.cuda.Event(enable_timing=True)
                    ce.record(side)
                    copies.append(ce)
    torch.cuda.synchronize()
    return {"compute_ends_ms": [round(start.elapsed_time(e), 4) for e in ends],
            "copy_ends_ms": [round(start.elapsed_time(e), 4) for e in copies]}


def names(launch) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        launch()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})[:4]


def main(argv: list[str]) -> int:
    out = open(argv[0], "w")
    side = torch.cuda.Stream()
    out.write(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__}) + "\n")
    wanted = argv[1:]
    table = kinds()
    unknown = sorted(set(wanted) - set(table))
    if unknown:
        print(f"side_burst_probe: unknown KIND {', '.join(unknown)}; allowed: {', '.join(table)}", file=sys.stderr)
        return 2
    for kind, launch in table.items():
        if wanted and kind not in wanted:
            continue
        try:
            kernel = names(launch)
        except Exception as exc:  # the profiler is an aid here, not the measurement
            kernel = [f"profiler failed: {exc}"[:200]]
        for n in (1, 8, 32):
            for mib in (8, 64, 208):
                res = run(launch, n, mib, side)
                out.write(json.dumps({"compute": kind, "kernels": kernel, "copies": n, "copy_mib": mib, **res}) + "\n")
                out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
