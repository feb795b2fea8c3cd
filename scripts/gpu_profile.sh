#!/usr/bin/env bash
# Print the hardware profile (l4, a100-40gb, a100-80gb, h100-80gb) of this host's first GPU, as
# `forge engine --hardware` takes it; exit 1 naming the GPU when no profile fits.
set -euo pipefail
gpu="$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits | head -1)"
case "$gpu" in
    *L4*) hardware=l4 ;;
    *H100*) hardware=h100-80gb ;;
    *A100*) mem="${gpu##*, }"; if (( mem > 50000 )); then hardware=a100-80gb; else hardware=a100-40gb; fi ;;
    *) echo "gpu_profile: no profile for GPU '$gpu' (profiles: l4, a100-40gb, a100-80gb, h100-80gb)" >&2; exit 1 ;;
esac
echo "GPU: $gpu -> hardware profile $hardware" >&2
echo "$hardware"
