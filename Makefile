# Thin wrappers over `forge` and pytest. Every target sets itself up from nothing.
VENV ?= .venv
PY := $(VENV)/bin/python
FORGE := $(VENV)/bin/forge
SPEC ?= examples/smollm2-135m.yaml
ENGINE ?= engines/smollm2-135m
PYTEST_ARGS ?=

.PHONY: setup engine serve demo test bench lint

setup:
	@bash scripts/setup.sh

engine: setup
	$(FORGE) engine --spec $(SPEC)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

lint: setup
	$(PY) -m compileall -q builder triton_backend scripts tests
