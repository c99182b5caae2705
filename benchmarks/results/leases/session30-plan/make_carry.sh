#!/bin/bash
# Builds, on the CPU VM in the repository's root, the git-ignored folders this plan carries (README.md, "How to run
# it"), one a call. A call carries the working tree (14.3 MB of tracked files in session 31) beside its folder, within
# 64 MiB, so every part is at most 44 MiB (session 31 found session 26's 50 MiB parts refused):
#   .gpugpt0-.gpugpt4   the GPU site (vLLM 0.26.0 and the rest: ../../../../../shared/gpu/build_carry.sh), re-split from
#                       .gpu0-.gpu4 (session 26's make_carry.sh) at 44 MiB, with SHA256SUMS and unpack.sh (waits for 5)
#   .gpugq00-.gpugq24   the Qwen2.5-Coder-1.5B GGUF at 44 MiB a part (sha256 cc324af0...b046), and in .gpugq24 the
#                       ShareGPT, gguf and accelerate wheels
#   .gpuregen3          session 30's 66 regenerated shards (16,799 conversations), without tokens.parquet
# .gpuprep2 (session 28's make_carry.sh) is carried as it is.
# Needs .gpu0-.gpu4 and ~/.cache/eagle3/session30/regenerated.tar (the VM that collected it in session 30), and the
# GGUF at ~/.cache/eagle3/real_targets/qwen.gguf (eagle3.real_targets builds it from the wheels).
set -euo pipefail
T=$HOME/.cache/eagle3/session30/regenerated.tar
G=$HOME/.cache/eagle3/real_targets/qwen.gguf
[ -f $T ] || { echo "no $T: session 30's regenerated conversations are kept only on the VM that collected them" >&2
  exit 1; }
echo "1ddc72389ddc352829e76f2d8c1009dbe9d7b2ce8d85742c626e607edcdb7d41  $T" | sha256sum -c
echo "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046  $G" | sha256sum -c
for i in 0 1 2 3 4; do (cd .gpu$i && sha256sum -c --ignore-missing --quiet SHA256SUMS); done
S=$(mktemp -d)
cat .gpu[0-4]/site.tar.xz.* | split -b 44M -d - $S/site.tar.xz.
(cd $S && sha256sum site.tar.xz.* > SHA256SUMS)
for i in 0 1 2 3 4; do rm -rf .gpugpt$i && mkdir .gpugpt$i && mv $S/site.tar.xz.0$i .gpugpt$i/ && cp $S/SHA256SUMS .gpu0/unpack.sh .gpugpt$i/; done
split -b 44M -d -a 2 $G $S/qpart.
for f in $S/qpart.*; do n=${f##*.}; rm -rf .gpugq$n && mkdir .gpugq$n && mv $f .gpugq$n/; done
cp .gpu4/*.whl .gpugq24/
rm -rf .gpuregen3 && mkdir -p .gpuregen3 && cp $T .gpuregen3/
rm -rf $S
du -sh .gpugpt? .gpugq?? .gpuprep2 .gpuregen3 | sort -h | tail -3 | tr '\n' ' '; echo
