#!/bin/bash
# Builds, on the CPU VM in the repository's root, the two git-ignored folders this plan carries in place of
# session 26's .gpuprep and .gpuregen (README.md beside this file, "How to run it"):
#   .gpuprep2/prepared/               this file's prepare (17,672 records)
#   .gpuregen2/regenerated.tar        session 25's regenerated/, extended (extend_regenerated.py): shards 0-43
#                                     kept, the new fingerprint in MANIFEST.json
# The other carried folders (.gpu0-.gpu4, .gpus00-.gpus21) are session 26's, unchanged: on a VM without them,
# ../session26-h200/make_carry.sh builds them first (and /tmp/qwen15, /tmp/sg, which prepare here reads).
# Needs session 25's regenerated.tar (~/.cache/eagle3/session25/ on the VM that collected it). ~15 min on 2
# cores (prepare: 17,672 records through the target's tokenizer).
set -euo pipefail
L=benchmarks/results/leases/session28-h200
R25=$HOME/.cache/eagle3/session25/regenerated.tar
[ -f $R25 ] || { echo "no $R25: session 25's regenerated conversations are kept only on the VM that collected them" >&2
  exit 1; }
SG=/tmp/sg/ShareGPT_V3_unfiltered_cleaned_split.json
[ -f /tmp/qwen15/config.json ] && [ -f $SG ] || bash benchmarks/results/leases/session26-h200/make_carry.sh
J=/tmp/q15job-s28carry   # a job folder of its own: /tmp/q15job may hold another run's
rm -rf $J && mkdir -p $J && tar xf $R25 -C $J
.venv/bin/python -m ray_jobs.run --config $L/qwen15-sharegpt.yaml --set output_dir=$J --set 'stages=["prepare"]'
.venv/bin/python $L/extend_regenerated.py $L/qwen15-sharegpt.yaml $J
rm -rf .gpuprep2 .gpuregen2 && mkdir -p .gpuprep2 .gpuregen2
cp -r $J/prepared .gpuprep2/
tar cf .gpuregen2/regenerated.tar -C $J regenerated
du -sh .gpuprep2 .gpuregen2 | tr '\n' ' '; echo
