#!/bin/bash
# Started during session 32's lease, when queue.sh's warm-up had failed in a second (train.optimizer.warmup_steps 50
# against its 20 steps: the config refused it), so that its SmolLM2 job ran on cold caches: after queue.sh ends
# (/tmp/res/DONE), the same job again into a new output_dir, on the node the cold job warmed (a resubmitted job's
# caches: issue 28's <= 428 s), for what the lease has left.
. /tmp/repo/benchmarks/results/leases/session16-h200/common.sh
C=/tmp/repo/benchmarks/results/leases/session22-h200/smollm2-sharegpt.yaml
while [ ! -f $R/DONE ] && [ $(date +%s) -lt $(cat /tmp/queue_end) ]; do sleep 5; done
step smollm2-job-warm 720 python -m ray_jobs.run --config $C --set output_dir=/tmp/smoljob3
echo "$(date +%T) queue-after done" >> $R/queue.log
bash /tmp/repo/benchmarks/results/leases/gather_jobs.sh /tmp/smoljob3
touch $R/DONE2
