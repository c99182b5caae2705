#!/bin/bash
# Replaces queue2 after build-qwen: regen-qwen, then the SmolLM2 quality eval resumed (its speed engines)
# and its report, instead of online (no time left for it in this lease).
set -u
cd /tmp/repo
. /tmp/repo/.gx/env.sh
R=/tmp/res
while pgrep -f "[b]enchmarks.quality_bench" > /dev/null; do sleep 3; done
echo "$(date +%T) quality_bench gone (queue3)" >> $R/queue.log
s=$(date +%s); echo "$(date +%T) start regen-qwen" >> $R/queue.log
timeout --signal=INT --kill-after=20 240 python -m benchmarks.regen_bench --target /tmp/qwen15 --num-prompts 384 --max-tokens 512 --tag h200-qwen2.5-coder-1.5b --out $R > $R/regen-qwen.log 2>&1
echo "$(date +%T) end regen-qwen rc=$? $(( $(date +%s) - s ))s" >> $R/queue.log
s=$(date +%s); echo "$(date +%T) start quality-smollm2-eval2" >> $R/queue.log
timeout --signal=INT --kill-after=20 270 python -m benchmarks.quality_bench --target /tmp/smollm2 --out /tmp/qs --part eval --tag h200-smollm2 --deadline-s 200 > $R/quality-smollm2-eval2.log 2>&1
echo "$(date +%T) end quality-smollm2-eval2 rc=$? $(( $(date +%s) - s ))s" >> $R/queue.log
timeout 60 python -m benchmarks.quality_bench --target /tmp/smollm2 --out /tmp/qs --part report --tag h200-smollm2 > $R/quality-smollm2-report.log 2>&1
echo "$(date +%T) report rc=$?" >> $R/queue.log
touch $R/DONE
