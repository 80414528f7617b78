"""Development aid: how peak reserved, as the timed replay predicts it, moves with the host's speed.

ZeRO-3's deferred frees complete when the GPU has caught up (memplan.estimator.gpu_time), so the predicted peak
reserved depends on the host's seconds per op, per hook and per gathered parameter (estimator/timing.py), which
were measured on one machine and vary by run and by machine (a row's phase walls move by 2× between its steps).
For each ZeRO-3 row measured alone on its GPU (benchmarks/accuracy rows*.jsonl, shared_gpu false, no layered
rows) this replays the row's ledger with every host cost scaled by each factor given and prints one JSON line:
the error against the measured peak reserved of the replay with the GPU keeping up (``keep``) and of each scaled
timed replay (``x<factor>``), in percent. A row whose measurement lies outside the whole band is not explained by
the host's speed; a row whose band is wide is one where the timed replay is fragile.

Usage: python tools/host_speed_band.py [FACTORS] > band.jsonl   (FACTORS default 0.5,0.7,1.0,1.4,2.0)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from memplan.accuracy import _measured_points, iter_rows, job_of_row, skipped_steps
from memplan.allocator import simulate
from memplan.estimator import LEDGER_STEPS
from memplan.estimator.gpu_time import GpuRates, timed
from memplan.estimator.program import build_ledger
from memplan.estimator.summary import _training_reserved, allocator_config
from memplan.gpus import gpu_of_device


def main(argv: list[str]) -> int:
    factors = [float(x) for x in (argv[0] if argv else "0.5,0.7,1.0,1.4,2.0").split(",")]
    for path in sorted(Path("benchmarks/accuracy").glob("rows*.jsonl")):
        for row in iter_rows(path):
            job = job_of_row(row)
            if (row.get("status") != "ok" or job.training.zero.stage != 3 or row.get("layers")
                    or (row.get("batch") or {}).get("shared_gpu", True)):
                continue
            rates = GpuRates.of(gpu_of_device((row.get("env") or {}).get("gpu")))
            for name, pjob, _alloc, measured, _phase in _measured_points(row):
                L = build_ledger(pjob, steps=max(LEDGER_STEPS, row.get("steps", 3)), skipped=skipped_steps(row))
                if not L.stream_used or not measured:
                    continue
                config = allocator_config(pjob)
                keep = _training_reserved(simulate(L, config))
                host = list(L.work_cpu_s)
                rec = {"name": name, "rows": path.name, "measured_bytes": measured,
                       "keep": round((keep - measured) / measured * 100, 2)}
                for f in factors:
                    L.work_cpu_s[:] = [c * f for c in host]
                    late = timed(L, rates, row.get("mode", "emulated") == "emulated")
                    got = max(keep, _training_reserved(simulate(late, config)))
                    rec[f"x{f}"] = round((got - measured) / measured * 100, 2)
                L.work_cpu_s[:] = host
                print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
