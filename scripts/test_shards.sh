#!/usr/bin/env bash
# Runs one pytest command as N processes at once, each with EAGLE3_TEST_SHARD=i/N (tests/conftest.py
# gives each its share of the selected tests, whole modules), and exits with the first failing
# process's status. Usage: scripts/test_shards.sh N python -m pytest [args...]
# Each process's output goes to a log of its own, printed whole when it ends (interleaved lines of
# two pytest runs would be unreadable); pytest's exit code 5 (it selected no test) counts as a pass.
set -uo pipefail
num=$1
shift
logs=$(mktemp -d)
pids=()
for ((i = 0; i < num; i++)); do
  EAGLE3_TEST_SHARD="$i/$num" "$@" > "$logs/shard-$i.log" 2>&1 &
  pids+=($!)
done
status=0
for ((i = 0; i < num; i++)); do
  wait "${pids[$i]}"
  rc=$?
  [ "$rc" -eq 5 ] && rc=0
  echo "=== tests, process $((i + 1)) of $num (EAGLE3_TEST_SHARD=$i/$num): exit $rc"
  cat "$logs/shard-$i.log"
  [ "$status" -eq 0 ] && status=$rc
done
rm -rf "$logs"
exit "$status"
