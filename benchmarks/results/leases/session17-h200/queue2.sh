# Started while two-node run 2 ran (the online bench had been cut at its 780 s step limit in the offline run's eval,
# after that run's training and export): /tmp/queue_end was set to "now" so the queue skipped the shared-GPU test,
# and this evaluated the offline run's draft alone once the queue was done (the same eval config as the bench's).
. /tmp/repo/benchmarks/results/leases/session16-h200/common.sh
while [ ! -f $R/DONE ]; do sleep 1; done
QUEUE_END=$(( $(date +%s) + 400 )); rm -f /tmp/queue_end
step offline-eval 200 python -m ray_jobs.run --config /tmp/ob/offline.yaml --set 'stages=[eval]' --set doctor=false
touch $R/DONE2
