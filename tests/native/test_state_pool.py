"""The recurrent state pool of hybrid models (pp_state_pool_* in pyllama_paged.h, bound by
engine/kv/state_pool.py): slots taken lowest first and zeroed, given back, copied, zeroed,
read and written in the documented layout; every misuse a clear error that changes nothing;
and pp_model_create's checks of a hybrid's hyper-parameters."""

import re
from contextlib import closing

import numpy as np
import pytest

from pyllama_paged._native import ffi, lib
from pyllama_paged.engine import EngineConfig
from pyllama_paged.engine.kv.state_pool import StatePool, state_bytes_per_sequence
from pyllama_paged.engine.worker.model import Model
from pyllama_paged.engine.worker.model_runner import ModelRunner
from pyllama_paged.errors import NativeError, OutOfBlocksError, PagedError
from pyllama_paged.testing.reference.hybrid_model import HybridReferenceModel, hybrid_state_bytes
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
from pyllama_paged.testing.reference.tiny_qwen35 import write_tiny_qwen35


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path = write_tiny_qwen35(tmp_path_factory.mktemp("state") / "qwen35.gguf", recurrent_layers=[True, False, True, True])
    model = Model(path, pack_panels=False, repack_weights=False)
    yield model, HybridReferenceModel.from_gguf(path)
    model.close()


def test_a_slot_holds_every_linear_layers_states(hybrid):
    model, ref = hybrid
    # three linear layers of a 3 x 512 convolution state and a 4 x 64 x 64 delta-rule state, in f32
    assert state_bytes_per_sequence(model.native) == hybrid_state_bytes(ref.hybrid) == 4 * 3 * (3 * 512 + 4 * 64 * 64)
    with closing(StatePool(model.native, 3)) as pool:
        assert pool.bytes_per_slot == hybrid_state_bytes(ref.hybrid) and pool.pool_bytes == 3 * pool.bytes_per_slot


def test_slots_are_taken_lowest_first_zeroed_and_run_out_cleanly(hybrid):
    model, _ = hybrid
    with closing(StatePool(model.native, 3)) as pool:
        assert [pool.alloc() for _ in range(3)] == [0, 1, 2] and pool.num_free == 0
        with pytest.raises(OutOfBlocksError, match="all 3 state slots are taken"):
            pool.alloc()
        assert pool.num_free == 0
        junk = np.random.default_rng(0).integers(0, 256, pool.bytes_per_slot, dtype=np.uint8)
        pool.write(1, junk)
        assert np.array_equal(pool.read(1), junk)
        pool.free(1)
        assert pool.num_free == 1
        assert pool.alloc() == 1 and not pool.read(1).any()   # a slot comes back zeroed


def test_copy_and_zero(hybrid):
    model, _ = hybrid
    with closing(StatePool(model.native, 4)) as pool:
        a, b, c = pool.alloc(), pool.alloc(), pool.alloc()
        state = np.random.default_rng(1).integers(0, 256, pool.bytes_per_slot, dtype=np.uint8)
        pool.write(a, state)
        pool.copy(a, c)
        assert np.array_equal(pool.read(c), state) and not pool.read(b).any()
        pool.zero(a)
        assert not pool.read(a).any() and np.array_equal(pool.read(c), state)


def test_misuse_is_refused_and_changes_nothing(hybrid):
    model, _ = hybrid
    with closing(StatePool(model.native, 2)) as pool:
        a = pool.alloc()
        state = np.arange(pool.bytes_per_slot, dtype=np.uint64).astype(np.uint8)
        pool.write(a, state)
        for call, message in ((lambda: pool.free(1), "state slot 1 is not taken"),
                              (lambda: pool.free(5), r"state slot 5 out of range \[0, 2\)"),
                              (lambda: pool.copy(a, 1), "state slot 1 is not taken"),
                              (lambda: pool.copy(a, a), "onto itself"),
                              (lambda: pool.zero(-1), "out of range"),
                              (lambda: pool.read(1), "not taken"),
                              (lambda: pool.write(1, state), "not taken")):
            with pytest.raises(NativeError, match=message):
                call()
        with pytest.raises(PagedError, match="holds"):
            pool.write(a, state[:-1])
        assert pool.num_free == 1 and np.array_equal(pool.read(a), state)
        pool.free(a)
        with pytest.raises(NativeError, match="not taken"):
            pool.free(a)


def test_pools_only_for_hybrids_and_only_their_own_context(hybrid, tmp_path):
    dense = Model(write_tiny_model(tmp_path / "llama.gguf", "llama", n_layer=1), pack_panels=False)
    try:
        assert state_bytes_per_sequence(dense.native) == 0
        with pytest.raises(NativeError, match="no recurrent layers"):
            StatePool(dense.native, 1)
    finally:
        dense.close()
    model, _ = hybrid
    for n in (0, 2**21):
        with pytest.raises(NativeError, match="slots outside"):
            StatePool(model.native, n)
    other = Model(write_tiny_qwen35(tmp_path / "other.gguf"), pack_panels=False)
    try:
        with closing(StatePool(other.native, 1)) as pool, \
                closing(ModelRunner(model, EngineConfig(n_ctx=32, n_threads=1, n_batch=8, block_size=16))) as runner:
            assert lib.pp_context_set_state_pool(runner._ctx, pool.native) == lib.PP_ERR_INVALID
            assert "another model" in ffi.string(lib.pp_last_error()).decode()
    finally:
        other.close()   # after the pool that borrowed it


def _hparams(**changes):
    """A valid tiny qwen35's native hyper-parameters, with changes."""
    recurrent = ffi.new("int32_t[]", [1, 1, 1, 0])
    windows = ffi.new("int32_t[]", [0] * 4)
    fields = dict(arch=lib.PP_ARCH_QWEN35, n_layer=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512,
                  n_vocab=512, n_ctx_train=4096, rope_type=40, rope_freq_base=1e7, rope_freq_scale=1.0,
                  rope_freq_base_swa=1e4, rms_eps=1e-6, attn_scale=0.125, embd_scale=1.0, layer_window=windows,
                  n_rot=16, layer_recurrent=recurrent, ssm_d_conv=4, ssm_d_state=64, ssm_n_group=2,
                  ssm_dt_rank=4, rope_sections=[3, 3, 2, 0])
    fields.update(changes)
    return ffi.new("pp_model_hparams *", fields), (recurrent, windows)


@pytest.mark.parametrize("changes,message", [
    ({"layer_recurrent": ffi.NULL}, "needs its layer kinds"),
    ({"rope_type": 2}, "rope type must be IMRoPE"),
    ({"ssm_d_conv": 1}, r"ssm.conv_kernel 1 outside \[2, 64\]"),
    ({"ssm_dt_rank": 3}, "must be a positive multiple of ssm.group_count"),
    ({"rope_sections": [0, 0, 0, 8]}, "must give the first three some pairs"),
    ({"layer_recurrent": ffi.new("int32_t[]", [1, 1, 1, 1])}, "4 of 4 layers recurrent"),
    ({"layer_recurrent": ffi.new("int32_t[]", [1, 2, 1, 0])}, r"layer_recurrent\[1\] = 2"),
])
def test_model_create_checks_a_hybrids_hyperparameters(changes, message):
    hp, _keep = _hparams(**changes)
    out = ffi.new("pp_model **")
    assert lib.pp_model_create(hp, out) == lib.PP_ERR_INVALID and out[0] == ffi.NULL
    assert re.search(message, ffi.string(lib.pp_last_error()).decode())
    good, _keep2 = _hparams()
    assert lib.pp_model_create(good, out) == lib.PP_OK
    lib.pp_model_destroy(out[0])
