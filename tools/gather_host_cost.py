"""Development aid: what one gathered parameter costs ZeRO-3's host, from the lone rows' forward walls.

For every ZeRO-3 row measured alone (rows*.jsonl under benchmarks/accuracy, world > 1, no layered rows) this
builds the row's ledger twice, with estimator.timing.CPU_Z3_GATHER_S set to 0 and to 1 s, so that the difference
of step 2's forward host seconds counts the parameters gathered there, and counts the all-gather calls
(Zero3Params._all_gather with N > 1: one per communication dtype, or one for a single parameter). It prints one
JSON line per row: parameters, calls, the fake process group's copies (calls × world: FakeProcessGroup fills each
output chunk with its own copy), the measured wall, the replay's host seconds without the gathers, the compute
stream's GPU seconds, whether the phase is CPU-bound (GPU under half the wall) and the wall's remainder per
gathered parameter (the quantity CPU_Z3_GATHER_S was taken as the median of).

Usage: python tools/gather_host_cost.py > gather-host-cost.jsonl
"""
from __future__ import annotations

import json
from pathlib import Path
import memplan.estimator.zero3_params as zp
from memplan.accuracy import iter_rows, job_of_row, skipped_steps
from memplan.estimator import LEDGER_STEPS
from memplan.estimator.program import build_ledger
from memplan.estimator.gpu_time import GpuRates
from memplan.gpus import gpu_of_device
from memplan.estimator.timing import FAKE_COLLECTIVE
from memplan.ledger import NO_WAIT
orig = zp.Zero3Params._all_gather
CALLS = []
def counting(self, names):
    todo = [p for p in dict.fromkeys(names) if p not in self.avail and p not in self.inflight]
    if todo and self.n > 1:
        ncalls = 1 if len(todo) == 1 else len({self.w[p] for p in todo})
        CALLS.append((len(self.L.work_at), ncalls, self.n))
    return orig(self, names)
zp.Zero3Params._all_gather = counting
def phase_host(L, label):
    marks = L.marks; mw = L.mark_work
    idx = [i for i,m in enumerate(marks) if m.label == label][0]
    a = mw[idx]; b = mw[idx+1] if idx+1 < len(marks) else len(L.work_at)
    # the fake process group's copies (FAKE_COLLECTIVE records) stay out: the ``copies`` column counts them apart
    return a, b, sum(c for c, kind in zip(L.work_cpu_s[a:b], L.work_kernel[a:b]) if kind != FAKE_COLLECTIVE)
def gpu_s(L, a, b, rates):
    return sum(rates.seconds(L.work_kernel[k], L.work_flops[k], L.work_bytes[k]) for k in range(a,b) if L.work_wait[k] == NO_WAIT and L.work_stream[k] == 0 and L.work_kernel[k] != FAKE_COLLECTIVE)
for path in sorted(Path('benchmarks/accuracy').glob('rows*.jsonl')):
    for row in iter_rows(path):
        job = job_of_row(row)
        if row.get('status')!='ok' or job.training.zero.stage!=3 or row.get('layers') or (row.get('batch') or {}).get('shared_gpu', True): continue
        if job.layout.world < 2: continue
        rates = GpuRates.of(gpu_of_device((row.get('env') or {}).get('gpu')))
        ph = {p['name']: p.get('wall_s') for p in row['phases']}
        label = 'step2.micro0.forward' if 'step2.micro0.forward' in ph else None
        if not label or not ph[label]: continue
        zp.CPU_Z3_GATHER_S = 0.0; CALLS.clear()
        L0 = build_ledger(job, steps=max(LEDGER_STEPS,3), skipped=skipped_steps(row))
        a,b,h0 = phase_host(L0, label)
        calls = sum(c for at, c, _n in CALLS if a <= at < b)
        zp.CPU_Z3_GATHER_S = 1.0
        L1 = build_ledger(job, steps=max(LEDGER_STEPS,3), skipped=skipped_steps(row))
        _,_,h1 = phase_host(L1, label)
        params = round(h1 - h0)
        g = gpu_s(L0, a, b, rates)
        wall = ph[label]
        if params == 0: continue
        resid = (wall - h0) / params
        print(json.dumps(dict(name=row["name"], gpu=(row.get("env") or {}).get("gpu"), world=job.layout.world, sp=job.layout.sp, params=params, calls=calls, copies=calls * job.layout.world if row.get("mode", "emulated") == "emulated" else 0, wall_ms=round(wall*1e3,1), host_wo_gather_ms=round(h0*1e3,1), gpu_ms=round(g*1e3,1), cpu_bound=g < 0.5*wall, resid_per_param_ms=round(resid*1e3,3))), flush=True)
