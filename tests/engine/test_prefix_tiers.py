"""The prefix cache's tiers below the pool, on the default model: blocks evicted
from the pool come back from host RAM, blocks written by one engine come back
from disk in another (a restart), damaged files are misses, and every restored
answer is the answer computed from scratch (up to near-ties)."""

import os
import subprocess
import sys

import numpy as np
import pytest

from pyllama_paged.api.llama import Llama
from pyllama_paged.engine.kv.block_store import DiskBlockStore, HostBlockStore
from pyllama_paged.engine import EngineConfig, LLMEngine, PrefixTierConfig, SamplingParams, SchedulerConfig
from pyllama_paged.engine.kv.prefix_tiers import chain_keys
from pyllama_paged.testing.agreement import assert_greedy_agree, engine_logits

SYSTEM = ("You are the support agent of a hardware shop. Policies: refunds within 30 days with a receipt; "
          "exchanges within 60 days; warranty claims go to the maker; never promise delivery dates; "
          "answer in two sentences. Tools: lookup_order(order_id), stock(sku), open_ticket(summary). ")


@pytest.fixture(scope="module")
def llm():
    llm = Llama(n_ctx=2048, n_threads=2, verbose=False)
    yield llm
    llm.close()


def _prompt(llm, question: str, repeat: int = 8) -> list[int]:
    text = f"<start_of_turn>user\n{SYSTEM * repeat}\n\n{question}<end_of_turn>\n<start_of_turn>model\n"
    return llm.tokenize(text.encode(), special=True)


def _engine(llm, tiers: PrefixTierConfig | None, num_blocks: int | None = None, **kw) -> LLMEngine:
    config = EngineConfig(n_ctx=2048, n_threads=2, num_blocks=num_blocks, prefix_tiers=tiers, **kw)
    return LLMEngine.from_config(config, model=llm._model, eot_ids=llm.llm_engine.eot_ids)


def _answer(engine, prompt, max_tokens=24) -> tuple[list[int], int]:
    """Greedy answer ids and the tokens the engine computed for it."""
    before = engine.num_computed_tokens
    request = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
    while engine.has_work():
        engine.step()
    assert request.error is None, request.error
    return request.seqs[0].output_ids, engine.num_computed_tokens - before


def _restored_as_computed(engine, plain, prompt, want, got, cold):
    """prompt again on engine: restored from RAM (a quarter of the cold computation at
    most), and its answer, like the first one (got), is plain's (want) up to near-ties."""
    again, restored = _answer(engine, prompt)
    stats = engine.stats()
    assert stats["tier_ram_hit_blocks"] > 0 and stats["prefix_tier_hits"] > 0, stats
    assert restored < cold / 4, (restored, cold)
    logits_of = engine_logits(plain.runner)
    assert_greedy_agree(prompt, want, got, logits_of, engine.eot_ids)
    assert_greedy_agree(prompt, want, again, logits_of, engine.eot_ids)
    _settled(engine)


def _settled(engine):
    s = engine.stats()
    assert s["blocks_used"] == 0 and s["blocks_free"] + s["blocks_cached"] == s["blocks_total"]


# ---- keys and stores -------------------------------------------------------------
def test_chain_keys_name_a_prefix_and_its_model():
    ids = list(range(100))
    keys = chain_keys(b"a" * 16, ids, 16, 6)
    assert len(keys) == 6 and len(set(keys)) == 6
    assert chain_keys(b"a" * 16, ids[:40] + [7] * 60, 16, 6)[:2] == keys[:2]   # same first 32 tokens
    assert chain_keys(b"a" * 16, ids[:40] + [7] * 60, 16, 6)[2:] != keys[2:]
    assert chain_keys(b"b" * 16, ids, 16, 6)[0] != keys[0]                   # another model or layout
    assert chain_keys(b"a" * 16, ids, 16, 6, keys[:3]) == keys                # extends what is known


def test_host_store_keeps_its_bound_least_recent_out():
    store = HostBlockStore(max_bytes=3 * 100)
    blocks = {bytes([i]) * 16: np.full(100, i, dtype=np.uint8) for i in range(4)}
    for key in list(blocks)[:3]:
        store.put(key, blocks[key])
    assert store.get(bytes([0]) * 16) is not None        # 0 is now the most recent
    store.put(bytes([3]) * 16, blocks[bytes([3]) * 16])
    assert bytes([1]) * 16 not in store and bytes([0]) * 16 in store
    assert store.num_bytes == 300 and store.num_evicted == 1


def test_disk_store_round_trip_damage_and_bound(tmp_path):
    store = DiskBlockStore(str(tmp_path), max_bytes=10 * 4096)
    data = {bytes([i]) * 16: np.random.default_rng(i).integers(0, 256, 4000, dtype=np.uint8) for i in range(6)}
    for key, block in data.items():
        store.put(key, block)
    store.flush()
    for key, block in data.items():
        assert np.array_equal(store.get(key), block)
    files = sorted(p for p in os.listdir(tmp_path) if p.endswith(".kvb"))
    assert len(files) == 6 and not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    keys = list(data)
    # a flipped payload byte, a truncated file, a file renamed to another key, an empty file
    path = lambda k: os.path.join(tmp_path, k.hex() + ".kvb")   # noqa: E731
    with open(path(keys[0]), "r+b") as f:
        f.seek(-10, os.SEEK_END)
        f.write(b"\xff" if f.read(1) != b"\xff" else b"\x00")
    with open(path(keys[1]), "r+b") as f:
        f.truncate(1000)
    os.replace(path(keys[2]), path(b"\x77" * 16))
    open(path(keys[3]), "wb").close()
    assert store.get(keys[0]) is None and store.get(keys[1]) is None
    assert store.get(b"\x77" * 16) is None and store.get(keys[3]) is None and store.get(keys[2]) is None
    assert store.num_corrupt == 4 and not os.path.exists(path(keys[0]))
    assert np.array_equal(store.get(keys[4]), data[keys[4]])
    # past the bound the oldest files go
    for i in range(10, 20):
        store.put(bytes([i]) * 16, np.zeros(4000, dtype=np.uint8))
    store.flush()
    total = sum(os.path.getsize(os.path.join(tmp_path, p)) for p in os.listdir(tmp_path))
    assert total <= 10 * 4096
    store.close()


# both processes write the same 20 keys, the same bytes
_WRITER = """
import sys, numpy as np
from pyllama_paged.engine.kv.block_store import DiskBlockStore
store = DiskBlockStore(sys.argv[1], max_bytes=1 << 30)
for i in range(40):
    store.put(bytes([i % 20]) * 16, np.full(20000, i % 20, dtype=np.uint8))
store.close()
"""


def test_disk_store_shared_by_processes(tmp_path):
    """Two processes write the same blocks into one directory at once; a third reads
    every one whole."""
    # run from elsewhere than the checkout, whose source tree has no native library
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], cwd=tmp_path) for _ in range(2)]
    reader = DiskBlockStore(str(tmp_path), max_bytes=1 << 30)
    while any(p.poll() is None for p in procs):
        for i in range(20):
            got = reader.get(bytes([i]) * 16)
            if got is not None:
                assert got.shape == (20000,) and (got == i).all()
    assert [p.wait() for p in procs] == [0, 0]
    for i in range(20):
        assert (reader.get(bytes([i]) * 16) == i).all()
    assert reader.num_corrupt == 0
    reader.close()


# ---- the engine ------------------------------------------------------------------
def test_blocks_evicted_from_the_pool_come_back_from_ram(llm):
    """A pool that holds one conversation: other prompts evict the first one's blocks,
    and its next turn restores them from RAM instead of recomputing."""
    first = _prompt(llm, "Where is my order 1234?")
    need = -(-(len(first) + 64) // 32) * llm.llm_engine.runner.kv.n_groups
    engine = _engine(llm, PrefixTierConfig(ram_bytes=256 << 20), num_blocks=need + 8)
    plain = _engine(llm, None, num_blocks=need + 8)
    try:
        want, cold = _answer(plain, first)
        got, computed = _answer(engine, first)
        assert computed == cold
        for i in range(3):   # other conversations take the pool's pages
            other = f"<start_of_turn>user\n{i} " + "Tell me a story about a lighthouse keeper. " * 40
            _answer(engine, llm.tokenize(other.encode(), special=True))
        _restored_as_computed(engine, plain, first, want, got, cold)
    finally:
        engine.close()
        plain.close()


def test_restore_in_pieces_with_window_pages_reused(llm):
    """Pieces smaller than the prompt and a pool with little slack: sliding-window
    groups give a restored piece's pages back and the next piece takes them; the bytes
    written last must be the ones the pages keep."""
    first = _prompt(llm, "Summarise the policies.", repeat=12)
    assert len(first) > 700   # past the default model's 512-token window
    kv = llm.llm_engine.runner.kv
    config = PrefixTierConfig(ram_bytes=256 << 20)
    blocks = kv.groups.steady_bytes(1, 32, len(first) + 64) // 32 + 4 * kv.n_groups
    engine = _engine(llm, config, num_blocks=blocks, scheduler=SchedulerConfig(max_num_batched_tokens=96))
    plain = _engine(llm, None)
    try:
        want, cold = _answer(plain, first)
        got, _ = _answer(engine, first)
        engine.runner.kv.reset_prefix_cache()   # the pool forgets; the tier remembers
        _restored_as_computed(engine, plain, first, want, got, cold)
    finally:
        engine.close()
        plain.close()


def test_disk_tier_survives_a_restart_and_damage_is_a_miss(llm, tmp_path):
    prompt = _prompt(llm, "Can I exchange a saw after 40 days?")
    disk = PrefixTierConfig(disk_dir=str(tmp_path / "kv"))
    plain = _engine(llm, None)
    try:
        want, cold = _answer(plain, prompt)
        logits_of = engine_logits(plain.runner)
        writer = _engine(llm, disk)
        _answer(writer, prompt)
        writer.close()   # flushes the queued writes: the "restart"
        files = [f for f in os.listdir(tmp_path / "kv") if f.endswith(".kvb")]
        assert len(files) >= (len(prompt) - 1) // 32
        reader = _engine(llm, disk)
        try:
            got, restored = _answer(reader, prompt)
            assert restored <= 32 + 24, (restored, cold)
            assert reader.stats()["tier_disk_hit_blocks"] >= len(files) - 1
            assert_greedy_agree(prompt, want, got, logits_of, reader.eot_ids)
        finally:
            reader.close()
        # damage every file: flipped bytes, truncations, garbage
        for i, name in enumerate(sorted(files)):
            path = tmp_path / "kv" / name
            raw = bytearray(path.read_bytes())
            if i % 3 == 0:
                raw[len(raw) // 2] ^= 0x55
            elif i % 3 == 1:
                raw = raw[: len(raw) // 3]
            else:
                raw = bytearray(os.urandom(len(raw)))
            path.write_bytes(bytes(raw))
        damaged = _engine(llm, disk)
        try:
            got, computed = _answer(damaged, prompt)
            stats = damaged.stats()
            # a damaged first block ends the chain: everything is recomputed
            assert stats["tier_disk_corrupt_files"] >= 1 and computed == cold
            assert_greedy_agree(prompt, want, got, logits_of, damaged.eot_ids)
        finally:
            damaged.close()
    finally:
        plain.close()


def test_another_kv_layout_never_reads_the_blocks(llm, tmp_path):
    prompt = _prompt(llm, "Is the hammer in stock?")
    disk = PrefixTierConfig(disk_dir=str(tmp_path))
    f16 = _engine(llm, disk)
    _answer(f16, prompt)
    f16.close()
    q8 = _engine(llm, disk, kv_cache_type="q8_0")
    try:
        _, computed = _answer(q8, prompt)
        assert q8.stats()["tier_disk_hit_blocks"] == 0 and computed >= len(prompt)
    finally:
        q8.close()


def test_llama_keeps_prompts_on_disk_across_instances(tmp_path):
    """The Python API's prefix_cache_dir: a second Llama (a new process would do the same)
    restores the first one's prompt instead of computing it."""
    text = SYSTEM * 6 + "\nQ: Do you sell ladders?\nA:"
    answers, computed = [], []
    for _ in range(2):
        llm = Llama(n_ctx=2048, n_threads=2, verbose=False, prefix_cache_dir=str(tmp_path))
        try:
            out = llm.create_completion(text, max_tokens=12, temperature=0)
            answers.append(out["choices"][0]["text"])
            computed.append(llm.llm_engine.stats()["computed_tokens"])
        finally:
            llm.close()
    assert answers[0] == answers[1]
    assert computed[1] < computed[0] / 4, computed
