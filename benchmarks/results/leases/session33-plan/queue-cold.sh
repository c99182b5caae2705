#!/bin/bash
# What ran of session 33's plan: queue.sh's first lease was lost (the machine was handed back between two calls, 30 s
# idle, while queue.sh's warm-up was in its extract stage), and a fresh machine had ~1,050 s left: not enough for a
# warm-up and a warm job. So the job once, on cold caches, at this session's code: the first GPU run of the eval's
# engines started while the draft trains (vLLM 0.26, CUDA graphs), and the cold job's time.
. /tmp/repo/benchmarks/results/leases/session16-h200/common.sh
L=/tmp/repo/benchmarks/results/leases/session33-plan
C=/tmp/repo/benchmarks/results/leases/session22-h200/smollm2-sharegpt.yaml
nvidia-smi > $R/nvidia-smi.txt 2>&1
step build-smollm2 240 python -m eagle3.real_targets --model smollm2 --gguf /tmp/g/smollm2.gguf --out /tmp/smollm2
step smollm2-job 900 python -m ray_jobs.run --config $C
echo "$(date +%T) queue done" >> $R/queue.log
bash $L/gather.sh
touch $R/DONE
