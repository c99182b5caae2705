#!/bin/bash
# Session 13, second queue: the 1.5B target built (dequantized on the CPU while queue A holds the
# GPU), then its quality run once queue A is done (issue 27 section 6), then two Ray nodes sharing
# the GPU (issue 29) if time is left.
. /tmp/repo/benchmarks/results/leases/session13-h200/common.sh
step build-qwen 360 python -m benchmarks.real_targets --model qwen2.5-coder-1.5b --gguf /tmp/g/qwen.gguf --out /tmp/qwen15
while [ ! -f $R/A_DONE ]; do sleep 3; done
step quality-qwen 900 python -m benchmarks.quality_bench --target /tmp/qwen15 --out /tmp/qq --part all --tag h200-qwen2.5-coder-1.5b ${QQ_ARGS:-}
step two-node-1 300 python -m benchmarks.two_node --share-gpu --runs 1 --work-dir /tmp/tn --tag h200-shared-run1 --out $R
echo "$(date +%T) queue_b done" >> $R/queue.log
touch $R/B_DONE
