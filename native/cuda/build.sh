#!/usr/bin/env bash
# Build the CUDA paged-attention harness (native/cuda/paged_attention.cu) into
# build/cuda/libpp_cuda_attention.so for one GPU architecture (default sm_90:
# H100/H200). Needs nvcc; the engine itself does not use it yet.
#   native/cuda/build.sh [ARCH] [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
ARCH=${1:-sm_90}
OUT=${2:-build/cuda}
mkdir -p "$OUT"
nvcc -O3 -std=c++17 -arch="$ARCH" -shared -Xcompiler -fPIC -o "$OUT/libpp_cuda_attention.so" \
  native/cuda/paged_attention.cu
echo "$OUT/libpp_cuda_attention.so"
