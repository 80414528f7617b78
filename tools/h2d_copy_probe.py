"""Development aid (GPU only): when does a host-to-device copy on a side stream run, while the compute stream is busy
with a long chain of gemms? The question behind trace19-s2-047 (ZeRO-3 at one rank with parameter offload): its
partitions reach the GPU through ``ds_tensor.to(device, non_blocking=True)`` on the all-gather stream
(partition_parameters.NoGatherHandle), while at two ranks and more the blocking copies complete with the running
gemm (lone2-s4-037's trace). The replay in memplan.estimator.gpu_time starts a side-stream kernel, host-link copies
included, once the compute kernel running at its launch has ended.

For each source (pinned, pageable), each mode (non_blocking True / False) and each size, the probe launches the
gemm chain on the default stream, issues the copy on a side stream the way DeepSpeed does (``torch.cuda.stream``
then ``.to``), and reports, in milliseconds from the chain's first kernel: when the host returned from ``.to``, when
the side stream reached the copy (an event before it), when the copy completed (an event after it), and when each
gemm of the chain ended. One JSON line per case on stdout. Exit status 2 without CUDA.

Usage: python tools/h2d_copy_probe.py [--gemms 30] [--mib 8,32,256]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

if not torch.cuda.is_available():
    print("h2d_copy_probe: needs CUDA", file=sys.stderr)
    sys.exit(2)


def one_case(pinned: bool, non_blocking: bool, nbytes: int, gemms: int, delay_gemms: int) -> dict:
    dev = torch.device("cuda")
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=pinned)
    src.fill_(1.0)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(gemms)]
    before = torch.cuda.Event(enable_timing=True)
    after = torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    outs = []
    for i in range(gemms):
        outs.append(a @ a)
        ends[i].record()
        if i == delay_gemms:
            t_issue = time.perf_counter()
            with torch.cuda.stream(side):
                before.record(side)
                dst = src.to(dev, non_blocking=non_blocking)
                after.record(side)
            t_return = time.perf_counter()
    t_launched = time.perf_counter()
    torch.cuda.synchronize()
    ms = lambda e: round(start.elapsed_time(e), 3)  # noqa: E731
    del dst, outs
    return {"pinned": pinned, "non_blocking": non_blocking, "bytes": nbytes, "copy_after_gemm": delay_gemms,
            "host_issue_ms": round((t_issue - t0) * 1e3, 3), "host_return_ms": round((t_return - t0) * 1e3, 3),
            "host_all_launched_ms": round((t_launched - t0) * 1e3, 3),
            "side_reached_ms": ms(before), "copy_done_ms": ms(after), "gemm_end_ms": [ms(e) for e in ends]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gemms", type=int, default=30)
    ap.add_argument("--mib", default="8,32,256")
    args = ap.parse_args()
    one_case(True, True, 1 << 20, 3, 1)  # warm-up: cuBLAS handle, pinned pool, stream pool
    for mib in (int(m) for m in args.mib.split(",")):
        for pinned in (True, False):
            for non_blocking in (True, False):
                print(json.dumps(one_case(pinned, non_blocking, mib << 20, args.gemms, 2)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
