#!/bin/bash
# Copies what the 1.5B job wrote so far under /tmp/res/qwen-job (the queue runs it at its end; a
# collecting call may at any time: a cut job still leaves its stages' files), then packs /tmp/res
# into $OUT/res.tgz when OUT is set.
R=/tmp/res; J=/tmp/q15job; mkdir -p $R/qwen-job
cp $J/report.json $J/eval.json $J/*.md $J/train/curves.png $J/train/train_summary.json $R/qwen-job/ 2>/dev/null
[ -f $J/train/metrics.jsonl ] && gzip -c $J/train/metrics.jsonl > $R/qwen-job/metrics.jsonl.gz
for d in regenerated train draft; do cp $J/$d/provenance.json $R/qwen-job/$d-provenance.json 2>/dev/null; done
[ -f $J/regenerated/rejects.jsonl ] && gzip -c $J/regenerated/rejects.jsonl > $R/qwen-job/regenerated-rejects.jsonl.gz
ls -la $J $J/* > $R/qwen-job/ls.txt 2>&1
[ -n "${OUT:-}" ] && tar czf $OUT/res.tgz -C /tmp res
true
