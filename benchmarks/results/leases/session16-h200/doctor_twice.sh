#!/bin/bash
# Issue 28's "the doctor takes <= 30 s on a warm node", and the session's doctor fix on a GPU: one Ray head
# (as a job finds it), then `python -m ray_jobs.doctor` twice, cold (a fresh machine) and warm (the same node
# again). Logs to $OUT. Run from the repository root with the carried site unpacked.
set -u
cp -r .gpu4/qcfg /tmp/qcfg
export NCCL_NVLS_ENABLE=0
s=$(date +%s); ray start --head --num-gpus 1 --disable-usage-stats > $OUT/ray-start.log 2>&1
echo "ray start rc=$? $(( $(date +%s) - s ))s" | tee -a $OUT/ray-start.log
for run in cold warm; do
  s=$(date +%s)
  timeout 120 python -m ray_jobs.doctor --config benchmarks/results/leases/session16-h200/doctor-qwen15.yaml \
    > $OUT/doctor-$run.log 2>&1
  echo "doctor $run rc=$? wall=$(( $(date +%s) - s ))s" | tee -a $OUT/doctor-$run.log
  grep -E "FAIL|doctor:" $OUT/doctor-$run.log | cut -c1-300
done
ray stop --force > /dev/null 2>&1
