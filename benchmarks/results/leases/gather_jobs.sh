#!/bin/bash
# Copies each job folder's report, eval, summaries, metrics (gzipped) and curves under /tmp/res/<its name>/ (a lease
# queue runs it; a collecting call may too), then packs /tmp/res into $OUT/res.tgz when OUT is set.
#   bash benchmarks/results/leases/gather_jobs.sh /tmp/smoljob [/tmp/smoljob2 ...]
for d in "$@"; do
  [ -d $d ] || continue
  o=/tmp/res/$(basename $d); mkdir -p $o
  cp $d/report.json $d/eval.json $d/*.md $d/*.png $d/train/*.png $d/train/train_summary.json $o/ 2>/dev/null
  [ -f $d/train/metrics.jsonl ] && gzip -c $d/train/metrics.jsonl > $o/metrics.jsonl.gz
done
[ -n "${OUT:-}" ] && tar czf $OUT/res.tgz -C /tmp res
true
