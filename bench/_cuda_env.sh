# Sourced (not run) by bench/build_ggml_cuda.sh and bench/build_llama_cpp.sh --cuda: what both
# GGML CUDA builds need from this machine, found or made once.
#
#   cuda_setup WORK ARCHS   sets CUDA_HOME, CUDA_MAJOR and the array CUDA_CMAKE_ARGS (compiler,
#                           architectures, lean GGML switches, and where cuBLAS and libcuda
#                           are when the toolkit lacks them); downloads and stubs go to WORK.
#                           Returns 2 (with a message) without nvcc or for an architecture
#                           this nvcc cannot build.
#
# The development machines have CUDA's compiler but neither cuBLAS nor a driver. GGML's CUDA
# backend links both. cuBLAS then comes from PyPI's nvidia-cublas wheel (the same files NVIDIA's
# installer puts in the toolkit); libcuda.so from a stub made here from cuda.h, as the toolkit's
# own stubs/ folder would give. Neither ends up in what is built: at run time the GPU machine's
# libcublas and libcuda.so.1 are loaded.

# The architectures built when none are named: Hopper (the lent H100/H200) and the consumer
# cards of the last three generations (RTX 30xx, 40xx, 50xx; GGML turns 120 into 120a itself).
CUDA_DEFAULT_ARCHS="90;86;89;120"

cuda_setup() {
  local work="$1" archs="$2" py="${PYTHON:-python3}" top a n
  command -v nvcc >/dev/null || { echo "nvcc is not on PATH" >&2; return 2; }
  # The toolkit whose nvcc is on PATH: /usr/local/bin/nvcc may be a wrapper script, so ask
  # nvcc where it lives rather than following the file.
  if [ -z "${CUDA_HOME:-}" ]; then
    top="$(nvcc --dryrun -E -x cu /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)"
    CUDA_HOME="$(cd "$top" 2>/dev/null && pwd || true)"
  fi
  [ -x "$CUDA_HOME/bin/nvcc" ] || CUDA_HOME="$(dirname "$(dirname "$(command -v nvcc)")")"
  CUDA_MAJOR="$(nvcc --version | sed -n 's/.*release \([0-9]*\)\..*/\1/p')"

  # Refuse architectures this nvcc cannot build now, not half an hour into the build.
  local supported
  supported="$(nvcc --list-gpu-arch)"
  IFS=';' read -ra _archs <<<"$archs"
  for a in "${_archs[@]}"; do
    n="${a%%-*}"; n="${n%[af]}"
    grep -qx "compute_$n" <<<"$supported" ||
      { echo "nvcc $CUDA_MAJOR cannot build architecture '$a' (see nvcc --list-gpu-arch)" >&2; return 2; }
  done

  mkdir -p "$work"
  # Lean where GGML offers it: flash attention only for the K=V types GGML picks by default
  # (f16, q4_0, q8_0, bf16), no NCCL (one GPU).
  CUDA_CMAKE_ARGS=("-DCMAKE_CUDA_ARCHITECTURES=$archs" "-DCMAKE_CUDA_COMPILER=$CUDA_HOME/bin/nvcc"
                   "-DGGML_CUDA_FA_ALL_QUANTS=OFF" "-DGGML_CUDA_NCCL=OFF"
                   # CUDA graphs: a decode step whose graph repeats (pp_context runs a step of the
                   # last step's shape on the same graph) is replayed as one launch. A standalone
                   # GGML build leaves them off; llama.cpp's own build turns them on.
                   "-DGGML_CUDA_GRAPHS=ON")

  if [ ! -f "$CUDA_HOME/include/cublas_v2.h" ]; then
    # A pip-installed cuBLAS of this CUDA major first (PyTorch's GPU machines have one and
    # may have no network), else PyPI's wheel, unpacked into WORK.
    local roots root cublas="$work/cublas-cu$CUDA_MAJOR" spec
    roots="$("$py" -c 'import nvidia; print("\n".join(nvidia.__path__))' 2>/dev/null || true)"
    root="$(_cuda_cublas_root "$roots")"
    if [ -z "$root" ]; then
      if [ ! -f "$cublas/.done" ]; then
        rm -rf "$cublas"; mkdir -p "$cublas"
        if [ "$CUDA_MAJOR" -ge 13 ]; then spec="nvidia-cublas>=$CUDA_MAJOR,<$((CUDA_MAJOR + 1))"
        else spec="nvidia-cublas-cu$CUDA_MAJOR"; fi
        "$py" -m pip download -q --no-deps --only-binary :all: "$spec" -d "$cublas" || return 1
        # Headers and the two libraries the link reads (the wheel is ~400 MB, mostly
        # cuBLASLt); the wheel's name is kept for the record.
        (cd "$cublas" && ls ./*.whl >version.txt &&
           unzip -q -o ./*.whl '*/include/*' '*/lib/libcublas.so*' '*/lib/libcublasLt.so*' && rm -f ./*.whl) ||
          return 1
        touch "$cublas/.done"
      fi
      root="$(_cuda_cublas_root "$cublas")"
    fi
    [ -n "$root" ] || { echo "no cuBLAS for CUDA $CUDA_MAJOR found or unpacked" >&2; return 1; }
    CUDA_CMAKE_ARGS+=("-DCMAKE_CUDA_FLAGS=-I$root/include"
                      "-DCUDA_cublas_LIBRARY=$root/lib/libcublas.so.$CUDA_MAJOR"
                      "-DCUDA_cublasLt_LIBRARY=$root/lib/libcublasLt.so.$CUDA_MAJOR")
  fi

  # GGML links the driver API for its virtual-memory pool (as llama.cpp's own builds do).
  # Name the library CMake should link: the toolkit's stub, else the driver's (the GPU
  # machines mount it outside CMake's search path), else a stub made here.
  local driver="$CUDA_HOME/lib64/stubs/libcuda.so"
  if [ ! -e "$driver" ]; then
    driver="$(ldconfig -p 2>/dev/null | sed -n 's/^[[:space:]]*libcuda\.so\(\.1\)\{0,1\} (.*) => //p' | head -1)"
  fi
  if [ -z "$driver" ]; then
    driver="$work/libcuda-stub/libcuda.so"
    if [ ! -f "$driver" ]; then
      mkdir -p "$work/libcuda-stub"
      # Every driver function, each returning CUDA_ERROR_STUB_LIBRARY (34), under the real
      # library's soname. Preprocessing expands cuda.h's versioned names (cuMemAlloc ->
      # cuMemAlloc_v2): the symbols a caller really links. Every function rather than none,
      # so a linker run with --as-needed still records the dependency.
      cc -E -P -I"$CUDA_HOME/include" "$CUDA_HOME/include/cuda.h" | tr '\n' ' ' |
        grep -oE 'CUresult +cu[A-Za-z0-9_]+ *\(' | sed -E 's/CUresult +//; s/ *\(//' | sort -u |
        awk '{ printf "int %s(void) { return 34; }\n", $1 }' >"$work/libcuda-stub/libcuda_stub.c"
      cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$driver" "$work/libcuda-stub/libcuda_stub.c" || return 1
    fi
  fi
  CUDA_CMAKE_ARGS+=("-DCUDA_cuda_driver_LIBRARY=$driver")
}

# The folder holding include/cublas_v2.h and lib/libcublas.so.$CUDA_MAJOR below one of the
# newline-separated roots (pip's layout: nvidia/cu13/ for CUDA 13, nvidia/cublas/ before).
_cuda_cublas_root() {
  local r h d
  while IFS= read -r r; do
    [ -d "$r" ] || continue
    while IFS= read -r h; do
      d="$(dirname "$(dirname "$h")")"
      [ -e "$d/lib/libcublas.so.$CUDA_MAJOR" ] && [ -e "$d/lib/libcublasLt.so.$CUDA_MAJOR" ] &&
        { echo "$d"; return; }
    done < <(find "$r" -maxdepth 4 -name cublas_v2.h -path '*/include/*' 2>/dev/null)
  done <<<"$1"
  return 0
}
