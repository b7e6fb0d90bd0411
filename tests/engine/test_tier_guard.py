"""The disk prefix tier's directory after issue 54: `--prefix-cache-dir` given a symbolic link,
or a typo such as `~` (a directory others may read, not made by us), used to be chmod-ed to
0700 (its target locking others out); a disk with little room left was filled to the last
byte. Real directories, the real store, and `serve` itself."""

import os
import shutil
import stat
import subprocess
import sys

import numpy as np
import pytest

from pyllama_paged.engine.kv import block_store
from pyllama_paged.engine.kv.block_store import DiskBlockStore
from pyllama_paged.engine.kv.prefix_tiers import PrefixTierConfig, PrefixTiers
from pyllama_paged.errors import PagedError


def _blocks(n, size=4000):
    rng = np.random.default_rng(0)
    return {bytes([7, i]) * 8: rng.integers(0, 256, size, dtype=np.uint8) for i in range(n)}


def _home_like(tmp_path):
    """A directory of ours that others may read and enter, with someone's files in it."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    os.chmod(home, 0o755)
    return home


def test_a_symbolic_link_is_refused_and_its_target_left_as_it_was(tmp_path):
    home = _home_like(tmp_path)
    link = tmp_path / "kv-link"
    link.symlink_to(home)
    for open_it in (lambda: DiskBlockStore(str(link), max_bytes=1 << 20), lambda: block_store.check_directory(str(link))):
        with pytest.raises(PagedError, match="symbolic link"):
            open_it()
    assert stat.S_IMODE(home.stat().st_mode) == 0o755 and os.listdir(home) == ["notes.txt"]


def test_a_directory_we_did_not_make_is_refused_not_locked(tmp_path):
    home = _home_like(tmp_path)
    with pytest.raises(PagedError, match="others may read it .* not a prefix cache directory pyllama-paged made"):
        DiskBlockStore(str(home), max_bytes=1 << 20)
    assert stat.S_IMODE(home.stat().st_mode) == 0o755 and os.listdir(home) == ["notes.txt"]


def test_serve_refuses_a_linked_or_foreign_directory_before_loading_a_model(tmp_path):
    home = _home_like(tmp_path)
    link = tmp_path / "kv-link"
    link.symlink_to(home)
    for given, why in ((link, "symbolic link"), (home, "not a prefix cache directory")):
        p = subprocess.run([sys.executable, "-m", "pyllama_paged.cli", "serve", "--prefix-cache-dir", str(given),
                            "--port", "1"], capture_output=True, text=True, timeout=300, cwd="/")
        assert p.returncode != 0 and "--prefix-cache-dir" in p.stderr and why in p.stderr, p.stderr[-2000:]
    assert stat.S_IMODE(home.stat().st_mode) == 0o755 and os.listdir(home) == ["notes.txt"]


def test_no_block_is_written_while_the_disk_is_below_its_reserve(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    full = DiskBlockStore(str(tmp_path / "full"), max_bytes=1 << 30, reserve_bytes=free + (1 << 40))
    roomy = DiskBlockStore(str(tmp_path / "roomy"), max_bytes=1 << 30, reserve_bytes=0)
    try:
        for store in (full, roomy):
            for key, data in _blocks(5).items():
                store.put(key, data)
            store.flush()
        assert full.num_skipped == 5 and full.num_written == 0
        assert not [n for n in os.listdir(tmp_path / "full") if n.endswith(".kvb")]
        assert roomy.num_skipped == 0 and roomy.num_written == 5
    finally:
        full.close()
        roomy.close()


def test_the_tiers_count_saves_skipped_for_the_reserve(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    config = PrefixTierConfig(disk_dir=str(tmp_path / "kv"), disk_reserve_bytes=free + (1 << 40))
    tiers = PrefixTiers(config, identity=b"i" * 16, block_size=32, n_groups=1, block_bytes=4000)
    try:
        for key, data in _blocks(3).items():
            tiers.save(key, data)
        tiers.flush()
        stats = tiers.stats()
        assert stats["tier_saved_blocks"] == 3 and stats["tier_disk_skipped_writes"] == 3
        assert stats["tier_disk_bytes"] == 0
    finally:
        tiers.close()
