#!/bin/bash
# The plan for the next lease (README.md beside this file), on one GPU machine: the device's copy of the working
# tree at /tmp/repo; .gpuprep2's prepared/ copied to /tmp/q15job/prepared and .gpuregen3's regenerated/ (session
# 30's 66 shards) untarred into /tmp/q15job by the calls before the one that starts this.
# 1. build-qwen: Qwen2.5-Coder-1.5B-Instruct built from its GGUF (the parts carried, joined into /tmp/g/qwen.gguf).
# 2. qwen-job: the job as qwen15-2layers.yaml says (the regenerate stage finds 66 of 66 shards committed and only
#    writes tokens.parquet again; online training with two draft layers, export, the eval with its speed windows).
#    train.num_steps is the file's 5,900, cut (by hundreds) to what the time left holds: 7.0 steps/s (session 30's
#    one-layer draft trained 8.87 steps/s on an H100; a second layer is guessed at ~20% more a step) and 560 s for
#    the rest of the job (set-up 68 s, first step 125 s on the H100, export and the feed's stop 35 s, the eval ~275 s
#    as in session 28, the job's own start and end ~20 s, ~35 s spare). A draft with its eval is worth more than
#    one cut before it (session 30 lost its eval so).
# Each step's log and queue.log beside them; ../session24-h200/gather.sh packs /tmp/res for the collecting call.
. /tmp/repo/benchmarks/results/leases/session16-h200/common.sh
L=/tmp/repo/benchmarks/results/leases/session30-plan
C=$L/qwen15-2layers.yaml
J=/tmp/q15job
left() { [ -s /tmp/queue_end ] && QUEUE_END=$(cat /tmp/queue_end); echo $(( QUEUE_END - $(date +%s) )); }
nvidia-smi > $R/nvidia-smi.txt 2>&1
df -h /tmp >> $R/queue.log
step build-qwen 300 python -m eagle3.real_targets --model qwen2.5-coder-1.5b --gguf /tmp/g/qwen.gguf --out /tmp/qwen15
RESERVE=560
STEPS=$(( ($(left) - RESERVE) * 70 / 10 / 100 * 100 ))
[ $STEPS -gt 5900 ] && STEPS=5900
echo "$(date +%T) $(left)s left, ${RESERVE}s kept for the rest of the job: train.num_steps $STEPS" >> $R/queue.log
step qwen-job 1500 python -m ray_jobs.run --config $C --set train.num_steps=$STEPS
df -h /tmp >> $R/queue.log
echo "$(date +%T) queue done" >> $R/queue.log
bash $L/../session24-h200/gather.sh
touch $R/DONE
