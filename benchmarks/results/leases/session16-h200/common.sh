# Sourced by the queue scripts on the device (session 16: the same as session 14's): the carried site's environment and a step runner.
# Each step has its own limit and the queue a deadline (QUEUE_END, epoch seconds): a step starts
# only with >= 120 s left. A later call may move the deadline by writing epoch seconds to /tmp/queue_end.
set -u
. /tmp/unpack.sh /tmp/none > /dev/null
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cd /tmp/repo
R=/tmp/res; mkdir -p $R
QUEUE_END=${QUEUE_END:?}
step() {
  local name=$1 limit=$2; shift 2
  [ -s /tmp/queue_end ] && QUEUE_END=$(cat /tmp/queue_end)
  local left=$(( QUEUE_END - $(date +%s) ))
  if [ $left -lt 120 ]; then echo "$(date +%T) skip $name (${left}s left)" >> $R/queue.log; return; fi
  [ $limit -gt $left ] && limit=$left
  echo "$(date +%T) start $name limit ${limit}s: $*" >> $R/queue.log
  local s=$(date +%s)
  timeout --signal=INT --kill-after=20 $limit "$@" > $R/$name.log 2>&1
  local rc=$?  # taken at once: session 18 found that "$(date) rc=$?" reported date's status, 0, in every queue.log before
  echo "$(date +%T) end $name rc=$rc $(( $(date +%s) - s ))s" >> $R/queue.log
  nvidia-smi --query-gpu=memory.used --format=csv,noheader >> $R/queue.log
}
