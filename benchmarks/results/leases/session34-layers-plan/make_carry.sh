#!/bin/bash
# Builds .gpuregen34 (git-ignored) from session 34's regenerated shards, kept on the VM that collected them
# (~/.cache/eagle3/session34/regenerated.tar, 27,299,840 bytes: ../session34-h100/README.md), and checks the queue.
# The other carried folders are ../session32-plan/make_carry.sh's.
set -euo pipefail
.venv/bin/python benchmarks/results/leases/check_queue.py benchmarks/results/leases/session34-layers-plan/queue.sh
T=$HOME/.cache/eagle3/session34/regenerated.tar
[ "$(stat -c %s $T)" = 27299840 ] || { echo "$T: not session 34's regenerated.tar" >&2; exit 1; }
rm -rf .gpuregen34 && mkdir .gpuregen34 && cp $T .gpuregen34/
du -sh .gpuregen34
