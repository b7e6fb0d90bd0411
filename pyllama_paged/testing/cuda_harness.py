"""Loading the CUDA paged-attention harness (native/cuda/ of a source checkout) for tests
and the GPU benchmark: built with nvcc into a directory, bound with cffi (ABI mode). The
CUDA sources are not installed with the package: callers name the checkout's native/cuda."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
from cffi import FFI

CDEF = """
const char *pp_cuda_last_error(void);
int pp_cuda_device_count(void);
int pp_cuda_paged_decode(const float *q, const uint16_t *k_pool, const uint16_t *v_pool, int64_t num_slots,
                         const int32_t *block_tables, const int32_t *seq_lens, int n_seqs, int n_head,
                         int n_head_kv, int head_dim, int block_size, int max_blocks, int window, float scale,
                         int part_keys, int iters, float *out, float *ms_per_iter);
"""


def build(out_dir: Path, cuda_sources: Path, arch: str = "sm_90") -> Path | None:
    """The harness library built into out_dir from cuda_sources (a checkout's native/cuda), or None
    without nvcc."""
    if shutil.which("nvcc") is None:
        return None
    subprocess.run([str(Path(cuda_sources) / "build.sh"), arch, str(Path(out_dir).resolve())], check=True,
                   capture_output=True)
    return out_dir / "libpp_cuda_attention.so"


class CudaHarness:
    """pp_cuda_paged_decode on numpy arrays."""

    def __init__(self, path: Path):
        self.ffi = FFI()
        self.ffi.cdef(CDEF)
        self.lib = self.ffi.dlopen(str(path))

    @property
    def devices(self) -> int:
        return self.lib.pp_cuda_device_count()

    def decode(self, q, k_pool, v_pool, block_tables, seq_lens, block_size, window=0, scale=1.0,
               part_keys=0, iters=0):
        """(out [n_seqs, n_head, head_dim], ms per launch) for f32 q and f16 pools [slots, n_head_kv, hd]."""
        ffi = self.ffi
        q = np.ascontiguousarray(q, np.float32)
        k = np.ascontiguousarray(k_pool, np.float16).view(np.uint16)
        v = np.ascontiguousarray(v_pool, np.float16).view(np.uint16)
        tables = np.ascontiguousarray(block_tables, np.int32)
        lens = np.ascontiguousarray(seq_lens, np.int32)
        n_seqs, n_head, hd = q.shape
        out = np.empty_like(q)
        ms = ffi.new("float *")
        p = lambda a, t: ffi.cast(t, ffi.from_buffer(a))  # noqa: E731
        rc = self.lib.pp_cuda_paged_decode(p(q, "float *"), p(k, "uint16_t *"), p(v, "uint16_t *"), k.shape[0],
                                           p(tables, "int32_t *"), p(lens, "int32_t *"), n_seqs, n_head,
                                           k.shape[1], hd, block_size, tables.shape[1], window, scale, part_keys,
                                           iters, p(out, "float *"), ms)
        if rc != 0:
            raise RuntimeError(ffi.string(self.lib.pp_cuda_last_error()).decode())
        return out, ms[0]
