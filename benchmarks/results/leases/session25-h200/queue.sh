#!/bin/bash
# The plan for session 25's lease (qwen15-sharegpt.yaml's header says what and why), on the one H200 (the
# device's copy of the working tree at /tmp/repo; prepared/ carried and copied to /tmp/q15job/prepared by
# the call that starts this):
# 1. Qwen2.5-Coder-1.5B-Instruct built from its GGUF (the parts carried, joined into /tmp/g/qwen.gguf).
# 2. regen: the regenerate stage alone, 2 engine replicas on the GPU, each a given 20 GiB KV cache; its
#    report kept as regen-report.json.
# 3. qwen-job: the job as the file says (regeneration found committed: no engine; online training, export,
#    eval), to its end.
# Each step's log and queue.log beside them; ../session24-h200/gather.sh (the same job folder) packs /tmp/res for the collecting call.
. /tmp/repo/benchmarks/results/leases/session16-h200/common.sh
L=/tmp/repo/benchmarks/results/leases/session25-h200
C=${QUEUE_CONFIG:-$L/qwen15-sharegpt.yaml}  # session 26's queue runs these steps with its own file
nvidia-smi > $R/nvidia-smi.txt 2>&1
df -h /tmp >> $R/queue.log
step build-qwen 300 python -m eagle3.real_targets --model qwen2.5-coder-1.5b --gguf /tmp/g/qwen.gguf --out /tmp/qwen15
step regen 900 python -m ray_jobs.run --config $C --set 'stages=["regenerate"]' --set extract.replicas_per_gpu=2 \
  --set extract.kv_cache_memory_bytes=21474836480
cp /tmp/q15job/report.json $R/regen-report.json 2>/dev/null
step qwen-job 1200 python -m ray_jobs.run --config $C
[ -n "${QUEUE_CONTINUES:-}" ] && exit 0  # session 26's queue goes on after these steps
df -h /tmp >> $R/queue.log
echo "$(date +%T) queue done" >> $R/queue.log
bash $L/../session24-h200/gather.sh
touch $R/DONE
