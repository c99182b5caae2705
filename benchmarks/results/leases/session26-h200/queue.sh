#!/bin/bash
# The plan for session 26's lease (qwen15-sharegpt.yaml's header says what and why), on the one H200 (the
# device's copy of the working tree at /tmp/repo; prepared/ and session 25's regenerated/ carried and unpacked
# into /tmp/q15job by the calls before the one that starts this):
# 1. build-qwen: Qwen2.5-Coder-1.5B-Instruct built from its GGUF (the parts carried, joined into /tmp/g/qwen.gguf).
# 2. qwen-job: the job as the file says (regeneration found committed: no engine; 3,600 steps online, export,
#    eval with the speedups' intervals; session 25's 1,800-step job: 629 s).
# 3. train-serve: benchmarks/train_serve.py on the job's draft at k=3 (two engine starts, ~4 min).
# Each step's log and queue.log beside them; ../session24-h200/gather.sh packs /tmp/res for the collecting call.
. /tmp/repo/benchmarks/results/leases/session16-h200/common.sh
L=/tmp/repo/benchmarks/results/leases/session26-h200
C=${QUEUE_CONFIG:-$L/qwen15-sharegpt.yaml}  # session 27's queue runs these steps with its own file
nvidia-smi > $R/nvidia-smi.txt 2>&1
df -h /tmp >> $R/queue.log
step build-qwen 300 python -m eagle3.real_targets --model qwen2.5-coder-1.5b --gguf /tmp/g/qwen.gguf --out /tmp/qwen15
step qwen-job ${QUEUE_JOB_LIMIT:-1300} python -m ray_jobs.run --config $C
bash $L/../session24-h200/gather.sh
[ -z "${QUEUE_NO_TRAIN_SERVE:-}" ] && \
  step train-serve 600 python -m benchmarks.train_serve --job /tmp/q15job --k 3 --out /tmp/res/train-serve
rm -rf /tmp/res/train-serve/hidden_states
df -h /tmp >> $R/queue.log
echo "$(date +%T) queue done" >> $R/queue.log
bash $L/../session24-h200/gather.sh
touch $R/DONE
