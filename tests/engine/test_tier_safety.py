"""The prefix cache's disk tier tried as someone who can create entries in its directory
would, and as an unlucky operator (engine/kv/block_store.py, engine/kv/prefix_tiers.py):
symlinks planted at every name the store writes or reads never redirect a write or a
read, an unsafe directory is refused, files are private, a huge or truncated file is a
miss that costs no read and no signal, file names are keyed by the directory's secret,
the bound holds for all the processes sharing the directory, and a reset empties the RAM
tier. Real files, real processes, a real engine on a tiny model."""

import json
import os
import stat
import subprocess
import sys
import threading

import numpy as np
import pytest

from pyllama_paged.engine.kv import block_store
from pyllama_paged.engine.kv.block_store import DiskBlockStore
from pyllama_paged.engine import EngineConfig, LLMEngine, PrefixTierConfig, SamplingParams, SchedulerConfig
from pyllama_paged.engine.worker.model_runner import ModelRunner
from pyllama_paged.engine.kv.prefix_tiers import PrefixTiers, chain_keys
from pyllama_paged.errors import PagedError

VICTIM_TEXT = b"the victim's own bytes\n"


def _blocks(n, size=4000, seed=0):
    rng = np.random.default_rng(seed)
    return {bytes([seed, i]) * 8: rng.integers(0, 256, size, dtype=np.uint8) for i in range(n)}


def _name(key: bytes) -> str:
    return key.hex() + ".kvb"


def _victim(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(VICTIM_TEXT)
    st = victim.stat()
    return victim, (st.st_size, st.st_mtime_ns, st.st_ino)


def _untouched(victim, before):
    st = victim.stat()
    assert victim.read_bytes() == VICTIM_TEXT and (st.st_size, st.st_mtime_ns, st.st_ino) == before


# ---- the directory -----------------------------------------------------------------
def test_a_new_directory_and_its_files_are_private(tmp_path):
    directory = tmp_path / "a" / "kv"
    store = DiskBlockStore(str(directory), max_bytes=1 << 20)
    try:
        for key, data in _blocks(3).items():
            store.put(key, data)
        store.flush()
    finally:
        store.close()
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    names = os.listdir(directory)
    assert len([n for n in names if n.endswith(".kvb")]) == 3
    for name in names:
        assert stat.S_IMODE((directory / name).stat().st_mode) == 0o600, name


def test_an_unsafe_directory_is_refused(tmp_path):
    for mode in (0o770, 0o777, 0o722):
        d = tmp_path / f"open{mode:o}"
        d.mkdir()
        os.chmod(d, mode)
        with pytest.raises(PagedError, match="others may write"):
            DiskBlockStore(str(d), max_bytes=1 << 20)
        with pytest.raises(PagedError, match="others may write"):
            block_store.check_directory(str(d))
        assert os.listdir(d) == []   # refused before anything was written there
    # another account's directory, private to it, or reached through a symlink
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(theirs, 65534, 65534)
    else:
        theirs = "/"
    with pytest.raises(PagedError, match="belongs to uid"):
        DiskBlockStore(str(theirs), max_bytes=1 << 20)
    link = tmp_path / "link"
    link.symlink_to(theirs)
    with pytest.raises(PagedError, match="symbolic link"):
        DiskBlockStore(str(link), max_bytes=1 << 20)
    # ours, made by an older version (0755, its secret in it): made private, then used
    old = tmp_path / "old"
    DiskBlockStore(str(old), max_bytes=1 << 20).close()
    os.chmod(old, 0o755)
    DiskBlockStore(str(old), max_bytes=1 << 20).close()
    assert stat.S_IMODE(old.stat().st_mode) == 0o700


def test_group_sharing_is_an_explicit_opt_in(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o2770)
    with pytest.raises(PagedError, match="others may write"):
        DiskBlockStore(str(shared), max_bytes=1 << 20)
    store = DiskBlockStore(str(shared), max_bytes=1 << 20, group=True)
    try:
        key, data = next(iter(_blocks(1).items()))
        store.put(key, data)
        store.flush()
    finally:
        store.close()
    gid = shared.stat().st_gid
    for name in os.listdir(shared):   # the group reads (and, but for the secret, writes) them; others nothing
        st = (shared / name).stat()
        assert st.st_gid == gid and stat.S_IMODE(st.st_mode) & 0o007 == 0
        assert stat.S_IMODE(st.st_mode) & 0o040, name
    os.chmod(shared, 0o2777)
    with pytest.raises(PagedError, match="other accounts must have no access"):
        DiskBlockStore(str(shared), max_bytes=1 << 20, group=True)
    if os.geteuid() == 0:
        os.chmod(shared, 0o2770)
        os.chown(shared, -1, 65534)   # a group this account is not in
        if 65534 not in os.getgroups():
            with pytest.raises(PagedError, match="must be one of this account's groups"):
                DiskBlockStore(str(shared), max_bytes=1 << 20, group=True)


# ---- planted names -------------------------------------------------------------------
def test_planted_symlinks_never_redirect_a_write(tmp_path):
    """Symlinks at every name a write could use (entries' names; the temporary names the
    store used to derive from its pid and writer thread) pointing at a victim file: the
    writes land in the directory, the victim is untouched."""
    victim, before = _victim(tmp_path)
    directory = tmp_path / "kv"
    store = DiskBlockStore(str(directory), max_bytes=1 << 20)
    blocks = _blocks(8)
    try:
        writer = store._writer.ident
        for i, key in enumerate(blocks):
            if i % 2:   # the entry's own name
                (directory / _name(key)).symlink_to(victim)
                continue
            for ident in (writer, threading.get_ident()):
                (directory / f"{_name(key)}.{os.getpid()}.{ident}.tmp").symlink_to(victim)
        for key, data in blocks.items():
            store.put(key, data)
        store.flush()
        _untouched(victim, before)
        for key, data in blocks.items():
            assert (directory / _name(key)).is_file() and not (directory / _name(key)).is_symlink()
            assert np.array_equal(store.get(key, data.nbytes), data)
    finally:
        store.close()
    _untouched(victim, before)


def test_a_planted_symlink_or_fifo_is_never_read(tmp_path):
    """A symlink at an entry's name to a well-formed block file elsewhere (bytes someone
    wants served) is a miss, never followed; a FIFO there is a miss, not a hang."""
    key, data = next(iter(_blocks(1, seed=3).items()))
    elsewhere = DiskBlockStore(str(tmp_path / "elsewhere"), max_bytes=1 << 20)
    elsewhere.put(key, data)
    elsewhere.close()
    outside = tmp_path / "elsewhere" / _name(key)
    kept = outside.read_bytes()
    directory = tmp_path / "kv"
    store = DiskBlockStore(str(directory), max_bytes=1 << 20)
    try:
        (directory / _name(key)).symlink_to(outside)
        assert key not in store and store.get(key) is None
        assert outside.read_bytes() == kept and not (directory / _name(key)).exists()
        fifo_key = b"\x42" * 16
        os.mkfifo(directory / _name(fifo_key))
        result = []
        reader = threading.Thread(target=lambda: result.append(store.get(fifo_key)), daemon=True)
        reader.start()
        reader.join(20)
        if reader.is_alive():   # unblock the stuck open before failing
            os.close(os.open(directory / _name(fifo_key), os.O_WRONLY | os.O_NONBLOCK))
        assert result == [None]
    finally:
        store.close()


def test_planted_secret_or_lock_refuses_to_start(tmp_path):
    victim, before = _victim(tmp_path)
    for name in (block_store.SECRET_NAME, block_store.LOCK_NAME):
        directory = tmp_path / name.strip(".")
        directory.mkdir(mode=0o700)
        (directory / name).symlink_to(victim)
        with pytest.raises(PagedError, match="not a regular file.*remove"):
            DiskBlockStore(str(directory), max_bytes=1 << 20)
        _untouched(victim, before)


# ---- reads ---------------------------------------------------------------------------
_HUGE = """
import json, os, resource, sys, zlib
from pyllama_paged.engine.kv import block_store
from pyllama_paged.engine.kv.prefix_tiers import PrefixTierConfig, PrefixTiers

def rchar():
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])

directory, n = sys.argv[1], 512 << 20
tiers = PrefixTiers(PrefixTierConfig(disk_dir=directory), b"i" * 16, 16, 1, 4096)
key = tiers.keys(list(range(16)), 1)[0]
path = os.path.join(directory, key.hex() + ".kvb")
crc, zeros = 0, bytes(1 << 20)
for _ in range(n >> 20):
    crc = zlib.crc32(zeros, crc)
header = block_store._HEADER.pack(block_store._MAGIC, key, n, crc, 0)
header = header[:-4] + zlib.crc32(header[:-4]).to_bytes(4, "little")
with open(path, "wb") as f:   # well formed, but 512 MiB: sparse, nothing on disk
    f.write(header)
    f.truncate(len(header) + n)
del zeros
rss, read = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, rchar()
has, loaded = tiers.has(key), tiers.load(key)
print(json.dumps({"has": has, "loaded": loaded is not None, "read": rchar() - read,
                  "grew_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss}))
"""


def test_a_huge_planted_file_is_a_miss_and_is_not_read(tmp_path):
    """A well-formed entry of 512 MiB where a 4 KiB block is expected: a miss decided by its
    length, before a byte of it is read or mapped (in a fresh process, so that its peak
    memory and read counter say what the lookup cost)."""
    out = subprocess.run([sys.executable, "-c", _HUGE, str(tmp_path / "kv")], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert not got["has"] and not got["loaded"]
    assert got["read"] < 1 << 20 and got["grew_kib"] < 64 << 10, got


_TRUNCATED = """
import os, sys, threading
import numpy as np
from pyllama_paged.engine.kv.block_store import DiskBlockStore

directory = sys.argv[1]
store = DiskBlockStore(directory, max_bytes=1 << 30)
key = b"t" * 16
data = np.random.default_rng(0).integers(0, 256, 8 << 20, dtype=np.uint8)
store.put(key, data)
store.flush()
path = os.path.join(directory, key.hex() + ".kvb")
with open(path, "rb") as f:
    blob = f.read()
stop = False

def truncate_and_restore():
    # the same inode, cut short and filled again, over and over (a recreated file if a
    # reader removed it as damaged)
    while not stop:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.pwrite(fd, blob, 0)
        os.ftruncate(fd, 100)
        os.pwrite(fd, blob, 0)
        os.close(fd)

t = threading.Thread(target=truncate_and_restore, daemon=True)
t.start()
hits = misses = 0
for _ in range(300):
    got = store.get(key)
    if got is None:
        misses += 1
    else:
        assert np.array_equal(got, data)
        hits += 1
stop = True
t.join()
store.close()
print(hits, misses)
"""


def test_a_file_truncated_under_the_reader_is_a_miss_not_a_signal(tmp_path):
    out = subprocess.run([sys.executable, "-c", _TRUNCATED, str(tmp_path / "kv")], capture_output=True,
                         text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, (out.returncode, out.stderr)   # -7 would be SIGBUS
    hits, misses = map(int, out.stdout.split())
    assert hits + misses == 300


def test_a_short_read_is_a_miss(tmp_path):
    """The length was right when checked, the file is shorter when read: no bytes, no error."""
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10_000)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.fstat(fd).st_size == 10_000
        os.truncate(path, 5_000)
        assert block_store.read_exact(fd, 10_000, 0) is None
        assert block_store.read_exact(fd, 100, 4_950) is None
        assert bytes(block_store.read_exact(fd, 100, 4_800)) == b"x" * 100
    finally:
        os.close(fd)


def test_an_entry_of_the_wrong_length_is_counted_and_removed_when_looked_up(tmp_path):
    # the tiers ask has() before get(): a truncated entry must not just end the chain quietly
    # (a chain that starts at it would never read it, and it would stay forever)
    store = block_store.DiskBlockStore(str(tmp_path / "kv"), max_bytes=1 << 20)
    try:
        key, data = b"k" * 16, np.arange(4096, dtype=np.uint8)
        store.put(key, data)
        store.flush()
        assert store.has(key, data.nbytes)
        [name] = [f for f in os.listdir(tmp_path / "kv") if f.endswith(".kvb")]
        os.truncate(tmp_path / "kv" / name, 100)
        assert not store.has(key, data.nbytes)
        assert store.num_corrupt == 1 and not (tmp_path / "kv" / name).exists()
    finally:
        store.close()


# ---- keys --------------------------------------------------------------------------------
_KEYS = """
import sys
from pyllama_paged.engine.kv.prefix_tiers import PrefixTierConfig, PrefixTiers
tiers = PrefixTiers(PrefixTierConfig(disk_dir=sys.argv[1]), b"i" * 16, 16, 1, 4096)
print(tiers.keys(list(range(64)), 4)[-1].hex())
tiers.close()
"""


def test_file_names_are_keyed_by_the_directory_secret(tmp_path):
    """The same model and prompt give other file names in another directory, and names
    nobody computes from the model and the tokens alone; every process on one directory
    (and every restart) agrees on them."""
    tokens = list(range(64))

    def keys(directory):
        tiers = PrefixTiers(PrefixTierConfig(disk_dir=str(directory)), b"i" * 16, 16, 1, 4096)
        try:
            return tiers.keys(tokens, 4)
        finally:
            tiers.close()

    a, b = keys(tmp_path / "a"), keys(tmp_path / "b")
    public = chain_keys(b"i" * 16, tokens, 16, 4)
    assert not set(a) & set(b) and not set(a) & set(public)
    assert keys(tmp_path / "a") == a   # a restart
    out = subprocess.run([sys.executable, "-c", _KEYS, str(tmp_path / "a")], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == a[-1].hex()   # another process
    secret = tmp_path / "a" / block_store.SECRET_NAME
    assert secret.stat().st_size == 32 and stat.S_IMODE(secret.stat().st_mode) == 0o600


# ---- the bound -------------------------------------------------------------------------------
_BOUNDED_WRITER = """
import os, sys, time
import numpy as np
from pyllama_paged.engine.kv.block_store import DiskBlockStore
directory, me = sys.argv[1], int(sys.argv[2])
store = DiskBlockStore(directory, max_bytes=10 * 4096)
open(os.path.join(sys.argv[3], f"ready{me}"), "w").close()
while not os.path.exists(os.path.join(sys.argv[3], "go")):
    time.sleep(0.01)
for i in range(10):
    store.put(bytes([me, i]) * 8, np.full(4000, i, dtype=np.uint8))
store.close()
"""


def test_the_disk_bound_holds_for_every_process_sharing_the_directory(tmp_path):
    """Three processes, each bounded to ten blocks, all started before any writes: ten
    blocks' worth in the directory at the end, not thirty."""
    directory, flags = tmp_path / "kv", tmp_path / "flags"
    flags.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", _BOUNDED_WRITER, str(directory), str(i), str(flags)],
                              cwd=tmp_path) for i in range(3)]
    try:
        deadline = 120
        while len(os.listdir(flags)) < 3 and deadline > 0 and all(p.poll() is None for p in procs):
            threading.Event().wait(0.05)
            deadline -= 0.05
        (flags / "go").touch()
        assert [p.wait(120) for p in procs] == [0, 0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    sizes = [(directory / n).stat().st_size for n in os.listdir(directory) if n.endswith(".kvb")]
    assert sum(sizes) <= 10 * 4096 and len(sizes) >= 5
    reader = DiskBlockStore(str(directory), max_bytes=10 * 4096)   # the count they share agrees
    try:
        assert reader.num_bytes == sum(sizes)
    finally:
        reader.close()


# ---- reset -----------------------------------------------------------------------------------
# `model`: tests/engine/conftest.py's tiny Gemma 3


def test_reset_empties_the_ram_tier_and_keeps_the_disk(model, tmp_path):
    runner = ModelRunner(model, EngineConfig(paged=True, n_ctx=256, n_threads=1, n_batch=64, block_size=16,
                                             num_blocks=200))
    llm = LLMEngine(runner, {1}, SchedulerConfig(max_num_batched_tokens=64))
    tiers = llm.use_prefix_tiers(PrefixTierConfig(ram_bytes=64 << 20, disk_dir=str(tmp_path / "kv")))
    try:
        prompt = list(np.random.default_rng(0).integers(4, 300, size=100))
        llm.add_request([int(t) for t in prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        while llm.has_work():
            llm.step()
        tiers.flush()
        held = len(tiers.ram)
        files = sorted(n for n in os.listdir(tmp_path / "kv") if n.endswith(".kvb"))
        assert held >= 5 and len(files) == held
        done = llm.reset_prefix_cache()
        assert len(tiers.ram) == 0 and tiers.ram.num_bytes == 0
        assert done == {"pool": True, "ram_tier_blocks": held, "disk_tier_kept": str(tmp_path / "kv")}
        assert sorted(n for n in os.listdir(tmp_path / "kv") if n.endswith(".kvb")) == files
    finally:
        llm.close()
