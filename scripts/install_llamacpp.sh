#!/usr/bin/env bash
# llama.cpp's Python binding (llama-cpp-python) in a venv of its own, for `forge bench engine
# --sides llamacpp` (llama.cpp on the GGUF file an engine was built from). An optional peer: the
# tests and `make test` never need it. Installed once; a finished install is left as it is.
# `make bench-llamacpp` runs it first.
#
#   scripts/install_llamacpp.sh
#
# Environment: LLM_FORGE_CACHE (default ~/.cache/llm-forge) holds the venv, at
# $LLM_FORGE_CACHE/llama-cpp-<version> unless LLAMACPP_VENV says where; LLAMACPP_PYTHON is the
# Python it is made with (default python3); LLAMACPP_CMAKE_ARGS replaces the CMake arguments
# below; LLAMACPP_PIP_ARGS are extra pip arguments.
#
# How, and why:
# - PyPI has llama-cpp-python as a source distribution only: pip builds llama.cpp with CMake and
#   the C++ compiler here, several minutes on two cores (CMAKE_BUILD_PARALLEL_LEVEL defaults to
#   every core). Nothing is downloaded but the source and four small pure-Python dependencies.
# - Built for this CPU's vector extensions (AVX2, AVX-512, VNNI, BF16 as /proc/cpuinfo lists
#   them), as llama.cpp built from source for one machine runs; the venv belongs to this machine.
#   AMX stays off: on a 2-vCPU Xeon with AMX, a -DGGML_NATIVE=ON build's AMX matmul died with
#   SIGILL at its first tile instruction (tilezero), with the tile state granted or not. Where
#   /proc/cpuinfo is absent (not x86-64 Linux), -DGGML_NATIVE=ON.
# - -DLLAVA_BUILD=OFF leaves out the multimodal library (the binding loads it only for images).
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "[install-llamacpp] $*"; }

LLAMACPP_VERSION="0.3.36"
CACHE="${LLM_FORGE_CACHE:-$HOME/.cache/llm-forge}"
LLAMACPP_VENV="${LLAMACPP_VENV:-$CACHE/llama-cpp-$LLAMACPP_VERSION}"
LLAMACPP_PYTHON="${LLAMACPP_PYTHON:-python3}"
STAMP="$LLAMACPP_VENV/.llm-forge-llamacpp"
read -r -a EXTRA_PIP <<< "${LLAMACPP_PIP_ARGS:-}"

# -DGGML_<EXT>=ON for each extension the CPU has, AMX off; -DGGML_NATIVE=ON off x86-64 Linux.
cpu_cmake_args() {
    if [[ "$(uname -m)" != x86_64 || ! -r /proc/cpuinfo ]]; then echo "-DGGML_NATIVE=ON"; return; fi
    local flags args="-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
    local pair
    for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
                avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
        [[ "$flags" == *" ${pair%%:*} "* ]] && args+=" -DGGML_${pair#*:}=ON"
    done
    echo "$args"
}

install_llamacpp() {
    local started=$SECONDS
    log "building llama-cpp-python==$LLAMACPP_VERSION into $LLAMACPP_VENV (once; several minutes)"
    if [[ -e "$LLAMACPP_VENV" ]]; then
        # An install that did not finish (no stamp): start again, but only over a venv.
        [[ -f "$LLAMACPP_VENV/pyvenv.cfg" ]] \
            || { log "$LLAMACPP_VENV exists and is not a venv; set LLAMACPP_VENV"; exit 1; }
        rm -rf "$LLAMACPP_VENV"
    fi
    "$LLAMACPP_PYTHON" -m venv "$LLAMACPP_VENV"
    local py="$LLAMACPP_VENV/bin/python" log_file="$LLAMACPP_VENV/install.log"
    local pip=("$py" -m pip --disable-pip-version-check)
    export CMAKE_ARGS="${LLAMACPP_CMAKE_ARGS:-$(cpu_cmake_args) -DLLAVA_BUILD=OFF}"
    export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
    log "CMAKE_ARGS=$CMAKE_ARGS, $CMAKE_BUILD_PARALLEL_LEVEL jobs; the build's log: $log_file"
    "${pip[@]}" install --no-cache-dir --verbose "llama-cpp-python==$LLAMACPP_VERSION" \
        "${EXTRA_PIP[@]}" > "$log_file" 2>&1 \
        || { log "the build failed; tail of $log_file:"; tail -n 30 "$log_file"; exit 1; }
    "$py" -c 'import llama_cpp; print(llama_cpp.llama_print_system_info().decode())' \
        > "$LLAMACPP_VENV/system_info.txt" 2>&1 \
        || { log "llama_cpp does not import:"; cat "$LLAMACPP_VENV/system_info.txt"; exit 1; }
    log "built in $((SECONDS - started)) s, $(du -sh "$LLAMACPP_VENV" | cut -f1) on disk; the CPU" \
        "features it uses: $(cat "$LLAMACPP_VENV/system_info.txt")"
    echo "$LLAMACPP_VERSION" > "$STAMP"
    log "llama-cpp-python $LLAMACPP_VERSION ready in $LLAMACPP_VENV"
}

[[ -f "$STAMP" ]] || install_llamacpp
