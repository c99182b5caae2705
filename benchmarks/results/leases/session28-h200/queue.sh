#!/bin/bash
# The plan for the next lease (qwen15-sharegpt.yaml's header says what and why), on the one H200 (the device's
# copy of the working tree at /tmp/repo; .gpuprep2's prepared/ copied to /tmp/q15job/prepared and .gpuregen2's
# regenerated/ untarred into /tmp/q15job by the calls before the one that starts this):
# 1. build-qwen: Qwen2.5-Coder-1.5B-Instruct built from its GGUF (the parts carried, joined into /tmp/g/qwen.gguf).
# 2. regen: the regenerate stage alone, as session 25's queue ran it: 2 engine replicas on the GPU, each a given
#    20 GiB KV cache (the file's extract section, which online training and the eval read, stays session 28's).
#    Expected: 44 of 66 shards found committed, 22 regenerated in 4 waves of up to 6 shards (session 25: ~33 s a
#    full wave), ~270 s with the engines' cold start. Its report kept as regen-report.json. Then the 66 shards
#    (without tokens.parquet, which the stage's finalize writes again) packed into /tmp/regen-back in parts of
#    15 MiB, for a poll call to bring back (README.md, "How to run it"): later leases carry them.
# 3. qwen-job: the job as the file says (regeneration found committed, 66 of 66: no engine; online training,
#    export, acceptance-only eval). train.num_steps is the file's 7,200, cut (by hundreds) to what the time left
#    after the regeneration holds: 8.7 steps/s (session 28's rate with twice the held-out evaluations) and 300 s
#    for the rest of the job (set-up 43 s, first step 82 s, export and the feed's stop 35 s, eval ~90 s, the
#    job's own start and end ~20 s, ~30 s spare). A draft with its eval is worth more than one cut before it.
# Each step's log and queue.log beside them; ../session24-h200/gather.sh packs /tmp/res for the collecting call.
. /tmp/repo/benchmarks/results/leases/session16-h200/common.sh
L=/tmp/repo/benchmarks/results/leases/session28-h200
C=$L/qwen15-sharegpt.yaml
J=/tmp/q15job
left() { [ -s /tmp/queue_end ] && QUEUE_END=$(cat /tmp/queue_end); echo $(( QUEUE_END - $(date +%s) )); }
nvidia-smi > $R/nvidia-smi.txt 2>&1
df -h /tmp >> $R/queue.log
step build-qwen 300 python -m eagle3.real_targets --model qwen2.5-coder-1.5b --gguf /tmp/g/qwen.gguf --out /tmp/qwen15
step regen 600 python -m ray_jobs.run --config $C --set 'stages=["regenerate"]' --set extract.replicas_per_gpu=2 \
  --set extract.kv_cache_memory_bytes=21474836480
cp $J/report.json $R/regen-report.json 2>/dev/null
mkdir -p /tmp/regen-back && tar cf - -C $J --exclude=regenerated/tokens.parquet regenerated \
  | split -b 15M -d - /tmp/regen-back/regenerated.tar.
(cd /tmp/regen-back && sha256sum regenerated.tar.* > SHA256SUMS && ls -la >> $R/queue.log)
# regenerated/tokens.parquet is written once every shard is committed (extend_regenerated.py removed session 25's):
# without it the job regenerates the rest itself, on one engine, so ~300 s more are kept for it.
RESERVE=300; [ -f $J/regenerated/tokens.parquet ] || RESERVE=600
STEPS=$(( ($(left) - RESERVE) * 87 / 10 / 100 * 100 ))
[ $STEPS -gt 7200 ] && STEPS=7200
echo "$(date +%T) $(left)s left, ${RESERVE}s kept for the rest of the job: train.num_steps $STEPS" >> $R/queue.log
step qwen-job 1300 python -m ray_jobs.run --config $C --set train.num_steps=$STEPS
# The draft (~114 MB) packed for two collecting calls to bring back (README.md, "How to run it", step 4): later
# leases can then evaluate it (other k, speed windows, call_seconds) without training it again.
mkdir -p /tmp/draft-back && tar cf - -C $J draft | split -b 15M -d - /tmp/draft-back/draft.tar.
(cd /tmp/draft-back && sha256sum draft.tar.* > SHA256SUMS && ls -la >> $R/queue.log)
df -h /tmp >> $R/queue.log
echo "$(date +%T) queue done" >> $R/queue.log
bash $L/../session24-h200/gather.sh
touch $R/DONE
