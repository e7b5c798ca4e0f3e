# `make demo`: set up .venv (Python 3.12) and run the main job (prefill) on the built-in tiny model.
# `make test`: set up .venv and run the test suite on the CPU.
# `make lint`: ruff check and ruff format --check (the CI runs both, then the tests).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo generate test lint clean

$(VENV)/.installed: pyproject.toml scripts/setup_venv.sh
	VENV=$(VENV) scripts/setup_venv.sh

setup: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/hybridlm prefill

generate: $(VENV)/.installed
	$(VENV)/bin/hybridlm generate

# Test processes (pytest-xdist); each takes ~2-3 GB. The suite is mostly XLA compiles, one core each.
TEST_WORKERS ?= 2

test: $(VENV)/.installed
	JAX_PLATFORMS=cpu $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests

LINTED := hybridlm pallas_kernels tests benchmarks experiments scripts

lint: $(VENV)/.installed
	$(PY) -m ruff check $(LINTED)
	$(PY) -m ruff format --check $(LINTED)

clean:
	rm -rf $(VENV) .pytest_cache
