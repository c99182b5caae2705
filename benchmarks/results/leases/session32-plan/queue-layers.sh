#!/bin/bash
# The next lease's queue (written after session 32's, which measured the warm job: ../session32-h100/): issue 27's
# "AL against the number of draft layers" on SmolLM2 (target AL(k=3) >= 2.4; one layer: 1.86). The job once, on the
# node's cold caches (~800-850 s expected: session 32's reached its eval at 612 s and was cut there at 720 s), then the same draft with two decoder layers trained
# on that job's own prepared, regenerated and extracted data (linked, not redone: train, export and eval only, on
# caches the job warmed), its eval with the same speed windows: does the second layer's AL pay for its latency?
#   BUDGET=<the last reply's lease.budget_left_s> QUEUE=queue-layers.sh bash benchmarks/results/leases/session32-plan/last.sh
. /tmp/repo/benchmarks/results/leases/session16-h200/common.sh
L=/tmp/repo/benchmarks/results/leases/session32-plan
C=/tmp/repo/benchmarks/results/leases/session22-h200/smollm2-sharegpt.yaml
nvidia-smi > $R/nvidia-smi.txt 2>&1
step build-smollm2 240 python -m eagle3.real_targets --model smollm2 --gguf /tmp/g/smollm2.gguf --out /tmp/smollm2
# The one-layer job's speed windows stop at their 5 repeats (eval.speed_max_s=0: ~130 s less; session 32 measured its
# 13-round figures warm), so that the two-layer run, with the default rounds, fits the lease.
step smollm2-job 900 python -m ray_jobs.run --config $C --set eval.speed_max_s=0
bash $L/gather.sh
mkdir -p /tmp/smoljob2 && ln -sfn /tmp/smoljob/prepared /tmp/smoljob2/prepared && \
  ln -sfn /tmp/smoljob/regenerated /tmp/smoljob2/regenerated && ln -sfn /tmp/smoljob/hidden_states /tmp/smoljob2/hidden_states
step smollm2-2layers 600 python -m ray_jobs.run --config $C --set output_dir=/tmp/smoljob2 \
  --set 'stages=["train","export","eval"]' --set train.draft.num_draft_layers=2 --set doctor=false
echo "$(date +%T) queue done" >> $R/queue.log
bash $L/gather.sh
touch $R/DONE
