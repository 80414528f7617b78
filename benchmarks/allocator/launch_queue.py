"""How far the CPU can run ahead of the GPU: the depth of CUDA's launch queue on one stream.

A long kernel (torch.cuda._sleep) holds the GPU; the host then launches tiny kernels and times each launch.
Launches return at once while the queue has room; the first launch that blocks (takes longer than
BLOCKED_S) shows the depth. Repeated for kernel launches with and without allocations between them, and
for a side stream. Writes JSON to the path given (or stdout). Run on the GPU machine:
    python benchmarks/allocator/launch_queue.py OUT.json
"""

import json
import sys
import time

import torch

BLOCKED_S = 2e-3  # a launch that took this long waited for room in the queue
LAUNCHES = 20000
SLEEP_CYCLES = int(4e9)  # about 2 s at the H200's ~1.98 GHz


def depth(kind: str, stream=None) -> dict:
    x = torch.zeros(16, device="cuda")
    torch.cuda.synchronize()
    ctx = torch.cuda.stream(stream) if stream is not None else torch.cuda.stream(torch.cuda.current_stream())
    times = []
    with ctx:
        torch.cuda._sleep(SLEEP_CYCLES)
        t_start = time.perf_counter()
        for _ in range(LAUNCHES):
            t = time.perf_counter()
            if kind == "add_":
                x.add_(1)
            elif kind == "alloc+add":
                y = x + 1  # a new 64-byte output each launch (small pool), freed at once
                del y
            times.append(time.perf_counter() - t)
            if times[-1] > BLOCKED_S:
                break
    blocked_at = len(times) - 1 if times[-1] > BLOCKED_S else None
    torch.cuda.synchronize()
    return {"kind": kind, "stream": "side" if stream is not None else "default", "first_blocked_launch": blocked_at,
            "blocked_s": times[-1] if blocked_at is not None else None,
            "mean_launch_us": 1e6 * sum(times[:-1]) / max(1, len(times) - 1),
            "host_s_until_blocked": time.perf_counter() - t_start}


def main() -> None:
    torch.cuda.init()
    out = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0), "blocked_s_threshold": BLOCKED_S,
           "runs": []}
    for _ in range(2):
        out["runs"].append(depth("add_"))
        out["runs"].append(depth("alloc+add"))
        out["runs"].append(depth("add_", torch.cuda.Stream()))
    text = json.dumps(out, indent=1)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
