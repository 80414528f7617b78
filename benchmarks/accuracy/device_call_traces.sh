#!/bin/bash
# One GPU session's trace measurements (the exact command behind rows-*-19*.jsonl), run from the repository root on
# the GPU machine with .whl carried (../shared/tools/device-wheels.sh; .ds_ops.tgz too when a previous call built
# DeepSpeed's ops):
#   bash benchmarks/accuracy/device_call_traces.sh DEADLINE_S SHARED_MATRIX|- [LONE_MATRIX ...]
# SHARED_MATRIX runs WORKERS (default 4) jobs at a time (diagnosis traces: the order of allocations, not the GPU's
# pace), each LONE_MATRIX one job at a time (nothing shares the GPU or the host: what a user's job sees).
# Allocation traces are recorded without stacks. Leaves under $OUT: rows-shared.jsonl, rows-lone.jsonl,
# traces.tgz, ds_ops.tgz, env.txt and the logs.
set -u
deadline=$1; shared=$2; shift 2
t0=$(date +%s)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/tmp/ds_ops MEMPLAN_TRACE_STACKS=0
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/src
mkdir -p /tmp/ds_ops /tmp/memplan-traces
[ -f .ds_ops.tgz ] && tar xzf .ds_ops.tgz -C /tmp/ds_ops
(nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv; lscpu | head -20) > $OUT/env.txt 2>&1
pids=()
for b in FusedAdamBuilder CPUAdamBuilder FusedLionBuilder; do
  python3 -c "from deepspeed.ops.op_builder import $b; $b().load()" > /tmp/build-$b.log 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
echo "ops built at $(( $(date +%s) - t0 )) s: $(ls /tmp/ds_ops)"
run() {  # matrix out-name workers
  left=$(( deadline - ($(date +%s) - t0) ))
  [ "$left" -lt 40 ] && { echo "no time left for $1"; return; }
  python3 -m memplan.verify.batch "$1" --out /tmp/b-$2 --workers "$3" --gpu-budget-gib "${GPU_BUDGET_GIB:-70}" --host-budget-gib 90 \
    --node-gpus 1 --deadline "$left" --no-prebuild > /tmp/batch-$2.log 2>&1
  cat /tmp/b-$2/rows.jsonl >> $OUT/rows-$2.jsonl 2>/dev/null
  echo "$2 $(basename $1): $(grep -c . /tmp/b-$2/rows.jsonl 2>/dev/null) rows at $(( $(date +%s) - t0 )) s"
}
[ "$shared" != - ] && run "$shared" shared "${WORKERS:-4}"
for m in "$@"; do run "$m" lone 1; done
(cd /tmp && find b-*/work -name 'trace-rank*.json.gz' | tar czf $OUT/traces.tgz -T -) 2>/dev/null
(cd /tmp/ds_ops && tar czf $OUT/ds_ops.tgz .)
cat /tmp/batch-*.log 2>/dev/null | tail -c 200000 > $OUT/batch.log
cat /tmp/build-*.log 2>/dev/null | tail -c 100000 > $OUT/other.log
tail -n 5 /tmp/batch-*.log 2>/dev/null | cut -c1-300; echo "total $(( $(date +%s) - t0 )) s"
