#!/bin/bash
# Session 32's queue on one GPU machine (the device's copy of the working tree at /tmp/repo): session 31's
# ../session31-plan/queue.sh (a small cold warm-up, then issue 28's whole SmolLM2 job on the warm node, <= 428 s,
# and its AL for issue 27), then, with what the lease has left, the same draft with two decoder layers trained on
# that job's own prepared, regenerated and extracted data (linked, not redone: train, export and eval only), for
# issue 27's "AL against the number of draft layers" on SmolLM2 (its target: AL(k=3) >= 2.4).
# Ran in session 32's lease (../session32-h100/): its warm-up failed in 1 s (20 steps under the config's 50 warmup
# steps; train.optimizer.warmup_steps=5 since), so the job ran cold and was cut in its eval; queue-after.sh then ran
# the job warm, and the two-layer step was made to fail at once to leave it the time.
# Each step's log and queue.log beside them; gather.sh packs /tmp/res for the collecting call.
. /tmp/repo/benchmarks/results/leases/session16-h200/common.sh
L=/tmp/repo/benchmarks/results/leases/session32-plan
C=/tmp/repo/benchmarks/results/leases/session22-h200/smollm2-sharegpt.yaml
nvidia-smi > $R/nvidia-smi.txt 2>&1
step build-smollm2 240 python -m eagle3.real_targets --model smollm2 --gguf /tmp/g/smollm2.gguf --out /tmp/smollm2
step warmup-job 600 python -m ray_jobs.run --config $C --set output_dir=/tmp/warmjob --set prepare.max_samples=400 \
  --set regenerate.max_tokens=64 --set train.num_steps=20 \
  --set train.optimizer.warmup_steps=5
bash $L/gather.sh
step smollm2-job 720 python -m ray_jobs.run --config $C
bash $L/gather.sh
mkdir -p /tmp/smoljob2 && ln -sfn /tmp/smoljob/prepared /tmp/smoljob2/prepared && \
  ln -sfn /tmp/smoljob/regenerated /tmp/smoljob2/regenerated && ln -sfn /tmp/smoljob/hidden_states /tmp/smoljob2/hidden_states
step smollm2-2layers 600 python -m ray_jobs.run --config $C --set output_dir=/tmp/smoljob2 \
  --set 'stages=["train","export","eval"]' --set train.draft.num_draft_layers=2 --set doctor=false
echo "$(date +%T) queue done" >> $R/queue.log
bash $L/gather.sh
touch $R/DONE
