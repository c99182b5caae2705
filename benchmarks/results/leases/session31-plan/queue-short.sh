#!/bin/bash
# The same lease's queue for under ~1,250 s (README.md beside this file): issue 28's doctor on a warm node (<= 30 s;
# sessions 22-23 measured 36-39 s inside the job, beside prepare), then the SmolLM2 job once on a node whose engines'
# compile caches are cold (session 22's cold run: 612 s), for its stage times and AL at this code.
# 1. build-smollm2; 2. the doctor three times, the first on a cold node (`python -m ray_jobs.doctor`, the job's config:
# a Ray start, one task with the 2-layer dry run); 3. the job (../session22-h200/smollm2-sharegpt.yaml).
. /tmp/repo/benchmarks/results/leases/session16-h200/common.sh
L=/tmp/repo/benchmarks/results/leases/session31-plan
C=/tmp/repo/benchmarks/results/leases/session22-h200/smollm2-sharegpt.yaml
nvidia-smi > $R/nvidia-smi.txt 2>&1
step build-smollm2 240 python -m eagle3.real_targets --model smollm2 --gguf /tmp/g/smollm2.gguf --out /tmp/smollm2
for i in 1 2 3; do step doctor-$i 180 python -m ray_jobs.doctor --config $C --json $R/doctor-$i.json; ray stop > /dev/null 2>&1; done
step smollm2-job 900 python -m ray_jobs.run --config $C
echo "$(date +%T) queue done" >> $R/queue.log
bash $L/gather.sh
touch $R/DONE
