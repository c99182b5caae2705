#!/bin/bash
# Session 31's short-lease queue on one GPU machine (the device's copy of the working tree at /tmp/repo), for a lease
# too short for session 30's two-layer plan (../session30-plan/: when this was written, failed machine starts had left ~1,350 s; not run in session 31,
# whose lease ran queue-short.sh):
# issue 28's whole SmolLM2 job on a warm node (<= 428 s; sessions 22-23: 495 s and 506 s at code 76d40eb / a362587)
# and issue 27's SmolLM2 acceptance, at this session's code. Session 22's job and warm-up
# (../session22-h200/smollm2-sharegpt.yaml), with a smaller warm-up (400 records, 64-token turns, 20 steps): it
# starts every engine and the trainer once with the job's settings (compile caches, the DeepSpeed op build, the page
# cache), as a resubmitted job on the node meets them. Its own stage times are the cold figures.
# Each step's log and queue.log beside them; gather.sh packs /tmp/res for the collecting call.
. /tmp/repo/benchmarks/results/leases/session16-h200/common.sh
L=/tmp/repo/benchmarks/results/leases/session31-plan
C=/tmp/repo/benchmarks/results/leases/session22-h200/smollm2-sharegpt.yaml
nvidia-smi > $R/nvidia-smi.txt 2>&1
step build-smollm2 240 python -m eagle3.real_targets --model smollm2 --gguf /tmp/g/smollm2.gguf --out /tmp/smollm2
step warmup-job 600 python -m ray_jobs.run --config $C --set output_dir=/tmp/warmjob --set prepare.max_samples=400 \
  --set regenerate.max_tokens=64 --set train.num_steps=20 \
  --set train.optimizer.warmup_steps=5
bash $L/gather.sh
step smollm2-job 720 python -m ray_jobs.run --config $C
echo "$(date +%T) queue done" >> $R/queue.log
bash $L/gather.sh
touch $R/DONE
