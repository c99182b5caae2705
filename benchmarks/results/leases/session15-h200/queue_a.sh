#!/bin/bash
# Session 15, queue A, started as soon as the carried site is unpacked (while the 1.5B's GGUF is
# still being carried, a call at a time): two Ray nodes sharing the GPU, run 2 (issue 29: the
# worker's raylet SIGKILLed mid-extraction and a replacement joining), on the tiny seeded target.
. /tmp/repo/benchmarks/results/leases/session15-h200/common.sh
nvidia-smi > $R/nvidia-smi.txt 2>&1
step two-node-run2 480 python -m benchmarks.two_node --share-gpu --runs 2 --work-dir /tmp/tn --keep-work \
  --tag h200-shared-run2 --out $R
echo "$(date +%T) queue_a done" >> $R/queue.log
touch $R/A_DONE
