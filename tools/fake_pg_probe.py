"""Development aid: what torch's fake process group costs the host per collective, by world size, on a GPU.

memplan.verify measures an N-rank DeepSpeed job as rank 0 on one GPU over torch's fake process group
(../shared/docs/emulation.md). Its collectives allocate nothing, but they are not free: FakeProcessGroup
(torch/csrc/distributed/c10d/FakeProcessGroup.hpp) fills every output from the local input, so
``_allgather_base`` (all_gather_into_tensor, what ZeRO-3's all_gather_coalesced and _all_gather_sequential call)
copies the input into each of the output's ``world`` chunks, while ``_reduce_scatter_base`` and
``alltoall_base`` copy once. A ZeRO-3 all-gather at world 64 is 64 device-to-device copies launched from C++,
which slows the host and changes how far the GPU runs behind it (memplan.estimator.gpu_time).

For each world size and partition size this times, with the GPU idle before each batch, the host's seconds per
call (perf_counter around 200 calls, no synchronization inside) and the GPU's (CUDA events around the same
calls), for all_gather_into_tensor, reduce_scatter_tensor and all_to_all_single, and a reference: one Python
``out.copy_(inp)`` per call. Prints one JSON object per line.

Usage (on the GPU machine): python tools/fake_pg_probe.py > fake-pg-h100.jsonl
"""
from __future__ import annotations

import json
import os
import time

CALLS = 200
WORLDS = (2, 8, 16, 32, 64)
PART_BYTES = (64 * 1024, 1024 * 1024, 8 * 1024 * 1024)


def main() -> int:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.cuda.set_device(0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
    for world in WORLDS:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        for part in PART_BYTES:
            n = part // 2
            inp = torch.empty(n, dtype=torch.bfloat16, device="cuda")
            out = torch.empty(n * world, dtype=torch.bfloat16, device="cuda")
            small = torch.empty(n, dtype=torch.bfloat16, device="cuda")
            other = torch.empty_like(out)
            calls = {
                "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(out, inp),
                "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(small, out),
                "all_to_all_single": lambda: dist.all_to_all_single(other, out),
                "python_copy_": lambda: small.copy_(inp),
            }
            for name, fn in calls.items():
                for _ in range(10):
                    fn()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                t0 = time.perf_counter()
                for _ in range(CALLS):
                    fn()
                host = (time.perf_counter() - t0) / CALLS
                end.record()
                torch.cuda.synchronize()
                gpu = start.elapsed_time(end) / 1e3 / CALLS
                print(json.dumps({"world": world, "part_bytes": part, "call": name, "host_s_per_call": round(host, 8),
                                  "gpu_s_per_call": round(gpu, 8), "calls": CALLS,
                                  "device": torch.cuda.get_device_name(0), "torch": torch.__version__}), flush=True)
            del inp, out, small, other
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
