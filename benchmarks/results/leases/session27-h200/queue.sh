#!/bin/bash
# The plan for session 27's lease (qwen15-sharegpt.yaml's header says what and why), on the one H200: session 26's
# queue.sh with this folder's file and no train/serve step (its header says what the calls before it carry):
# 1. build-qwen: Qwen2.5-Coder-1.5B-Instruct built from its GGUF (the parts carried, joined into /tmp/g/qwen.gguf).
# 2. qwen-job: the job as the file says (regeneration found committed: no engine; 7,200 steps online, export,
#    eval; session 26's 3,600-step job: 971 s, so ~1,340 s expected).
L=/tmp/repo/benchmarks/results/leases/session27-h200
QUEUE_CONFIG=$L/qwen15-sharegpt.yaml QUEUE_JOB_LIMIT=1500 QUEUE_NO_TRAIN_SERVE=1 bash $L/../session26-h200/queue.sh
