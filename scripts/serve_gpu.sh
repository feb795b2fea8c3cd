#!/usr/bin/env bash
# The GPU image's entrypoint. trtllm-build compiles for the GPU it runs on, so the engine is built
# here, at the pod's start, on the GPU the pod was given: for the hardware profile of that GPU
# (or $HARDWARE), into $LLM_FORGE_MODELS/<profile> (a volume, so a restart on the same node finds
# it: forge engine rebuilds nothing while its build key — spec, checkpoint, toolchain — is
# unchanged). Then forge serve on it with the pod's ports; arguments are passed on to forge serve.
set -euo pipefail
cd "$(dirname "$0")/.."
SPEC="${SPEC:-examples/smollm2-135m-trtllm.yaml}"
MODELS="${LLM_FORGE_MODELS:-/models}"
HARDWARE="${HARDWARE:-$(bash scripts/gpu.sh profile)}"
out="$MODELS/$HARDWARE"

forge engine --spec "$SPEC" --hardware "$HARDWARE" --output "$out/engine" \
    --repository "$out/model_repository"
exec forge serve --repository "$out/model_repository" --host 0.0.0.0 --openai-port 8080 \
    --health-port 8003 --triton-host 127.0.0.1 --metrics-host 0.0.0.0 \
    --http-port 8000 --grpc-port 8001 --metrics-port 8002 "$@"
