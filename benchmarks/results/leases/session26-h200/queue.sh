#!/bin/bash
# The plan for session 26's lease (qwen15-sharegpt.yaml's header says what and why), on the one H200 (the
# device's copy of the working tree at /tmp/repo; prepared/ carried and copied to /tmp/q15job/prepared by
# the call that starts this), as session 25's queue.sh and then the train/serve replay:
# 1. Qwen2.5-Coder-1.5B-Instruct built from its GGUF (the parts carried, joined into /tmp/g/qwen.gguf).
# 2. regen: the regenerate stage alone, 2 engine replicas on the GPU (session 25: 409 s).
# 3. qwen-job: the job as the file says (session 25: 629 s; the eval's extra rounds add up to 120 s).
# 4. train-serve: benchmarks/train_serve.py on the job's draft at k=3 (two engine starts, ~4 min).
# Each step's log and queue.log beside them; ../session24-h200/gather.sh packs /tmp/res for the collecting call.
L=/tmp/repo/benchmarks/results/leases/session26-h200
QUEUE_CONFIG=$L/qwen15-sharegpt.yaml QUEUE_CONTINUES=1 bash $L/../session25-h200/queue.sh  # steps 1-3
. /tmp/repo/benchmarks/results/leases/session16-h200/common.sh
bash $L/../session24-h200/gather.sh
step train-serve 600 python -m benchmarks.train_serve --job /tmp/q15job --k 3 --out /tmp/res/train-serve
rm -rf /tmp/res/train-serve/hidden_states
df -h /tmp >> $R/queue.log
echo "$(date +%T) queue done" >> $R/queue.log
bash $L/../session24-h200/gather.sh
touch $R/DONE
