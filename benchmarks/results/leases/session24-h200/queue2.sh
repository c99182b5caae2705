#!/bin/bash
# Session 24's second queue, on a fresh machine: the first (queue.sh) was lost with its machine,
# released while no call was in flight (the lease README says when). In the ~900 s left: the 1.5B
# built again, then regeneration against plain LLM.generate on it (issue 28: >= 0.9x for the 1.5B;
# session 12 measured it over one 7 s window) at the job's max_num_seqs 512, 1,024 prompts, 3
# windows an arm, the arms' order rotated.
. /tmp/repo/benchmarks/results/leases/session16-h200/common.sh
nvidia-smi > $R/nvidia-smi.txt 2>&1
step build-qwen 200 python -m eagle3.real_targets --model qwen2.5-coder-1.5b --gguf /tmp/g/qwen.gguf --out /tmp/qwen15
step regen-bench 560 python -m benchmarks.regen_bench --target /tmp/qwen15 \
  --sharegpt /tmp/sg/ShareGPT_V3_unfiltered_cleaned_split.json --num-prompts 1024 --max-tokens 512 \
  --max-num-seqs 512 --repeats 3 --tag h200-qwen2.5-coder-1.5b-512seqs --out /tmp/res/regen
echo "$(date +%T) queue done" >> $R/queue.log
touch $R/DONE
