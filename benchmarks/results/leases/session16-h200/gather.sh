#!/bin/bash
# Copies what the 1.5B job wrote so far under /tmp/res/qwen-job (run at the end of the queue, and by a
# collecting call at any time: a cut job still leaves its stages' files).
R=/tmp/res; J=/tmp/q15job; mkdir -p $R/qwen-job
cp $J/report.json $J/eval.json $J/train/metrics.jsonl $J/train/curves.png $J/train/train_summary.json $R/qwen-job/ 2>/dev/null
for d in regenerated train draft; do cp $J/$d/provenance.json $R/qwen-job/$d-provenance.json 2>/dev/null; done
cp $J/regenerated/tokens.parquet $R/qwen-job/regenerated-tokens.parquet 2>/dev/null
cp $J/regenerated/rejects.jsonl $R/qwen-job/regenerated-rejects.jsonl 2>/dev/null
ls -la $J $J/* > $R/qwen-job/ls.txt 2>&1
true
