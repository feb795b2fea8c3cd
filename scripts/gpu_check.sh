#!/usr/bin/env bash
# `make gpu-check` on a GPU host that has CUDA torch, Triton and transformers but not this
# project's setup and no package index: the few packages it lacks travel as wheels.
#
#   bash scripts/gpu_check.sh wheels    # here, with an index: download them into .whl/
#   bash scripts/gpu_check.sh run ...   # there: install .whl/ into a temporary folder, run
#                                       # forge gpu-check --device cuda ... from this checkout
#
# The wheels are for the GPU host's Python (GPU_PYTHON_VERSION, default 3.12): llguidance and
# gguf (the engine and the builder import them), nvidia-modelopt and what it needs beyond what
# such a host has (the FP8 build). The served check runs where a tritonserver is found (on PATH,
# or the nvidia-pytriton wheel importable), and is skipped, saying so, elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS="${GPU_WHEELS:-.whl}"
PYVER="${GPU_PYTHON_VERSION:-3.12}"
NEEDED=(llguidance==1.9.1 gguf==0.19.0 nvidia-modelopt==0.47.0 omegaconf antlr4-python3-runtime
        pulp pydantic pydantic-core annotated-types typing-inspection)

case "${1:-}" in
    wheels)
        mkdir -p "$WHEELS"
        platforms=()
        for n in 17 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
        python3 -m pip download --no-deps --only-binary=:all: --python-version "$PYVER" \
            --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 \
            --platform any -d "$WHEELS" "${NEEDED[@]}"
        du -sh "$WHEELS"
        ;;
    run)
        shift
        site="$(mktemp -d)"
        if compgen -G "$WHEELS/*.whl" >/dev/null; then
            python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
                "$WHEELS"/*.whl
        fi
        export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
        exec python3 -m builder.cli gpu-check --device cuda "$@"
        ;;
    *)
        echo "usage: $0 wheels | run [forge gpu-check options]" >&2
        exit 2
        ;;
esac
