#!/usr/bin/env bash
# Builds llama.cpp's own tools (llama-server, llama-batched-bench, llama-bench, llama-perplexity)
# from the source bundled in the llama-cpp-python sdist, for side-by-side benchmarks. Nothing of
# it is committed: the sdist and the build live under $LLAMA_CPP_DIR (default bench/.llama.cpp,
# git-ignored). Prints the bin directory on its last line.
#
#     bench/build_llama_cpp.sh            # ~6 minutes on 2 cores
#     bench/build_llama_cpp.sh --cuda     # with GGML's CUDA backend, into build-cuda/ (for
#                                         # bench/device_bench.py); $CUDA_ARCHS as for
#                                         # bench/build_ggml_cuda.sh. Build it on the GPU machine:
#                                         # GGML_NATIVE tunes the CPU code for the build host.
#     PORTABLE_CPU=1 bench/build_llama_cpp.sh --cuda
#                                         # built on one machine, run on another: the CPU code
#                                         # for AVX2/FMA/F16C, the variant our own GGML CUDA
#                                         # wheel builds, so neither side has an ISA edge
set -euo pipefail
VERSION=0.3.36
HERE="$(cd "$(dirname "$0")" && pwd)"
DIR="${LLAMA_CPP_DIR:-$HERE/.llama.cpp}"
JOBS="${JOBS:-$(nproc)}"
BUILD=build
FLAGS=()
if [ "${1:-}" = "--cuda" ]; then
  BUILD=build-cuda
  # The same toolkit checks, cuBLAS and driver stub as our own GGML's CUDA build.
  . "$HERE/_cuda_env.sh"
  cuda_setup "${GGML_CUDA_WORK:-$HERE/.ggml-cuda}" "${CUDA_ARCHS:-$CUDA_DEFAULT_ARCHS}" || exit $?
  FLAGS=(-DGGML_CUDA=ON "${CUDA_CMAKE_ARGS[@]}")
fi
CPU_FLAGS=(-DGGML_NATIVE=ON)
if [ "${PORTABLE_CPU:-0}" = 1 ]; then
  CPU_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
fi
mkdir -p "$DIR"
cd "$DIR"
BIN="$DIR/$BUILD/bin"
if [ -x "$BIN/llama-server" ] && [ -x "$BIN/llama-batched-bench" ] && [ -x "$BIN/llama-bench" ] &&
   [ -x "$BIN/llama-perplexity" ]; then
  echo "$BIN"; exit 0
fi
if [ ! -d "llama_cpp_python-$VERSION" ]; then
  python3 -m pip download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d .
  tar xzf "llama_cpp_python-$VERSION.tar.gz"
fi
SRC="$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"
# The same CPU build llama.cpp's own docs give: native ISA, tinyBLAS (the default), Release.
cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release "${CPU_FLAGS[@]}" -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
      "${FLAGS[@]}" >"$DIR/$BUILD.log" 2>&1 || { tail -30 "$DIR/$BUILD.log" >&2; exit 1; }
cmake --build "$BUILD" -j "$JOBS" --target llama-server llama-batched-bench llama-bench llama-perplexity \
      >>"$DIR/$BUILD.log" 2>&1 ||
  { tail -30 "$DIR/$BUILD.log" >&2; exit 1; }
echo "$BIN"
