#!/bin/bash
# One GPU call of tools/kernel_timeline.py (the exact command behind kernel-timeline-*.json), run from the repository
# root on the GPU machine with .whl carried:  bash benchmarks/timing/kernel_timeline_call.sh DEADLINE_S ROWS:NAME ...
# Each job runs alone (one at a time), emulated as memplan.verify's worker runs it, under torch.profiler (CUDA
# activity only). Leaves under $OUT: NAME.json per job, env.txt, logs.
set -u
deadline=$1; shift
t0=$(date +%s)
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/tmp/ds_ops
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/src
mkdir -p /tmp/ds_ops
(nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; lscpu | head -20;
 python3 -c "import torch, deepspeed, transformers; print(torch.__version__, deepspeed.__version__, transformers.__version__)") > $OUT/env.txt 2>&1
pids=()
for b in FusedAdamBuilder CPUAdamBuilder; do
  python3 -c "from deepspeed.ops.op_builder import $b; $b().load()" > /tmp/build-$b.log 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
echo "ops built at $(( $(date +%s) - t0 )) s"
for spec in "$@"; do
  rows=${spec%%:*}; name=${spec#*:}
  left=$(( deadline - ($(date +%s) - t0) ))
  [ "$left" -lt 60 ] && { echo "no time left for $name"; continue; }
  timeout "$left" python3 tools/kernel_timeline.py "$rows" "$name" "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "$name rc $? at $(( $(date +%s) - t0 )) s: $(tail -n 1 $OUT/$name.log | cut -c1-200)"
done
echo "total $(( $(date +%s) - t0 )) s"
