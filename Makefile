# `make demo`: set up .venv (Python 3.12) and run the main job (prefill) on the built-in tiny model.
# `make test`: set up .venv and run the test suite on the CPU.
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

test: $(VENV)/.installed
	JAX_PLATFORMS=cpu $(PY) -m pytest -q tests

lint: $(VENV)/.installed
	$(PY) -m ruff check hybridlm pallas_kernels tests benchmarks experiments

clean:
	rm -rf $(VENV) .pytest_cache
