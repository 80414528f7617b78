"""How fast the kernels of a training step run, and how a side stream's kernel is scheduled beside them.

Measures, on the GPU it runs on, what memplan.estimator.gpu_time turns operations and bytes into seconds with:

- ``gemm``: F.linear's forward and its two backward products (grad of the input, of the weight) at transformer
  shapes (tokens × in → out) in bf16, fp16 and fp32 (allow_tf32 off, torch's default): operations / time;
- ``attention``: F.scaled_dot_product_attention, causal, forward and backward, per backend (cuDNN, flash,
  memory-efficient) at the heads / sequence / head_dim of the measured jobs;
- ``memory``: a device-to-device copy and an elementwise add at 1 MiB to 1 GiB (bytes moved / time), and the
  time of an empty kernel back to back (the launch floor);
- ``side_stream``: with the compute stream holding a queue of matrix products, when an event recorded after a copy
  on a second stream completes — after the product running when the copy was launched, or after every product
  queued before it (DeepSpeed's all-gather stream copies and synchronizes its events that way, gpu_time.py);
- ``host``: the host's time per eager op with autograd, per nn.Module call, per backward node (tiny tensors, so
  the GPU is idle).

Timing: CUDA events around the region after warm-up, the median of several repeats (METHOD.md). Prints one JSON
object (and writes it to the path given as the only argument).

    python benchmarks/timing/gpu_kernels.py OUT.json
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

DEV = "cuda"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def timed(fn, reps: int = 5, warm: int = 2) -> float:
    """Median seconds of ``fn`` over ``reps`` runs (CUDA events), after ``warm`` runs."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def gemm_rows() -> list[dict]:
    shapes = [(4096, 896, 896), (4096, 896, 4864), (4096, 2048, 2048), (4096, 2048, 8192), (1024, 4096, 4096),
              (2048, 4096, 4096), (4096, 4096, 4096), (8192, 4096, 4096), (16384, 4096, 4096), (2048, 4096, 14336),
              (16384, 4096, 14336), (32768, 4096, 1024), (2048, 5120, 17920), (32768, 5120, 5120),
              (2048, 8192, 8192), (8192, 8192, 28672), (2048, 8192, 1024), (1024, 16384, 16384),
              (2048, 16384, 16384), (2048, 16384, 53248), (2048, 16384, 128256), (2048, 4096, 128256),
              (8192, 2048, 151936), (2048, 12288, 49152), (2048, 7168, 18432)]
    out = []
    for name, dt in DTYPES.items():
        for m, k, n in shapes:
            if m * (k + n) * 4 > 6 * 2**30 or k * n * 4 > 8 * 2**30:
                continue
            if dt == torch.float32 and m * k * n > 2 ** 40:
                continue
            x = torch.randn(m, k, device=DEV, dtype=dt)
            w = torch.randn(n, k, device=DEV, dtype=dt)
            g = torch.randn(m, n, device=DEV, dtype=dt)
            flops = 2.0 * m * k * n
            t_fwd = timed(lambda: F.linear(x, w))
            t_dx = timed(lambda: g @ w)
            t_dw = timed(lambda: g.t() @ x)
            out.append({"dtype": name, "m": m, "k": k, "n": n, "flops": flops, "fwd_s": t_fwd, "dgrad_s": t_dx,
                        "wgrad_s": t_dw})
            del x, w, g
    torch.cuda.empty_cache()
    return out


def attention_rows(dtype=torch.bfloat16) -> list[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    if dtype == torch.float32:  # fp32: only the memory-efficient kernel takes it
        backends = {"efficient": SDPBackend.EFFICIENT_ATTENTION}
    shapes = [(1, 32, 2048, 64), (1, 32, 4096, 128), (1, 32, 8192, 128), (1, 32, 16384, 128), (1, 4, 32768, 128),
              (1, 128, 2048, 128), (8, 40, 4096, 128), (1, 16, 32768, 128), (2, 32, 4096, 128)]
    out = []
    for name, be in backends.items():
        for b, h, s, d in shapes:
            q, k, v = (torch.randn(b, h, s, d, device=DEV, dtype=dtype, requires_grad=True)
                       for _ in range(3))
            flops = 4.0 * b * h * s * s * d / 2
            try:
                with sdpa_kernel([be]):
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    grad = torch.randn_like(o)
                    t_f = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))

                    def fb():
                        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                        y.backward(grad)
                    t_fb = timed(fb, reps=3)
                out.append({"backend": name, "b": b, "h": h, "s": s, "d": d, "flops": flops, "fwd_s": t_f,
                            "fwd_bwd_s": t_fb})
            except RuntimeError as err:
                out.append({"backend": name, "b": b, "h": h, "s": s, "d": d, "error": str(err)[:200]})
            del q, k, v
    torch.cuda.empty_cache()
    return out


def attention_fp32_rows() -> list[dict]:
    """sdpa's memory-efficient kernel in fp32 (what an fp32 job's attention runs), the shapes of attention_rows."""
    return attention_rows(torch.float32)


def host_link_rows() -> list[dict]:
    """Copies between pinned host memory and the GPU (the offload paths' ``.to(device, non_blocking=...)``):
    seconds per copy of 64 MiB to 1 GiB, each direction."""
    out = []
    for mib in (64, 256, 1024):
        host = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(mib << 20, dtype=torch.uint8, device=DEV)
        out.append({"bytes": mib << 20, "h2d_s": timed(lambda: dev.copy_(host, non_blocking=True)),
                    "d2h_s": timed(lambda: host.copy_(dev, non_blocking=True))})
        del host, dev
    torch.cuda.empty_cache()
    return out


def memory_rows() -> dict:
    rows = []
    for mib in (1, 4, 16, 64, 256, 1024):
        n = mib * 2**20 // 2
        a = torch.empty(n, device=DEV, dtype=torch.bfloat16).normal_()
        c = torch.empty_like(a)
        d = torch.empty_like(a)
        t_copy = timed(lambda: c.copy_(a), reps=9)
        t_add = timed(lambda: torch.add(a, c, out=d), reps=9)
        rows.append({"mib": mib, "copy_s": t_copy, "copy_bytes": 2 * a.nbytes, "add_s": t_add,
                     "add_bytes": 3 * a.nbytes})
    tiny = torch.zeros(1, device=DEV)
    n = 2000

    def many():
        for _ in range(n):
            tiny.add_(1)
    floor = timed(many, reps=3) / n
    return {"rows": rows, "kernel_floor_s": floor}


def side_stream_rows() -> list[dict]:
    """Compute: 12 products of ``size``³ queued back to back; at the 2nd, a copy of ``mib`` on a side stream and
    an event after it. Reports when the side event completed, from the first product's start, against each
    product's end."""
    out = []
    side = torch.cuda.Stream()
    for dtype, size in (("bf16", 8192), ("fp32", 4096)):
        dt = DTYPES[dtype]
        a = torch.randn(size, size, device=DEV, dtype=dt)
        b = torch.randn(size, size, device=DEV, dtype=dt)
        for mib in (1, 256, 1024):
            src = torch.empty(mib * 2**20 // 2, device=DEV, dtype=torch.bfloat16)
            dst = torch.empty_like(src)
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            ends = []
            start.record()
            for i in range(12):
                a @ b
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                ends.append(e)
                if i == 1:
                    host_t0 = time.perf_counter()
                    with torch.cuda.stream(side):
                        dst.copy_(src)
                        se = torch.cuda.Event(enable_timing=True)
                        se.record(side)
            se.synchronize()
            host_wait = time.perf_counter() - host_t0
            torch.cuda.synchronize()
            out.append({"dtype": dtype, "size": size, "copy_mib": mib,
                        "product_ends_ms": [start.elapsed_time(e) for e in ends],
                        "side_event_ms": start.elapsed_time(se), "host_wait_s": host_wait})
    return out


def host_rows() -> dict:
    x = torch.randn(8, 64, device=DEV, requires_grad=True)
    lin = torch.nn.Linear(64, 64, device=DEV)

    def ops(n=200):
        y = x
        for _ in range(n):
            y = y * 1.0001
        return y

    def modules(n=200):
        y = x
        for _ in range(n):
            y = lin(y)
        return y
    for _ in range(3):
        ops().sum().backward()
        modules().sum().backward()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    y = ops()
    t1 = time.perf_counter()
    y.sum().backward()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    z = modules()
    t3 = time.perf_counter()
    z.sum().backward()
    torch.cuda.synchronize()
    t4 = time.perf_counter()
    return {"op_s": (t1 - t0) / 200, "op_backward_node_s": (t2 - t1) / 200, "linear_module_s": (t3 - t2) / 200,
            "linear_backward_s": (t4 - t3) / 200}


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cudnn": torch.backends.cudnn.version(), "command": " ".join(sys.argv)}
    parts = (("host", host_rows), ("memory", memory_rows), ("side_stream", side_stream_rows), ("gemm", gemm_rows),
             ("attention", attention_rows), ("attention_fp32", attention_fp32_rows), ("host_link", host_link_rows))
    only = os.environ.get("PARTS")  # PARTS=attention_fp32,host_link: those parts only
    for name, fn in parts:
        if only and name not in only.split(","):
            continue
        t = time.time()
        try:
            res[name] = fn()
        except Exception as err:  # a part that fails is a result, the rest still runs
            res[name] = {"error": f"{type(err).__name__}: {err}"[:300]}
        print(f"{name}: {time.time() - t:.1f} s", file=sys.stderr, flush=True)
    text = json.dumps(res, indent=1)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(text)
    print(json.dumps({k: (v if k in ("device", "host", "side_stream") else "...") for k, v in res.items()})[:6000])


if __name__ == "__main__":
    main()
