#!/usr/bin/env bash
# Builds libggml-python (the GGML our engine links) from its PyPI sdist with the CUDA backend,
# into a wheel in OUT_DIR, for the GPU runs of bench/device_bench.py. Prints the wheel's path
# on its last line.
#
#     bench/build_ggml_cuda.sh OUT_DIR [ARCHS]
#
#   ARCHS / $CUDA_ARCHS   CMAKE_CUDA_ARCHITECTURES, default "90;86;89;120" (H100/H200, RTX 30xx,
#                         RTX 40xx, RTX 50xx; bench/_cuda_env.sh). One architecture builds
#                         several times faster: "90" for the lent H100/H200.
#   $JOBS                 parallel compile jobs, default 2 (nvcc takes up to ~3 GB a job)
#   $GGML_CUDA_WORK       where the sdist, cuBLAS and the driver stub are kept between runs
#                         (default bench/.ggml-cuda, git-ignored)
#   $GGML_SDIST           an sdist tarball to build instead of downloading one
#   $CMAKE_ARGS           more GGML CMake options, appended to ours
#
# Needs only nvcc (bench/_cuda_env.sh finds or makes cuBLAS and libcuda for the link). Install
# the result on the GPU machine, then relink our library against it:
#     pip install --force-reinstall --no-deps OUT_DIR/libggml_python-*.whl
#     pip install --force-reinstall --no-deps --no-build-isolation .
# The wheel bundles neither cuBLAS nor the driver: it loads libcublas.so.N and libcuda.so.1
# from the GPU machine (bench/device_bench.py preloads a pip-installed cuBLAS).
set -euo pipefail
VERSION=0.20.2.post1
HERE="$(cd "$(dirname "$0")" && pwd)"
. "$HERE/_cuda_env.sh"
OUT="${1:?usage: $0 OUT_DIR [ARCHS]}"
ARCHS="${2:-${CUDA_ARCHS:-$CUDA_DEFAULT_ARCHS}}"
JOBS="${JOBS:-2}"
WORK="${GGML_CUDA_WORK:-$HERE/.ggml-cuda}"
PY="${PYTHON:-python3}"
cuda_setup "$WORK" "$ARCHS" || exit $?

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
SDIST="${GGML_SDIST:-$WORK/libggml_python-$VERSION.tar.gz}"
if [ ! -f "$SDIST" ]; then
  # --no-binary for this package only: ":all:" would also build its build tools (CMake!) from
  # source while pip prepares the metadata.
  "$PY" -m pip download -q --no-deps --no-binary libggml-python "libggml-python==$VERSION" -d "$WORK"
fi

# scikit-build-core splits CMAKE_ARGS like a shell: quote each argument (the list has ';').
CMAKE_ARGS_ALL="$(printf '%q ' "${CUDA_CMAKE_ARGS[@]}") ${CMAKE_ARGS:-}"
LOG="$WORK/build-$(tr ';' '_' <<<"$ARCHS").log"
echo "building libggml-python $VERSION with CUDA $CUDA_MAJOR for $ARCHS, $JOBS jobs (log: $LOG)" >&2
start=$(date +%s)
# USE_CUDA=1 is libggml-python's switch for GGML_CUDA. --no-cache-dir: pip's wheel cache keys
# on the sdist alone and would hand back an earlier (CPU) build. wheel.py-api=py3: the wheel
# holds shared libraries only, so tag it for any Python 3 (the GPU machine's Python may differ).
if ! USE_CUDA=1 CMAKE_ARGS="$CMAKE_ARGS_ALL" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" CUDACXX="$CUDA_HOME/bin/nvcc" \
     "$PY" -m pip wheel -v --no-deps --no-cache-dir -C wheel.py-api=py3 "$SDIST" -w "$OUT" >"$LOG" 2>&1; then
  tail -40 "$LOG" >&2; exit 1
fi
echo "built in $(( $(date +%s) - start )) s" >&2
WHEEL="$(ls -t "$OUT"/libggml_python-"$VERSION"-*.whl | head -1)"
unzip -l "$WHEEL" | grep -q 'libggml-cuda\.so' ||
  { echo "$WHEEL has no libggml-cuda.so: the CUDA backend was not built (see $LOG)" >&2; exit 1; }
echo "$WHEEL"
