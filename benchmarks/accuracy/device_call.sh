#!/bin/bash
# One GPU session's measurements (the exact command behind rows-*.jsonl committed from it), run from the
# repository root on the GPU machine with .whl (../shared/tools/device-wheels.sh) and .whl-megatron carried:
#   bash benchmarks/accuracy/device_call.sh MATRIX.jsonl DEADLINE_S [MEGATRON_MATRIX]
# Builds DeepSpeed's JIT ops in parallel (or unpacks .ds_ops.tgz when carried), runs the Megatron matrix beside
# the verify batch, and leaves rows, compact allocation traces, the built ops and logs under $OUT.
set -u
matrix=$1; deadline=$2; mega=${3:-}; workers=${WORKERS:-12}  # WORKERS: concurrent jobs (fewer: less GPU sharing)
t0=$(date +%s)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCH_CUDA_ARCH_LIST=9.0 TORCH_EXTENSIONS_DIR=/tmp/ds_ops
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl $(ls .whl-megatron/*.whl 2>/dev/null) 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD/src
mkdir -p /tmp/ds_ops /tmp/memplan-traces
[ -f .ds_ops.tgz ] && tar xzf .ds_ops.tgz -C /tmp/ds_ops
pids=()
for b in FusedAdamBuilder CPUAdamBuilder FusedLionBuilder; do
  python3 -c "from deepspeed.ops.op_builder import $b; $b().load()" > /tmp/build-$b.log 2>&1 &
  pids+=($!)
done
if [ -n "$mega" ]; then
  python3 -m memplan.verify.megatron_runner "$mega" --out /tmp/mc --workers 2 --gpu-budget-gib 36 \
    --deadline $((deadline - 60)) --timeout 150 --work /tmp/mc-work > /tmp/mc.log 2>&1 &
  mpid=$!
fi
for p in "${pids[@]}"; do wait "$p"; done
echo "ops built at $(( $(date +%s) - t0 )) s: $(ls /tmp/ds_ops)"
left=$(( deadline - ($(date +%s) - t0) ))
python3 -m memplan.verify.batch "$matrix" --out /tmp/b --workers "$workers" --gpu-budget-gib $([ -n "$mega" ] && echo 96 || echo 128) \
  --host-budget-gib 90 --node-gpus 1 --deadline "$left" --no-prebuild > /tmp/batch.log 2>&1
[ -n "$mega" ] && wait "$mpid"
cp /tmp/b/rows.jsonl $OUT/rows.jsonl 2>/dev/null
[ -n "$mega" ] && cp /tmp/mc/rows.jsonl $OUT/rows-megatron.jsonl 2>/dev/null
(cd /tmp/b/work && find . -name 'trace-rank*.json.gz' | tar czf $OUT/traces.tgz -T -) 2>/dev/null
(cd /tmp/ds_ops && tar czf $OUT/ds_ops.tgz .)
tail -c 200000 /tmp/batch.log > $OUT/batch.log; cat /tmp/build-*.log /tmp/mc.log 2>/dev/null | tail -c 100000 > $OUT/other.log
grep -c . /tmp/b/rows.jsonl; tail -n 25 /tmp/batch.log; echo "total $(( $(date +%s) - t0 )) s"
