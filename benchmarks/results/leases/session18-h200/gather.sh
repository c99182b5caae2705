#!/bin/bash
# Copies the SmolLM2 job's report, eval and metrics under /tmp/res (the queue runs it after the job;
# a collecting call may too), then packs /tmp/res into $OUT/res.tgz when OUT is set.
d=/tmp/smoljob
if [ -d $d ]; then
  mkdir -p /tmp/res/smoljob
  cp $d/report.json $d/eval.json $d/train/metrics.jsonl /tmp/res/smoljob/ 2>/dev/null
  cp $d/*.md $d/*.png $d/train/*.png /tmp/res/smoljob/ 2>/dev/null
fi
[ -n "${OUT:-}" ] && tar czf $OUT/res.tgz -C /tmp res
true
