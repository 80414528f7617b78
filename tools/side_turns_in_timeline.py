"""Development aid: in a CUPTI timeline (tools/kernel_timeline.py --raw), who runs next when a side stream's item ends
and both its next item and a compute kernel are ready.

For each pair of consecutive items on the side stream where the second was launched before the first ended, and a
compute-stream kernel launched before that end starts at or after it: did the side item or the compute kernel run
first? Counted by kind (a copy or a kernel) and size of the side item. A compute kernel whose launch CUPTI did not
correlate (cuBLAS's cuLaunchKernelEx) counts as ready.

Usage: python tools/side_turns_in_timeline.py RAW.json.gz SIDE_STREAM COMPUTE_STREAM
(benchmarks/timing/kernel-timeline-h100-fixed/lone2-s10-031.raw.json.gz: all-gather stream 13, compute stream 7)
"""
from __future__ import annotations

import bisect
import collections
import gzip
import json
import sys


def main(argv: list[str]) -> int:
    events = json.load(gzip.open(argv[0]))["traceEvents"]
    side, compute = int(argv[1]), int(argv[2])
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    launched = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    s_items = [e for e in gpu if e["args"].get("stream") == side]
    c_items = [e for e in gpu if e["args"].get("stream") == compute]
    c_starts = [e["ts"] for e in c_items]
    counts: collections.Counter = collections.Counter()
    for a, b in zip(s_items, s_items[1:]):
        end = a["ts"] + a["dur"]
        if launched.get(b["args"].get("correlation"), end + 1) > end:
            continue  # the next side item was not ready when this one ended
        j = bisect.bisect_left(c_starts, end - 1)
        ready = next((c for c in c_items[j:j + 5]
                      if launched.get(c["args"].get("correlation"), end) <= end), None)
        if ready is None:
            continue
        mib = b["args"].get("bytes", 0) / 2**20
        size = "< 16 MiB" if mib < 16 else "< 128 MiB" if mib < 128 else ">= 128 MiB"
        kind = "copy" if "Memcpy" in b["name"] else "kernel"
        counts[(kind, size, "side first" if b["ts"] <= ready["ts"] else "compute first")] += 1
    for key, n in sorted(counts.items()):
        print(f"{key[0]:6} {key[1]:10} {key[2]:13} {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
