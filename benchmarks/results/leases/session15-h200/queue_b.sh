#!/bin/bash
# Session 15, queue B, started by the call that carries the GGUF's last part: the 1.5B target
# built (dequantized on the CPU while queue A may still hold the GPU), then, once A is done, the
# whole job on 8,000 ShareGPT records (issue 27 section 6; qwen15-sharegpt.yaml: regenerated at the
# target's sampling, trained online, evaluated with CUDA graphs), its outputs gathered under $R.
. /tmp/repo/benchmarks/results/leases/session15-h200/common.sh
step build-qwen 300 python -m eagle3.real_targets --model qwen2.5-coder-1.5b --gguf /tmp/g/qwen.gguf --out /tmp/qwen15
while [ ! -f $R/A_DONE ]; do sleep 3; done
step qwen-job 1500 python -m ray_jobs.run --config /tmp/repo/benchmarks/results/leases/session15-h200/qwen15-sharegpt.yaml
mkdir -p $R/qwen-job
J=/tmp/q15job
cp $J/report.json $J/eval.json $J/train/metrics.jsonl $J/train/curves.png $R/qwen-job/ 2>/dev/null
for d in regenerated train draft; do cp $J/$d/provenance.json $R/qwen-job/$d-provenance.json 2>/dev/null; done
cp $J/regenerated/tokens.parquet $R/qwen-job/regenerated-tokens.parquet 2>/dev/null
echo "$(date +%T) queue_b done" >> $R/queue.log
touch $R/B_DONE
