# Thin wrappers over `forge` and pytest. Every target sets itself up from nothing.
VENV ?= .venv
PY := $(VENV)/bin/python
FORGE := $(VENV)/bin/forge
SPEC ?= examples/smollm2-135m.yaml
ENGINE ?= engines/smollm2-135m
REPO ?= model_repository/smollm2-135m
PROMPT ?= Explain in one sentence what an inference server does.
PYTEST_ARGS ?=

.PHONY: setup engine serve demo test bench lint

setup:
	@bash scripts/setup.sh

engine: setup
	$(FORGE) engine --spec $(SPEC)

$(REPO)/ensemble/config.pbtxt: | setup
	@[ -f $(ENGINE)/config.json ] || $(FORGE) engine --spec $(SPEC)
	$(FORGE) repository --engine $(ENGINE) --output $(REPO)

serve: setup $(REPO)/ensemble/config.pbtxt
	$(FORGE) serve --repository $(REPO)

demo: setup $(REPO)/ensemble/config.pbtxt
	$(FORGE) serve --repository $(REPO) --http-port 0 --grpc-port 0 --metrics-port 0 \
		--demo-prompt "$(PROMPT)" --demo-max-tokens 64

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

lint: setup
	$(PY) -m compileall -q builder triton_backend scripts tests
