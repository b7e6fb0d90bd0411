"""Pulls and the store tried as an attacker (or an unlucky operator) would (issue 39): names that
point into the internal network, redirects out of the registry's hosts, upstream error text, a
host that never answers or trickles, sizes past the disk, a full disk, planted partials and
links in the store, a store others can write, and manifests that name files outside it. The
registry is the local stand-in (pyllama_paged.testing.model_sources); every server is real."""

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from pyllama_paged.errors import DownloadError, RequestError
from pyllama_paged.models import egress
from pyllama_paged.models.download import StorageError, partial_path
from pyllama_paged.models.pull import pull
from pyllama_paged.models.refs import registry_base
from pyllama_paged.models.store import ModelStore
from pyllama_paged.models.store_files import UnsafeStoreError
from pyllama_paged.server.app import create_app
from pyllama_paged.testing.serving import Running, tiny_registry, wait_until

REPO = "someone/tiny-GGUF"


@pytest.fixture
def env(model_sources):
    return model_sources


@pytest.fixture
def gguf(tiny_gguf_bytes) -> bytes:
    return tiny_gguf_bytes


class Listener:
    """A TCP port on loopback that accepts and never answers (or, closed, refuses)."""

    def __init__(self, hang_up: bool = False):
        self.hang_up = hang_up
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)
            if self.hang_up:
                conn.close()

    def close(self):
        self.sock.close()
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def silent():
    listener = Listener()
    yield listener
    listener.close()


# ---- where a pull may connect -----------------------------------------------------------------
def test_a_name_with_another_host_is_refused_before_any_connection(env, silent, tmp_path):
    for name in (f"127.0.0.1:{silent.port}/x/y:z", "169.254.169.254/latest/meta-data:x", "evil.example/a/b"):
        with pytest.raises(RequestError, match="not allowed.*--pull-allow"):
            pull(name)
    assert silent.accepted == []
    registry = tiny_registry(tmp_path, name="base")
    server = Running(create_app(registry))
    try:
        r = httpx.post(server.url + "/api/pull", json={"model": f"127.0.0.1:{silent.port}/x/y:z"}, timeout=60)
        assert r.status_code == 400 and "not allowed" in r.json()["error"]
        assert silent.accepted == []
    finally:
        server.close()
        registry.close()


def test_an_allowed_name_on_a_private_address_is_refused_unless_named_explicitly(env, monkeypatch):
    # a blob host from the configured list (not named by the operator) that resolves to loopback
    with pytest.raises(RequestError, match="not public"):
        egress.checked_addresses("localhost", 443)
    monkeypatch.setenv(egress.PULL_ALLOW_ENV, "localhost")
    assert "127.0.0.1" in egress.checked_addresses("localhost", 443)
    for private in ("10.1.2.3", "192.168.0.1", "169.254.169.254", "::ffff:127.0.0.1", "fe80::1", "0.0.0.0"):
        monkeypatch.delenv(egress.PULL_ALLOW_ENV)
        with pytest.raises(RequestError, match="not public"):
            egress.checked_addresses(private, 443)
        monkeypatch.setenv(egress.PULL_ALLOW_ENV, "localhost")


def test_redirects_leave_neither_https_nor_the_blob_hosts(env, gguf, monkeypatch):
    digest = env.add_registry_model("tiny", "latest", gguf)
    port = env.url.rsplit(":", 1)[1]
    # plain http to another origin (the same port under another name): refused, never fetched
    env.sources.blob_location = f"http://localhost:{port}/cdn"
    with pytest.raises(DownloadError, match="redirected a download outside"):
        pull("tiny")
    # https to a host that is not a blob host: refused
    env.sources.blob_location = f"https://internal.example:{port}/cdn"
    with pytest.raises(DownloadError, match="redirected a download outside"):
        pull("tiny")
    # a configured blob host that resolves to loopback: refused after resolution
    monkeypatch.setenv(egress.BLOB_HOSTS_ENV, f"localhost:{port}")
    env.sources.blob_location = f"https://localhost:{port}/cdn"
    with pytest.raises(RequestError, match="not public"):
        pull("tiny")
    assert env.seen("GET", "/cdn/") == []
    assert not ModelStore().blob_path(digest).exists()
    env.sources.blob_location = None   # the registry's own origin, as configured: followed
    assert Path(pull("tiny").path).exists()


def test_errors_repeat_no_upstream_text_and_do_not_tell_ports_apart(env, gguf, silent, monkeypatch):
    with pytest.raises(DownloadError) as e:
        pull("nothing")
    assert "manifest unknown" not in str(e.value) and "HTTP 404" in str(e.value)
    env.add_hub_file(REPO, "tiny-Q4_K_M.gguf", gguf)
    with pytest.raises(DownloadError) as e:
        pull("hf.co/nobody/none")
    assert "Repository not found" not in str(e.value)
    # a closed port, a plain-HTTP port (the registry) and a port that closes at once: one message
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    plain = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)   # HTTP, not TLS
    threading.Thread(target=plain.serve_forever, daemon=True).start()
    http_port = plain.server_address[1]
    hangs_up = Listener(hang_up=True)
    monkeypatch.setenv(egress.PULL_ALLOW_ENV, f"127.0.0.1:{closed_port},127.0.0.1:{http_port},"
                                              f"127.0.0.1:{hangs_up.port},127.0.0.1:{silent.port}")
    monkeypatch.setenv("PYLLAMA_PAGED_PLAN_DEADLINE_S", "3")
    messages = set()
    for port in (closed_port, http_port, hangs_up.port, silent.port):
        with pytest.raises(DownloadError) as e:
            pull(f"127.0.0.1:{port}/library/x:y")
        messages.add(str(e.value).replace(str(port), "PORT"))
    hangs_up.close()
    plain.shutdown()
    plain.server_close()
    assert len(messages) == 1 and "cannot reach 127.0.0.1" in messages.pop(), messages


# ---- threads, caps and deadlines ---------------------------------------------------------------
def test_pulls_to_a_silent_host_hold_no_listing_and_are_capped(env, silent, tmp_path, monkeypatch):
    monkeypatch.setenv(egress.PULL_ALLOW_ENV, f"127.0.0.1:{silent.port}")
    monkeypatch.setenv("PYLLAMA_PAGED_MAX_PULLS", "3")
    monkeypatch.setenv("PYLLAMA_PAGED_PLAN_DEADLINE_S", "40")
    registry = tiny_registry(tmp_path, name="base")
    server = Running(create_app(registry))
    answers: list[int] = []

    def hanging_pull(i):
        try:
            r = httpx.post(server.url + "/api/pull", json={"model": f"127.0.0.1:{silent.port}/x/m{i}:t",
                                                           "stream": False}, timeout=90)
            answers.append(r.status_code)
        except httpx.HTTPError:
            answers.append(-1)

    threads = [threading.Thread(target=hanging_pull, args=(i,), daemon=True) for i in range(3)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: len(silent.accepted) >= 3, timeout=30, what="three pulls connected")
        extra = [httpx.post(server.url + "/api/pull", json={"model": f"127.0.0.1:{silent.port}/x/e{i}:t"},
                            timeout=30) for i in range(8)]
        assert all(r.status_code == 503 and "pulls are in progress" in r.json()["error"] for r in extra)
        for path in ("/api/tags", "/v1/models", "/api/ps", "/api/version"):
            started = time.monotonic()
            assert httpx.get(server.url + path, timeout=30).status_code == 200
            assert time.monotonic() - started < 10, path   # generous: a listing waits on no pull
        assert answers == []   # the three still hang on the silent host
    finally:
        silent.close()   # the handshakes end: the pulls fail and give their places back
        for t in threads:
            t.join(60)
        server.close()
        registry.close()
    assert sorted(answers) == [502, 502, 502]


def test_a_trickling_host_is_cut_off_by_the_blob_deadline(env, gguf, monkeypatch):
    digest = env.add_registry_model("tiny", "latest", gguf)
    env.trickle(digest, 0.05)
    monkeypatch.setenv("PYLLAMA_PAGED_BLOB_DEADLINE_S", "2")
    monkeypatch.setenv("PYLLAMA_PAGED_PULL_MIN_RATE", str(10**12))   # the size adds nothing
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(_raised(lambda: pull("tiny"))), daemon=True)
    worker.start()
    worker.join(45)
    assert not worker.is_alive(), "the trickling download was never cut off"
    assert isinstance(outcome[0], DownloadError) and "deadline" in str(outcome[0])
    blob = ModelStore().blob_path(digest)
    assert not blob.exists() and 0 < partial_path(blob, registry_base()).stat().st_size < len(gguf)


def _raised(fn):
    try:
        fn()
    except Exception as e:   # the test inspects it
        return e
    return None


# ---- sizes and the disk ------------------------------------------------------------------------
def test_a_declared_size_past_the_cap_or_the_free_space_is_refused_before_downloading(env, gguf, tmp_path,
                                                                                        monkeypatch):
    env.add_registry_model("huge", "latest", gguf, declared_size=10**13)
    with pytest.raises(StorageError, match="more than the .* a layer may have"):
        pull("huge")
    free = __import__("shutil").disk_usage(tmp_path).free
    monkeypatch.setenv("PYLLAMA_PAGED_MAX_BLOB_BYTES", str(10**15))
    env.add_registry_model("big", "latest", gguf, declared_size=free + (1 << 30))
    with pytest.raises(StorageError, match="free"):
        pull("big")
    assert env.seen("GET", "/blobs/") == [] and env.seen("GET", "/cdn/") == []
    monkeypatch.delenv("PYLLAMA_PAGED_MAX_BLOB_BYTES")
    registry = tiny_registry(tmp_path, name="base")
    server = Running(create_app(registry))
    try:
        r = httpx.post(server.url + "/api/pull", json={"model": "huge"}, timeout=60)
        assert r.status_code == 507 and "a layer may have" in r.json()["error"]
    finally:
        server.close()
        registry.close()


def test_a_full_disk_is_not_retried(env, gguf, tmp_path):
    digest = env.add_registry_model("tiny", "latest", gguf)
    script = textwrap.dedent("""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000))   # writes past it fail (EFBIG)
        from pyllama_paged.models.pull import pull
        from pyllama_paged.models.download import StorageError
        try:
            pull("tiny")
        except StorageError as e:
            print("storage:", e)
            sys.exit(3)
    """)
    # cwd away from the checkout: `python -c` puts the cwd first on sys.path, and the source
    # tree has no compiled library (the installed package has)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ), cwd=tmp_path)
    assert p.returncode == 3, p.stdout + p.stderr
    assert "free some space" in p.stdout
    assert len(env.seen("GET", "/cdn/")) == 1   # no retry of what no retry can mend
    assert not ModelStore().blob_path(digest).exists()


# ---- partials and locks ------------------------------------------------------------------------
def test_partials_are_keyed_by_source_and_a_bad_one_is_fetched_again_once(env, gguf):
    digest = env.add_registry_model("tiny", "latest", gguf)
    blob = ModelStore().blob_path(digest)
    blob.parent.mkdir(parents=True, mode=0o700)
    os.chmod(blob.parent.parent, 0o700)
    junk = os.urandom(200_000)
    other = partial_path(blob, "https://elsewhere.example")
    other.write_bytes(junk)                                       # another registry's partial: unused
    partial_path(blob, registry_base()).write_bytes(junk)        # this registry's, wrong bytes
    stored = pull("tiny")
    ranges = [s.range for s in env.seen("GET", "/cdn/")]
    assert ranges == ["bytes=200000-", None]   # resumed, found wrong, fetched whole once
    assert hashlib.sha256(Path(stored.path).read_bytes()).hexdigest() == digest[7:]
    assert other.read_bytes() == junk


def test_stale_partials_and_locks_go_and_held_or_fresh_ones_stay(env, gguf):
    import fcntl

    store = ModelStore()
    store.prepare()
    blobs = store.root / "blobs"
    old = time.time() - 3 * 86400
    stale_partial, stale_lock = blobs / ("sha256-" + "a" * 64 + ".k.partial"), blobs / ("sha256-" + "b" * 64 + ".lock")
    held_partial, fresh_partial = blobs / ("sha256-" + "c" * 64 + ".k.partial"), blobs / ("sha256-" + "d" * 64 + ".k.partial")
    for f in (stale_partial, stale_lock, held_partial, fresh_partial):
        f.write_bytes(b"x" * 100)
    for f in (stale_partial, stale_lock, held_partial):
        os.utime(f, (old, old))
    holder = os.open(blobs / ("sha256-" + "c" * 64 + ".lock"), os.O_RDONLY | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)   # a pull in progress in another process
    try:
        env.add_registry_model("tiny", "latest", gguf)
        pull("tiny")
    finally:
        os.close(holder)
    assert not stale_partial.exists() and not stale_lock.exists()
    assert held_partial.exists() and fresh_partial.exists()


# ---- the store's files ---------------------------------------------------------------------------
def test_links_planted_in_the_store_write_nothing_through(env, gguf, tmp_path):
    digest = env.add_registry_model("tiny", "latest", gguf, template="{{ .Prompt }}")
    store = ModelStore()
    blob = store.blob_path(digest)
    blob.parent.mkdir(parents=True, mode=0o700)
    os.chmod(store.root, 0o700)
    victims = {name: tmp_path / name for name in ("v-partial", "v-lock", "v-blob", "v-legacy")}
    for victim in victims.values():
        victim.write_bytes(b"precious")
    partial_path(blob, registry_base()).symlink_to(victims["v-partial"])
    blob.with_name(blob.name + ".lock").symlink_to(victims["v-lock"])
    blob.with_name(blob.name + ".partial").symlink_to(victims["v-legacy"])
    template = store.blob_path("sha256:" + hashlib.sha256(b"{{ .Prompt }}").hexdigest())
    template.symlink_to(victims["v-blob"])   # a "complete blob" that is a link
    stored = pull("tiny")
    assert all(v.read_bytes() == b"precious" for v in victims.values())
    assert hashlib.sha256(Path(stored.path).read_bytes()).hexdigest() == digest[7:]
    assert not Path(stored.files["template"]).is_symlink()
    assert Path(stored.files["template"]).read_text() == "{{ .Prompt }}"
    # what the store made is the account's own
    assert os.stat(store.root / "blobs").st_mode & 0o777 == 0o700
    assert os.stat(store.root / "manifests").st_mode & 0o777 == 0o700
    assert os.stat(stored.path).st_mode & 0o777 == 0o600
    assert os.stat(stored.manifest).st_mode & 0o777 == 0o600


def test_a_store_others_can_write_is_refused_unless_shared_on_purpose(env, gguf, monkeypatch):
    env.add_registry_model("tiny", "latest", gguf)
    root = ModelStore().root
    root.mkdir(mode=0o700)
    os.chmod(root, 0o777)
    with pytest.raises(UnsafeStoreError, match="writable by group or other"):
        pull("tiny")
    os.chmod(root, 0o700)
    os.chown(root, 54321, -1)   # another account's folder (the tests run as root, or skip)
    if os.stat(root).st_uid == os.geteuid():
        pytest.skip("cannot give a folder to another account here")
    with pytest.raises(UnsafeStoreError, match="belongs to another user"):
        pull("tiny")
    assert env.seen("GET", "/cdn/") == []
    # a group store set up on purpose: group-writable (setgid), not other-writable
    os.chown(root, 54321, os.getegid())
    os.chmod(root, 0o2770)
    monkeypatch.setenv("PYLLAMA_PAGED_SHARED_STORE", "1")
    assert Path(pull("tiny").path).exists()
    os.chmod(root, 0o2777)
    with pytest.raises(UnsafeStoreError, match="every account"):
        pull("tiny")


# ---- delete ----------------------------------------------------------------------------------------
def _rewrite_manifest(stored, model_path: str, files: dict[str, str]) -> None:
    record = json.loads(stored.manifest.read_text())
    record["model"]["path"] = model_path
    record["files"] = {role: {"path": p, "digest": "sha256:" + "0" * 64, "size": 1} for role, p in files.items()}
    stored.manifest.write_text(json.dumps(record))


def test_delete_removes_nothing_outside_the_store(env, gguf, tmp_path):
    env.add_registry_model("tiny", "latest", gguf)
    store = ModelStore()
    stored = pull("tiny")
    outside, absolute = store.root.parent / "victim", tmp_path / "abs-victim"
    for victim in (outside, absolute):
        victim.write_bytes(b"precious")
    _rewrite_manifest(stored, "../victim", {"template": str(absolute), "params": "blobs/../../victim"})
    registry = tiny_registry(tmp_path, name="base")
    server = Running(create_app(registry))
    try:
        r = httpx.request("DELETE", server.url + "/api/delete", json={"model": "tiny"}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        server.close()
        registry.close()
    assert outside.read_bytes() == b"precious" and absolute.read_bytes() == b"precious"
    assert store.find_name("tiny") is None


def test_delete_of_a_hub_model_keeps_a_cached_file_and_a_served_one(env, gguf, tmp_path):
    from huggingface_hub import hf_hub_download

    from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model

    other = Path(write_tiny_model(tmp_path / "other.gguf", "gemma3", seed=1)).read_bytes()
    env.add_hub_file(REPO, "tiny-Q4_K_M.gguf", gguf)
    env.add_hub_file(REPO, "tiny-Q8_0.gguf", other)
    # another tool put the Q4_K_M file in Hugging Face's cache before any pull
    theirs = hf_hub_download(REPO, "tiny-Q4_K_M.gguf", endpoint=env.url, cache_dir=str(tmp_path / "hf" / "hub"))
    store = ModelStore()
    stored = pull("hf.co/someone/tiny-GGUF")
    assert os.path.realpath(stored.path) == os.path.realpath(theirs) and not stored.owned
    store.delete(stored)
    assert Path(theirs).exists()
    # a file this store downloaded, but served by the server: kept while served
    mine = pull("hf.co/someone/tiny-GGUF:Q8_0")
    assert mine.owned
    from pyllama_paged.server.config import ServeConfig
    from pyllama_paged.server.registry import ModelRegistry

    serving = ModelRegistry([mine.path], ServeConfig.flat(n_ctx=256, n_threads=2, kv_budget_tokens=1024))
    server = Running(create_app(serving))
    try:
        r = httpx.request("DELETE", server.url + "/api/delete", json={"model": "hf.co/someone/tiny-GGUF:Q8_0"},
                          timeout=60)
        assert r.status_code == 200, r.text
        assert Path(mine.path).exists() and store.find_name("hf.co/someone/tiny-GGUF:Q8_0") is None
    finally:
        server.close()
        serving.close()


# ---- lookups -------------------------------------------------------------------------------------------
def test_an_unknown_name_reads_no_manifest(env, gguf):
    env.add_registry_model("tiny", "latest", gguf)
    pull("tiny")
    store = ModelStore()
    assert store.find_name("TINY").name == "tiny:latest"   # names compare without case
    reads = []
    real_read = type(store)._read
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(store), "_read", lambda self, m: reads.append(m) or real_read(self, m))
        patch.setattr(Path, "glob", lambda *a, **k: pytest.fail("a lookup walked the manifests"))
        for _ in range(3):
            assert store.find_name("nothing-like-it") is None
    assert reads == []
    # a manifest written by another process is found (the index is shared on disk)
    env.add_registry_model("other", "v1", gguf)
    pull("other:v1", store=ModelStore())
    assert store.find_name("OTHER:V1") is not None


def test_the_listing_names_files_safely(env, gguf):
    """A manifest index entry that climbs out of manifests/ is not followed."""
    env.add_registry_model("tiny", "latest", gguf)
    pull("tiny")
    store = ModelStore()
    index = store.root / "manifests" / "index.json"
    entries = json.loads(index.read_text())
    entries["evil/library/x:latest"] = "../../../../etc/passwd"
    index.write_text(json.dumps(entries))
    assert store.find_name("evil/library/x") is None
    assert re.search("tiny", json.dumps([m.name for m in store.list()]))
