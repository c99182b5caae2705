#!/bin/bash
# Builds, on the CPU VM in the repository's root, the git-ignored folder this plan carries beside session 26's
# .gpu0-.gpu4 and .gpus00-.gpus21 and session 28's .gpuprep2 (their make_carry.sh build them on a VM without):
#   .gpuregen3/regenerated.tar    session 30's 66 regenerated shards (16,799 conversations), without tokens.parquet
# Needs ~/.cache/eagle3/session30/regenerated.tar (the VM that collected it in session 30; sha256 below).
set -euo pipefail
T=$HOME/.cache/eagle3/session30/regenerated.tar
[ -f $T ] || { echo "no $T: session 30's regenerated conversations are kept only on the VM that collected them" >&2
  exit 1; }
echo "1ddc72389ddc352829e76f2d8c1009dbe9d7b2ce8d85742c626e607edcdb7d41  $T" | sha256sum -c
rm -rf .gpuregen3 && mkdir -p .gpuregen3 && cp $T .gpuregen3/
du -sh .gpuprep2 .gpuregen3 | tr '\n' ' '; echo
