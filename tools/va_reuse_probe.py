"""GPU probe: where cudaMalloc places a segment after cudaFree released others (the driver's virtual addresses).

The allocator simulator (memplan.allocator.sim) breaks ties between equal-sized cached blocks by address, as
CUDACachingAllocator's BlockComparatorSize does, so it needs the addresses cudaMalloc hands out. It places each new
segment below the last and never reuses a range that cudaFree (torch.cuda.empty_cache) released; the driver
sometimes does (benchmarks/accuracy/traces-25/tr25-s5-024: the 822 MiB segments made after init's empty_cache start at
the freed 8016 MiB segment's address and go up), though in most committed traces it does not
(benchmarks/allocator/README.md). This replays sequences of raw cudaMalloc / cudaFree (torch with
PYTORCH_NO_CUDA_MEMORY_CACHING=1: one cudaMalloc of exactly the requested bytes per tensor, one cudaFree at its
deletion) and records each allocation's address, each sequence twice, each time in a fresh process:

- ``tr25``: the segment sequence of tr25-s5-024 (its sizes and which segment each free releases);
- ``holes``: patterns that tell the candidate rules apart (the lowest / highest / most recently freed hole, a hole
  of exactly the size, two holes of one size, a hole between live segments);
- ``random-K``: random alloc/free sequences of segment-like sizes (2 MiB multiples from 2 MiB to 8 GiB).

Each line: {"sequence", "ops": [["A", bytes, addr] | ["F", index of the alloc it frees]]}.

Usage (GPU machine): python tools/va_reuse_probe.py OUT.jsonl
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

MiB = 2**20
TR25 = [("A", 2), ("A", 8016), ("A", 126), ("A", 2), ("A", 2), ("A", 2), ("A", 8016), ("F", 2), ("F", 6),
        ("F", 1), ("F", 4), ("F", 5), ("F", 0), ("A", 822), ("A", 822), ("A", 822), ("A", 822), ("A", 8016),
        ("A", 256), ("A", 8192), ("A", 8192), ("A", 8192), ("A", 3328), ("A", 3328), ("A", 8192), ("A", 8192)]


def holes() -> list[tuple[str, int]]:
    seq: list[tuple[str, int]] = []
    # five 1 GiB segments, free the 2nd and 4th (two holes of one size), then 512 MiB, 1 GiB, 1 GiB, 2 GiB
    seq += [("A", 1024)] * 5 + [("F", 1), ("F", 3), ("A", 512), ("A", 1024), ("A", 1024), ("A", 2048)]
    # 20 MiB segments and small ones around them: free a middle one, ask for 20 MiB, 18 MiB, 2 MiB
    base = len([s for s in seq if s[0] == "A"])
    seq += [("A", 20)] * 6 + [("F", base + 2), ("A", 18), ("F", base + 4), ("A", 20), ("A", 2), ("A", 2)]
    base = len([s for s in seq if s[0] == "A"])
    # 3 GiB, 3 GiB, 3 GiB freed in order 0, 2, 1 (which hole first?), then 1 GiB three times, then 5 GiB
    seq += [("A", 3072)] * 3 + [("F", base), ("F", base + 2), ("F", base + 1)] + [("A", 1024)] * 3 + [("A", 5120)]
    return seq


def random_seq(seed: int, n: int = 80) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    sizes = [2, 2, 4, 20, 22, 126, 208, 512, 822, 1024, 1664, 3328, 4008, 8016, 8192]
    seq, live, made, total = [], [], 0, 0
    for _ in range(n):
        if live and (rng.random() < 0.4 or total > 40 * 1024):
            k = live.pop(rng.randrange(len(live)))
            seq.append(("F", k[0]))
            total -= k[1]
        else:
            s = rng.choice(sizes)
            seq.append(("A", s))
            live.append((made, s))
            made += 1
            total += s
    return seq


def child(seq: list) -> None:
    import torch

    torch.ones(1, device="cuda") @ torch.ones(1, 1, device="cuda")  # context and cuBLAS first, as in a job
    torch.cuda.synchronize()
    made: list = []
    ops = []
    for op, arg in seq:
        if op == "A":
            t = torch.empty(arg * MiB, dtype=torch.uint8, device="cuda")
            made.append(t)
            ops.append(["A", arg * MiB, t.data_ptr()])
        else:
            made[arg] = None
            ops.append(["F", arg])
    print(json.dumps(ops))


def main(argv: list[str]) -> int:
    if argv[0] == "--child":
        child(json.loads(argv[1]))
        return 0
    seqs = {"tr25": TR25, "holes": holes(), **{f"random-{k}": random_seq(k) for k in range(6)}}
    env = {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    with open(argv[0], "w") as out:
        for name, seq in seqs.items():
            for rep in range(2):  # twice: is the driver deterministic?
                p = subprocess.run([sys.executable, __file__, "--child", json.dumps(seq)], env=env,
                                   capture_output=True, text=True, timeout=120)
                line = {"sequence": name, "repeat": rep, "rc": p.returncode}
                if p.returncode == 0:
                    line["ops"] = json.loads(p.stdout.strip().splitlines()[-1])
                else:
                    line["error"] = p.stderr[-500:]
                out.write(json.dumps(line) + "\n")
                out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
