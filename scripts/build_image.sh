#!/usr/bin/env bash
# Build the CPU image (Containerfile) with podman where no container registry can be reached:
# the base is a Debian bookworm root filesystem made with debootstrap from Debian's packages
# (python3, python3-venv, libpython3.11) and imported into podman, in place of the pinned
# python:3.11-slim-bookworm. Needs root (debootstrap), podman and debootstrap:
#   apt-get install podman debootstrap
#
#   bash scripts/build_image.sh            # or: make image
#
# Variables:
#   IMAGE           the tag to build (default localhost/llm-forge:cpu)
#   BASE_IMAGE      the base's tag; made once and reused (default localhost/llm-forge-base:bookworm)
#   DEBIAN_MIRROR   debootstrap's mirror (default http://deb.debian.org/debian)
#   KERNEL_MARCH    the level the kernels are compiled for (default x86-64-v3; see the Containerfile)
#   TORCH_INDEX_URL the index torch's CPU build comes from when no wheel is found locally
#   CA_BUNDLE       a CA bundle for pip inside the build, behind a TLS-intercepting proxy
#                   (default: $PIP_CERT when set); passed as a build secret, not kept in the image
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE="${IMAGE:-localhost/llm-forge:cpu}"
BASE_IMAGE="${BASE_IMAGE:-localhost/llm-forge-base:bookworm}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
KERNEL_MARCH="${KERNEL_MARCH:-x86-64-v3}"
TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
CA_BUNDLE="${CA_BUNDLE:-${PIP_CERT:-}}"
WHEELS=image-wheels

for tool in podman debootstrap; do
    command -v "$tool" >/dev/null || { echo "build_image: $tool not found (apt-get install $tool)" >&2; exit 1; }
done

started=$(date +%s)
if podman image exists "$BASE_IMAGE"; then
    echo "[image] base $BASE_IMAGE already built"
else
    echo "[image] base: debootstrap bookworm -> $BASE_IMAGE"
    rootfs="$(mktemp -d)"
    trap 'rm -rf "$rootfs"' EXIT
    debootstrap --variant=minbase --include=python3,python3-venv,libpython3.11,ca-certificates \
        bookworm "$rootfs" "$DEBIAN_MIRROR"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE"
    rm -rf "$rootfs"
    trap - EXIT
fi
base_seconds=$(( $(date +%s) - started ))

# torch's CPU build: a wheel pip finds without PyTorch's index (a local wheel directory or a
# mirror in pip's own configuration) goes into the build context, for the image's Python, and
# the index is then not asked; else the build fetches it from TORCH_INDEX_URL.
rm -f "$WHEELS"/*.whl
if python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
        --platform manylinux_2_28_x86_64 --dest "$WHEELS" "torch==2.13.0+cpu" 2>/dev/null; then
    echo "[image] torch: $(basename "$WHEELS"/torch-*.whl), found locally"
    TORCH_INDEX_URL=""
else
    echo "[image] torch: no local wheel, the build fetches it from $TORCH_INDEX_URL"
fi

args=(--file Containerfile --tag "$IMAGE" --build-arg "BASE=$BASE_IMAGE"
      --build-arg "KERNEL_MARCH=$KERNEL_MARCH" --build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
[[ -n "$CA_BUNDLE" ]] && args+=(--secret "id=ca-bundle,src=$CA_BUNDLE")
build_started=$(date +%s)
podman build "${args[@]}" .
build_seconds=$(( $(date +%s) - build_started ))
rm -f "$WHEELS"/*.whl

size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
echo "[image] $IMAGE built: base ${base_seconds}s, image ${build_seconds}s," \
     "$(( size / 1000000 )) MB (uncompressed)"
