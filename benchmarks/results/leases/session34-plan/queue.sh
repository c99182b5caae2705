#!/bin/bash
# Session 34's queue on one GPU machine (the device's copy of the working tree at /tmp/repo): issue 27's SmolLM2 draft
# on every record of the carried ShareGPT file with the 1.5B's recipe (smollm2-all.yaml's header says what and why).
# 1. build-smollm2: SmolLM2-135M-Instruct from its GGUF (the parts joined into /tmp/g/smollm2.gguf by last.sh).
# 2. regen: prepare and regenerate, a job of their own (the doctor beside prepare), so that the training steps can be
#    cut to the time left after it. Expected on a cold machine: prepare ~40-60 s over 16 CPUs beside the doctor,
#    4 engine replicas (extract.replicas_per_gpu auto) cold ~60-80 s, then ~8M generated tokens at ~44k tokens/s
#    (session 33's rate) ~180 s. Its report kept as regen-report.json; the shards (without tokens.parquet, which
#    finalize writes again) packed into /tmp/regen-back in 15 MiB parts for a poll call to bring back: a later
#    lease carries them instead of regenerating.
# 3. smolall-job: the job as the file says (prepare and regeneration found done; online training, export, eval;
#    doctor=false: it ran in step 2). train.num_steps is the file's 7,200, cut (by hundreds) to what the time left
#    holds: 17 steps/s (online on an H200 ran 170k tokens/s = 20.7 steps/s of 8,192 tokens; held-out evaluations
#    every 200 steps on top) and 420 s kept for the rest of the job (set-up ~30 s, a cold first step ~90 s, export,
#    the eval's two engines cold ~80 s side by side, its acceptance and timed rounds ~150 s, the job's start and end).
# 4. smolall-k2: with what is left, the same draft served at k=2 (the eval stage alone): session 33's one-layer
#    draft ran 0.91x at batch 16 with k=3.
# Each step's log and queue.log beside them; gather.sh packs /tmp/res for the collecting call.
. /tmp/repo/benchmarks/results/leases/session16-h200/common.sh
L=/tmp/repo/benchmarks/results/leases/session34-plan
C=$L/smollm2-all.yaml
J=/tmp/smolall
left() { [ -s /tmp/queue_end ] && QUEUE_END=$(cat /tmp/queue_end); echo $(( QUEUE_END - $(date +%s) )); }
nvidia-smi > $R/nvidia-smi.txt 2>&1
df -h /tmp >> $R/queue.log
step build-smollm2 240 python -m eagle3.real_targets --model smollm2 --gguf /tmp/g/smollm2.gguf --out /tmp/smollm2
step regen 700 python -m ray_jobs.run --config $C --set 'stages=["prepare","regenerate"]'
cp $J/report.json $R/regen-report.json 2>/dev/null
mkdir -p /tmp/regen-back && tar cf - -C $J --exclude=regenerated/tokens.parquet regenerated \
  | split -b 15M -d - /tmp/regen-back/regenerated.tar.
(cd /tmp/regen-back && sha256sum regenerated.tar.* > SHA256SUMS && ls -la >> $R/queue.log)
STEPS=$(( ($(left) - 420) * 17 / 100 * 100 ))
[ $STEPS -gt 7200 ] && STEPS=7200
[ $STEPS -lt 500 ] && STEPS=500
echo "$(date +%T) $(left)s left, 420s kept for the rest of the job: train.num_steps $STEPS" >> $R/queue.log
step smolall-job 1300 python -m ray_jobs.run --config $C --set train.num_steps=$STEPS --set doctor=false
bash $L/gather.sh
mkdir -p /tmp/smolallk2 && for d in prepared regenerated train draft; do ln -sfn $J/$d /tmp/smolallk2/$d; done
step smolall-k2 300 python -m ray_jobs.run --config $C --set output_dir=/tmp/smolallk2 --set 'stages=["eval"]' \
  --set 'eval.num_speculative_tokens=[2]' --set eval.speed_k=2 --set doctor=false
df -h /tmp >> $R/queue.log
echo "$(date +%T) queue done" >> $R/queue.log
bash $L/gather.sh
touch $R/DONE
