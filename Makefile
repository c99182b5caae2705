# The two set-up commands of the README: `make demo` and `make test`. Both build .venv first
# (scripts/install_cpu.sh; ~4 min on a fresh machine, a no-op once built).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install demo test test-fast gpu-carry

install:
	@bash scripts/install_cpu.sh

demo: install
	$(PY) -m ray_jobs.run --config configs/demo.yaml

test: install
	$(PY) -m pytest -q -p no:cacheprovider --durations=15 tests

test-fast: install
	$(PY) -m pytest -q -m "not slow" tests
