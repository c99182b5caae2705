#!/bin/bash
# A plan for a later lease (written in session 34): issue 27's "AL against the number of draft layers" on SmolLM2, at
# the recipe that reached AL(k=3) 2.45 with one layer (../session34-h100/README.md). Session 34's regenerated shards
# are carried (.gpuregen34: untarred into /tmp/smol2l by the call before last.sh), so no regeneration runs:
# 1. build-smollm2: the target from its GGUF (last.sh joins the parts into /tmp/g/smollm2.gguf);
# 2. smol2l-job: ../session34-plan/smollm2-all.yaml with train.draft.num_draft_layers=2 into /tmp/smol2l: prepare
#    again (~25 s; the same tokens, so the carried shards' fingerprint matches: 66 of 66 committed), online training,
#    export, eval (k=3, the same 64 prompts and speed windows). train.num_steps is 7,200 (the one-layer run's), cut
#    (by hundreds) to what the lease holds at 12 steps/s (one layer ran 19.8 steps/s steady, 153.6k tokens/s; a
#    second decoder layer costs ~1.5x, an estimate) with 420 s kept for the rest of the job.
# Each step's log and queue.log beside them; gather.sh packs /tmp/res for the collecting call.
. /tmp/repo/benchmarks/results/leases/session16-h200/common.sh
L=/tmp/repo/benchmarks/results/leases/session34-layers-plan
C=/tmp/repo/benchmarks/results/leases/session34-plan/smollm2-all.yaml
left() { [ -s /tmp/queue_end ] && QUEUE_END=$(cat /tmp/queue_end); echo $(( QUEUE_END - $(date +%s) )); }
nvidia-smi > $R/nvidia-smi.txt 2>&1
ls /tmp/smol2l/regenerated/committed | wc -l >> $R/queue.log
step build-smollm2 240 python -m eagle3.real_targets --model smollm2 --gguf /tmp/g/smollm2.gguf --out /tmp/smollm2
STEPS=$(( ($(left) - 420) * 12 / 100 * 100 ))
[ $STEPS -gt 7200 ] && STEPS=7200
[ $STEPS -lt 500 ] && STEPS=500
echo "$(date +%T) $(left)s left, 420s kept for the rest of the job: train.num_steps $STEPS" >> $R/queue.log
step smol2l-job 1500 python -m ray_jobs.run --config $C --set output_dir=/tmp/smol2l --set train.draft.num_draft_layers=2 \
  --set train.num_steps=$STEPS --set doctor=false
echo "$(date +%T) queue done" >> $R/queue.log
bash $L/gather.sh
touch $R/DONE
