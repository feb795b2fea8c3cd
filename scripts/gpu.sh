#!/usr/bin/env bash
# GPU host helpers.
#
#   bash scripts/gpu.sh profile   # print the hardware profile (l4, a100-40gb, a100-80gb,
#                                 # h100-80gb) of this host's first GPU, as `forge engine
#                                 # --hardware` takes it; exit 1 naming the GPU when none fits
#   bash scripts/gpu.sh wheels    # here, with an index: download into .whl/ the packages a bare
#                                 # GPU host lacks for `make gpu-check`
#   bash scripts/gpu.sh check ... # there (CUDA torch, Triton, transformers, no package index):
#                                 # install .whl/ into a temporary folder and run
#                                 # forge gpu-check --device cuda ... from this checkout
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
    profile)
        gpu="$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits | head -1)"
        case "$gpu" in
            *L4*) hardware=l4 ;;
            *H100*) hardware=h100-80gb ;;
            *A100*) mem="${gpu##*, }"
                    if (( mem > 50000 )); then hardware=a100-80gb; else hardware=a100-40gb; fi ;;
            *) echo "gpu profile: no profile for GPU '$gpu' (profiles: l4, a100-40gb, a100-80gb," \
                    "h100-80gb)" >&2; exit 1 ;;
        esac
        echo "GPU: $gpu -> hardware profile $hardware" >&2
        echo "$hardware"
        ;;
    wheels)
        mkdir -p "$WHEELS"
        platforms=()
        for n in 17 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
        python3 -m pip download --no-deps --only-binary=:all: --python-version "$PYVER" \
            --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 \
            --platform any -d "$WHEELS" "${NEEDED[@]}"
        du -sh "$WHEELS"
        ;;
    check)
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
        echo "usage: $0 profile | wheels | check [forge gpu-check options]" >&2
        exit 2
        ;;
esac
