#!/bin/bash
# Session 16, the one queue, started by the call that carries the GGUF's last part: the 1.5B target
# built (dequantized on the device's CPUs), then the whole job on 8,000 ShareGPT records (issue 27
# section 6; qwen15-sharegpt.yaml: regenerated at the target's sampling, trained online, evaluated with
# CUDA graphs), its outputs gathered under $R as each stage's files appear.
. /tmp/repo/benchmarks/results/leases/session16-h200/common.sh
nvidia-smi > $R/nvidia-smi.txt 2>&1
step build-qwen 300 python -m eagle3.real_targets --model qwen2.5-coder-1.5b --gguf /tmp/g/qwen.gguf --out /tmp/qwen15
rm -f /tmp/g/qwen.gguf
step qwen-job 1500 python -m ray_jobs.run --config /tmp/repo/benchmarks/results/leases/session16-h200/qwen15-sharegpt.yaml
bash /tmp/repo/benchmarks/results/leases/session16-h200/gather.sh
echo "$(date +%T) queue done" >> $R/queue.log
touch $R/DONE
