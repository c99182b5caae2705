#!/bin/bash
# Session 33's queue on one GPU machine (the device's copy of the working tree at /tmp/repo): issue 28's whole SmolLM2
# job on a warm node (<= 428 s) at this session's code, where the eval's engines start while the draft trains
# (eval.start_during_training auto: on for this 135M target) and its timed rounds stop where more of them cannot reach
# +-5%; then, with what the lease has left, issue 27's "AL against the number of draft layers" (two layers).
# 1. a small warm-up job on the node's cold caches (400 records, 64-token turns, 60 steps; its windows at their 5
#    repeats), which also runs the new path once;
# 2. the job itself, warm: ../session22-h200/smollm2-sharegpt.yaml unchanged (its engines during training unless the
#    warm-up failed: then with eval.start_during_training=false, so that the job still measures the rest);
# 3. the same draft with two decoder layers on that job's own data (linked: train, export and eval only);
# 4. the one-layer draft served at k=2 (the eval alone).
# Each step's log and queue.log beside them; gather.sh packs /tmp/res for the collecting call.
. /tmp/repo/benchmarks/results/leases/session16-h200/common.sh
L=/tmp/repo/benchmarks/results/leases/session33-plan
C=/tmp/repo/benchmarks/results/leases/session22-h200/smollm2-sharegpt.yaml
nvidia-smi > $R/nvidia-smi.txt 2>&1
step build-smollm2 240 python -m eagle3.real_targets --model smollm2 --gguf /tmp/g/smollm2.gguf --out /tmp/smollm2
step warmup-job 600 python -m ray_jobs.run --config $C --set output_dir=/tmp/warmjob --set prepare.max_samples=400 \
  --set regenerate.max_tokens=64 --set train.num_steps=60 --set train.optimizer.warmup_steps=5 --set eval.speed_max_s=0
bash $L/gather.sh
if grep -q "end warmup-job rc=0 " $R/queue.log; then
  step smollm2-job 720 python -m ray_jobs.run --config $C
else
  step smollm2-job 720 python -m ray_jobs.run --config $C --set eval.start_during_training=false
fi
bash $L/gather.sh
mkdir -p /tmp/smoljob2 && ln -sfn /tmp/smoljob/prepared /tmp/smoljob2/prepared && \
  ln -sfn /tmp/smoljob/regenerated /tmp/smoljob2/regenerated && ln -sfn /tmp/smoljob/hidden_states /tmp/smoljob2/hidden_states
step smollm2-2layers 600 python -m ray_jobs.run --config $C --set output_dir=/tmp/smoljob2 \
  --set 'stages=["train","export","eval"]' --set train.draft.num_draft_layers=2 --set doctor=false
# 4. With what is still left: the one-layer job's draft served at k=2 (the eval stage alone, its engines started now):
#    does one draft token fewer turn batch 16's 0.91x (session 33) around?
mkdir -p /tmp/smoljobk2 && for d in prepared regenerated hidden_states train draft; do ln -sfn /tmp/smoljob/$d /tmp/smoljobk2/$d; done
step smollm2-k2 300 python -m ray_jobs.run --config $C --set output_dir=/tmp/smoljobk2 --set 'stages=["eval"]' \
  --set 'eval.num_speculative_tokens=[2]' --set doctor=false
echo "$(date +%T) queue done" >> $R/queue.log
bash $L/gather.sh
touch $R/DONE
