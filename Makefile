# The two set-up commands of the README: `make demo` and `make test`. Both build .venv first
# (scripts/install_cpu.sh; ~1 min on a fresh machine with uv, ~3-4 min where pip installs; a no-op once built).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install demo test test-fast test-slow

# install also builds the demo's target, SmolLM2-135M-Instruct, once per machine (a no-op once
# built): `make demo` after it is the job alone.
install:
	@bash scripts/install_cpu.sh
	@$(PY) -m scripts.real_targets --model smollm2 > /dev/null

demo: install
	$(PY) -m ray_jobs.run --config configs/demo.yaml

# Two tiers (markers in pyproject.toml; tests/conftest.py fails a fast test that starts a Ray
# cluster or DeepSpeed): the fast tier (no Ray cluster, no vLLM engine, no DeepSpeed engine) runs
# first, so a broken unit fails in minutes; then the slow tier (real Ray,
# vLLM CPU and DeepSpeed; GPU tests are skipped without CUDA), in SLOW_PROCESSES pytest-xdist
# workers that each take whole test files (--dist loadfile: a module's fixture, e.g. test_e2e's
# demo job, runs once; xdist hands out files with more tests first): much of a slow test is
# single-threaded start-up (imports, Ray and engine starts; a CPU vLLM engine decodes on one
# thread), so two workers fill two cores better than one. Three workers, and the heaviest files
# first (two whole jobs side by side), were slower. The files
# go out in tests/conftest.py's SLOW_FILE_ORDER (--no-loadscope-reorder): the costliest first, the
# short ones last so that both workers end together, and the second worker's first two need no tiny
# target, so it works while the first builds it on a fresh machine.
# The fast tier in FAST_PROCESSES workers too, its tests handed out one by one (xdist's --dist
# load): faster than one process (test-tiers.md).
# pytest's exit code 5 means the tier selected no test (e.g. a -k filter from PYTEST_ARGS): not a
# failure. DURATIONS: how many slowest tests to list.
DURATIONS ?= 15
FAST_PROCESSES ?= 2
PYTEST := $(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)
FAST := $(PYTEST) -n $(FAST_PROCESSES) --durations=10 -m "not slow and not gpu" tests
# No workers on a GPU host (-n 0: in this process): a GPU test wants the device to itself.
SLOW_PROCESSES ?= $(if $(shell command -v nvidia-smi),0,2)
SLOW := $(PYTEST) -n $(SLOW_PROCESSES) --dist loadfile --no-loadscope-reorder --durations=$(DURATIONS) -m "slow or gpu" tests

test: install
	$(FAST) || [ $$? -eq 5 ]
	$(SLOW) || [ $$? -eq 5 ]

test-fast: install
	$(FAST) || [ $$? -eq 5 ]

test-slow: install
	$(SLOW) || [ $$? -eq 5 ]
