#!/bin/bash
# Packs what the queue wrote so far (/tmp/res) and each online-bench run's report, eval and metrics
# into $OUT/res.tgz (run by a collecting call at any time).
for d in /tmp/ob/online /tmp/ob/offline; do
  [ -d $d ] || continue; n=$(basename $d); mkdir -p /tmp/res/online-runs/$n
  cp $d/report.json $d/eval.json $d/train/metrics.jsonl /tmp/res/online-runs/$n/ 2>/dev/null
done
tar czf $OUT/res.tgz -C /tmp res
