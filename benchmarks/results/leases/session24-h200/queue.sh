#!/bin/bash
# Session 24's queue on the one H200 (the device's copy of the working tree at /tmp/repo; prepared/
# carried and copied to /tmp/q15job/prepared by the call that starts this):
# 1. Qwen2.5-Coder-1.5B-Instruct built from its GGUF (the parts carried, joined into /tmp/g/qwen.gguf).
# 2. qwen-job: qwen15-sharegpt.yaml (its header says what and why) to its end: regenerate, online
#    training, export, eval.
# Each step's log and queue.log beside them; gather.sh packs /tmp/res for the collecting call.
. /tmp/repo/benchmarks/results/leases/session16-h200/common.sh
L=/tmp/repo/benchmarks/results/leases/session24-h200
nvidia-smi > $R/nvidia-smi.txt 2>&1
df -h /tmp >> $R/queue.log
step build-qwen 300 python -m eagle3.real_targets --model qwen2.5-coder-1.5b --gguf /tmp/g/qwen.gguf --out /tmp/qwen15
step qwen-job 1500 python -m ray_jobs.run --config $L/qwen15-sharegpt.yaml
df -h /tmp >> $R/queue.log
echo "$(date +%T) queue done" >> $R/queue.log
bash $L/gather.sh
touch $R/DONE
