"""Model downloads (issue 27): `pyllama-paged pull`, /api/pull, the store and the server's
use of it, against a local stand-in for the Hugging Face Hub and an Ollama registry
(pyllama_paged.testing.model_sources). The download code under test is the real one:
huggingface_hub for the Hub, our Range-resuming client for the registry."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pyllama_paged.errors import DownloadError, IntegrityError, ModelNotFoundError, RequestError
from pyllama_paged.models.download import partial_path
from pyllama_paged.models.hub import choose_quant
from pyllama_paged.models.pull import pull
from pyllama_paged.models.refs import parse_reference, registry_base
from pyllama_paged.models.store import ModelStore
from pyllama_paged.server.app import create_app
from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
from pyllama_paged.testing.serving import Running, free_port, stop_server, tiny_registry, wait_healthy

CLI = [sys.executable, "-m", "pyllama_paged.cli"]
REPO = "someone/tiny-GGUF"


@pytest.fixture
def gguf(tiny_gguf_bytes) -> bytes:
    return tiny_gguf_bytes


@pytest.fixture
def env(model_sources):
    """HOME, Hugging Face's cache and the store in tmp_path; the Hub and the registry local."""
    return model_sources


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


# ---- references and the choice of a Hub file -----------------------------------------
def test_references(env):
    host = env.url.split("//")[1]
    r = parse_reference("tiny")
    assert (r.source, r.host, r.namespace, r.name, r.tag) == ("ollama", host, "library", "tiny", "latest")
    assert r.display() == "tiny:latest"
    assert parse_reference("someone/tiny:1b").display() == "someone/tiny:1b"
    assert parse_reference("other.example:5000/a/b").display() == "other.example:5000/a/b:latest"
    r = parse_reference("https://huggingface.co/someone/tiny-GGUF:q8_0")
    assert (r.source, r.repo_id, r.tag) == ("hf", REPO, "q8_0") and r.display() == "hf.co/someone/tiny-GGUF:q8_0"
    assert parse_reference(REPO, "*Q8_0.gguf").pattern == "*Q8_0.gguf"
    for bad, why in (("", "required"), ("a/b/c/d", "HOST"), ("../x", "'..'"), ("x:", "tag ''"),
                     ("hf.co/someone", "hf.co/USER/REPO"), ("x@sha256:00", "digest"),
                     ("http://example.com/a", "PYLLAMA_PAGED_REGISTRY")):
        with pytest.raises(RequestError, match=why):
            parse_reference(bad)
    with pytest.raises(RequestError, match="either :QUANT or a file pattern"):
        parse_reference("hf.co/someone/tiny-GGUF:Q8_0", "*.gguf")


def test_choosing_the_quant():
    files = ["README.md", "m-Q4_K_M.gguf", "m-Q6_K.gguf", "m-Q6_K_L.gguf", "m-Q4_K_S.gguf", "mmproj-m-f16.gguf"]
    assert choose_quant(files, None, REPO) == ["m-Q4_K_M.gguf"]       # the default
    assert choose_quant(files, "q6_k", REPO) == ["m-Q6_K.gguf"]       # the whole quant, not Q6_K_L's prefix
    with pytest.raises(RequestError, match="several files .*m-Q4_K_M.gguf, m-Q4_K_S.gguf"):
        choose_quant(files, "Q4_K", REPO)
    with pytest.raises(ModelNotFoundError, match="no .gguf of .* has 'IQ2_XS'.*m-Q6_K.gguf"):
        choose_quant(files, "IQ2_XS", REPO)
    assert choose_quant(["only-F16.gguf", "mmproj-f16.gguf"], None, REPO) == ["only-F16.gguf"]
    split = ["big-Q8_0-00002-of-00002.gguf", "big-Q8_0-00001-of-00002.gguf"]
    assert choose_quant(split, "Q8_0", REPO) == sorted(split)   # a split's parts, in order
    with pytest.raises(ModelNotFoundError, match="has 3 parts, but big-Q8_0-00002-of-00003.gguf is not"):
        choose_quant(["big-Q8_0-00001-of-00003.gguf", "big-Q8_0-00003-of-00003.gguf"], "Q8_0", REPO)
    with pytest.raises(ModelNotFoundError, match="no .gguf file"):
        choose_quant(["README.md"], None, REPO)


# ---- pulls ----------------------------------------------------------------------------
def test_cli_pull_then_serve_answers_generate(env, gguf, tmp_path):
    env.add_registry_model("tiny", "latest", gguf, template="{{ .Prompt }}", params={"temperature": 0.7})
    env.add_hub_file(REPO, "tiny-Q8_0.gguf", gguf)
    env.add_hub_file(REPO, "tiny-Q4_K_M.gguf", gguf)
    run_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for ref in ("tiny", "hf.co/someone/tiny-GGUF:Q8_0"):
        p = subprocess.run(CLI + ["pull", ref], capture_output=True, text=True, timeout=300, env=run_env, cwd="/")
        assert p.returncode == 0, p.stderr
        assert "success" in p.stderr and "pulled" in p.stderr
    store = ModelStore()
    assert sorted(m.name for m in store.list()) == ["hf.co/someone/tiny-GGUF:Q8_0", "tiny:latest"]
    stored = store.find(parse_reference("tiny"))
    assert set(stored.files) == {"template", "params"} and Path(stored.files["template"]).read_text() == "{{ .Prompt }}"
    assert hashlib.sha256(Path(stored.path).read_bytes()).hexdigest() == hashlib.sha256(gguf).hexdigest()
    hub = store.find(parse_reference("hf.co/someone/tiny-GGUF:q8_0"))
    assert "models--someone--tiny-GGUF/snapshots/" in hub.path and hub.path.endswith("tiny-Q8_0.gguf")

    base = write_tiny_model(tmp_path / "base.gguf", "gemma3")   # a quick start: the store's models load on use
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(CLI + ["serve", "--model", base, "--port", str(port), "--threads", "2", "--ctx", "256",
                                       "--kv-budget", "1024"], stdout=out, stderr=subprocess.STDOUT, env=run_env,
                                cwd="/")
    try:
        wait_healthy(url, proc, "/api/tags", timeout=120, log=log)
        names = {m["name"] for m in httpx.get(url + "/api/tags").json()["models"]}
        assert names == {"base", "tiny:latest", "hf.co/someone/tiny-gguf:q8_0"}
        for model in ("tiny", "hf.co/someone/tiny-GGUF:Q8_0"):
            r = httpx.post(url + "/api/generate", json={"model": model, "prompt": "hi", "stream": False,
                                                        "options": {"num_predict": 3}}, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["done"] and r.json()["eval_count"] == 3
        assert len(httpx.get(url + "/api/tags").json()["models"]) == 3   # loaded ones are listed once
        assert httpx.request("DELETE", url + "/api/delete", json={"model": "tiny"}).status_code == 200
        assert not Path(stored.path).exists() and not stored.manifest.exists()
        assert not any(Path(f).exists() for f in stored.files.values())
        r = httpx.post(url + "/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False})
        assert r.status_code == 404
        assert httpx.request("DELETE", url + "/api/delete", json={"model": "tiny"}).status_code == 404
    finally:
        stop_server(proc)
    p = subprocess.run(CLI + ["pull", "nothing-here:7b"], capture_output=True, text=True, timeout=120, env=run_env,
                       cwd="/")
    assert p.returncode == 1 and "not found" in p.stderr and "HTTP 404" in p.stderr


def test_a_dropped_connection_is_resumed_in_the_same_pull(env, gguf):
    digest = env.add_registry_model("tiny", "latest", gguf)
    env.cut(digest, 500_000)
    stored = pull("tiny")
    ranged = [s.range for s in env.seen("GET", "/cdn/") if s.range]
    assert ranged == ["bytes=500000-"]
    assert hashlib.sha256(Path(stored.path).read_bytes()).hexdigest() == digest.split(":")[1]


def test_an_interrupted_pull_resumes_where_it_stopped(env, gguf):
    digest = env.add_registry_model("tiny", "latest", gguf)
    env.cut(digest, 1_000_000, 0, 0, 0, 0)   # bytes, then nothing: the pull gives up
    with pytest.raises(DownloadError, match="pull again to resume from byte 1000000"):
        pull("tiny")
    store = ModelStore()
    blob = store.blob_path(digest)
    partial = partial_path(blob, registry_base())
    assert not blob.exists() and partial.stat().st_size == 1_000_000   # never looks complete
    assert store.list() == [] and store.find(parse_reference("tiny")) is None
    before = len(env.seen("GET", "/cdn/"))
    stored = pull("tiny")
    assert [s.range for s in env.seen("GET", "/cdn/")[before:]] == ["bytes=1000000-"]
    assert not partial.exists() and hashlib.sha256(blob.read_bytes()).hexdigest() == digest.split(":")[1]
    assert stored.path == str(blob) and [m.name for m in store.list()] == ["tiny:latest"]
    # a blob already there is not fetched again
    before = len(env.seen("GET", "/cdn/"))
    pull("tiny")
    assert len(env.seen("GET", "/cdn/")) == before


def test_a_wrong_sha256_is_rejected_and_leaves_nothing(env, gguf, tmp_path):
    env.add_registry_model("tiny", "latest", gguf, wrong_digest=True)
    with pytest.raises(IntegrityError, match="sha256"):
        pull("tiny")
    store_root = tmp_path / "store"
    assert [f for f in _files(store_root) if not f.endswith((".lock", "index.json"))] == []
    env.add_hub_file(REPO, "tiny-Q4_K_M.gguf", gguf, published_sha=hashlib.sha256(b"other").hexdigest())
    with pytest.raises(IntegrityError, match="the Hub publishes"):
        pull("hf.co/someone/tiny-GGUF")
    hf_files = _files(tmp_path / "hf" / "hub")
    assert not any("blobs/" in f or "snapshots/" in f for f in hf_files), hf_files
    assert ModelStore().list() == []


def test_unknown_models_are_not_found(env, gguf):
    env.add_hub_file(REPO, "tiny-Q4_K_M.gguf", gguf)
    with pytest.raises(ModelNotFoundError, match="model nothing:latest not found .*HTTP 404\\)$"):
        pull("nothing")
    with pytest.raises(ModelNotFoundError, match="repository nobody/none not found"):
        pull("hf.co/nobody/none")
    with pytest.raises(ModelNotFoundError, match="has 'IQ1_S'.*tiny-Q4_K_M.gguf"):
        pull("hf.co/someone/tiny-GGUF:IQ1_S")
    with pytest.raises(ModelNotFoundError, match="no file of someone/tiny-GGUF matches"):
        pull(REPO, "*Q8_0.gguf")
    assert ModelStore().list() == []


# ---- /api/pull and the store in the server -------------------------------------------------
def _lines(response) -> list[dict]:
    return [json.loads(line) for line in response.iter_lines() if line]


def test_api_pull_streams_statuses_with_byte_counts(env, gguf, tmp_path):
    digest = env.add_registry_model("tiny", "latest", gguf, template="{{ .Prompt }}")
    env.add_hub_file(REPO, "tiny-Q4_K_M.gguf", gguf)
    registry = tiny_registry(tmp_path, name="base")
    server = Running(create_app(registry))
    try:
        with httpx.stream("POST", server.url + "/api/pull", json={"model": "tiny"}, timeout=120) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
            events = _lines(r)
        statuses = [e["status"] for e in events]
        assert statuses[0] == "pulling manifest" and statuses[-3:] == ["verifying sha256 digest", "writing manifest",
                                                                        "success"]
        model = [e for e in events if e.get("digest") == digest]
        assert model[0]["status"] == f"pulling {digest[7:19]}" and all(e["total"] == len(gguf) for e in model)
        completed = [e["completed"] for e in model]
        assert completed == sorted(completed) and completed[-1] == len(gguf)
        assert len({e["digest"] for e in events if "digest" in e}) == 2   # the GGUF and the template

        r = httpx.post(server.url + "/api/pull", json={"model": "hf.co/someone/tiny-GGUF", "stream": False},
                       timeout=120)
        assert r.status_code == 200 and r.json() == {"status": "success"}
        tags = {m["name"]: m for m in httpx.get(server.url + "/api/tags").json()["models"]}
        assert set(tags) == {"base", "tiny:latest", "hf.co/someone/tiny-gguf:latest"}
        assert tags["tiny:latest"]["size"] == len(gguf) and tags["tiny:latest"]["digest"] == digest[7:]
        assert tags["tiny:latest"]["details"]["family"] == "gemma3"
        assert tags["tiny:latest"]["details"]["quantization_level"] == "Q8_0"
        assert "tiny:latest" in {m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]}

        r = httpx.post(server.url + "/api/generate", json={"model": "tiny:latest", "prompt": "hi", "stream": False,
                                                           "options": {"num_predict": 2}}, timeout=120)
        assert r.status_code == 200 and r.json()["eval_count"] == 2
        # pulling a loaded store model again asks the registry again, and fetches nothing new
        before = len(env.seen("GET", "/cdn/"))
        assert _lines(httpx.post(server.url + "/api/pull", json={"model": "tiny"}, timeout=120))[-1] == \
            {"status": "success"}
        assert len(env.seen("GET", "/cdn/")) == before

        # errors before the stream starts carry their status
        env.add_hub_file("someone/two-GGUF", "two-Q4_K_M.gguf", gguf)
        env.add_hub_file("someone/two-GGUF", "two-Q4_K_S.gguf", gguf)
        for body, status, text in (({"model": "nothing"}, 404, "not found"),
                                   ({"model": "nothing", "stream": False}, 404, "not found"),
                                   ({"model": "hf.co/nobody/none"}, 404, "not found"),
                                   ({"model": "a/b/c/d"}, 400, "HOST"),
                                   ({"model": "hf.co/someone/two-GGUF:Q4_K"}, 400, "several files"),
                                   ({"model": ""}, 400, "required")):
            r = httpx.post(server.url + "/api/pull", json=body, timeout=120)
            assert r.status_code == status and text in r.json()["error"], (body, r.text)
        env.add_registry_model("broken", "latest", gguf, wrong_digest=True)
        r = httpx.post(server.url + "/api/pull", json={"model": "broken", "stream": False}, timeout=120)
        assert r.status_code == 502 and "sha256" in r.json()["error"]
        streamed = _lines(httpx.post(server.url + "/api/pull", json={"model": "broken"}, timeout=120))
        assert "sha256" in streamed[-1]["error"] and "success" not in [e.get("status") for e in streamed]

        assert httpx.request("DELETE", server.url + "/api/delete", json={"model": "hf.co/someone/tiny-GGUF"}
                             ).status_code == 200
        assert httpx.request("DELETE", server.url + "/api/delete", json={"model": "tiny"}).status_code == 200
        assert {m["name"] for m in httpx.get(server.url + "/api/tags").json()["models"]} == {"base"}
        assert httpx.post(server.url + "/api/generate", json={"model": "tiny", "prompt": "hi"}).status_code == 404
        assert [f for f in _files(tmp_path / "store") if not f.endswith((".lock", "index.json"))] == []
        assert not any("blobs/" in f for f in _files(tmp_path / "hf" / "hub"))
        assert httpx.request("DELETE", server.url + "/api/delete", json={"model": "base"}).status_code == 400
    finally:
        server.close()
        registry.close()


def test_a_client_that_hangs_up_stops_the_pull_and_the_next_resumes(env, gguf, tmp_path):
    from pyllama_paged.server.ollama import pull as ollama_pull
    from pyllama_paged.testing.serving import wait_until

    digest = env.add_registry_model("tiny", "latest", gguf)
    go_on = env.stall(digest, 1_500_000)
    registry = tiny_registry(tmp_path, name="base")
    server = Running(create_app(registry))
    try:
        with httpx.stream("POST", server.url + "/api/pull", json={"model": "tiny"}, timeout=120) as r:
            for line in r.iter_lines():
                if line and "digest" in json.loads(line):
                    break   # hang up once the blob's download has started
        wait_until(lambda: all(stop.is_set() for stop in ollama_pull.IN_FLIGHT.values()), what="the hang-up seen")
        go_on.set()   # the registry sends on; the download notices it was stopped at its next chunk
        wait_until(lambda: not ollama_pull.IN_FLIGHT, what="the download stopping")
        blob = ModelStore().blob_path(digest)
        partial = partial_path(blob, registry_base())
        assert not blob.exists() and 0 < partial.stat().st_size < len(gguf)
        assert ModelStore().list() == []
        env.sources.stalls.clear()
        held = partial.stat().st_size
        assert _lines(httpx.post(server.url + "/api/pull", json={"model": "tiny"}, timeout=120))[-1] == \
            {"status": "success"}
        assert env.seen("GET", "/cdn/")[-1].range == f"bytes={held}-"
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == digest[7:]
    finally:
        server.close()
        registry.close()


def test_tags_share_blobs_and_a_delete_keeps_what_another_uses(env, gguf):
    digest = env.add_registry_model("tiny", "latest", gguf)
    env.add_registry_model("tiny", "v2", gguf, template="{{ .Prompt }}")
    first, second = pull("tiny"), pull("tiny:v2")
    assert first.path == second.path and len(env.seen("GET", digest)) == 2   # one download (and its redirect)
    store = ModelStore()
    store.delete(first)
    assert Path(second.path).exists() and [m.name for m in store.list()] == ["tiny:v2"]
    store.delete(second)
    assert not Path(second.path).exists() and not Path(second.files["template"]).exists()
    assert store.list() == [] and not (store.root / "manifests" / env.url.split("//")[1]).exists()


def test_a_stored_model_loads_off_the_event_loop_once(env, gguf, tmp_path):
    """The first request for a pulled model loads it on a worker thread: the event loop (every
    other user's requests) keeps running meanwhile, and requests that ask at the same time share
    the one load."""
    import asyncio

    env.add_registry_model("tiny", "latest", gguf)
    pull("tiny")
    registry = tiny_registry(tmp_path, name="base")

    async def race():
        ticks = 0
        loading = asyncio.gather(*(registry.resolve("tiny") for _ in range(3)))
        while not loading.done():
            ticks += 1
            await asyncio.sleep(0.001)
        return ticks, await loading

    try:
        assert registry.get("tiny") is None   # the lookup that never loads
        ticks, served = asyncio.run(race())
        assert served[0] is served[1] is served[2] and served[0].loads == 1
        # a load on the loop would have let the ticker run once at most, before it started
        assert ticks > 1 and served[0].is_loaded and registry.get("tiny") is served[0]
    finally:
        registry.close()


def test_a_split_gguf_pulls_serves_and_deletes(env, tmp_path):
    """A Hub repository holding a 3-part split (gguf-split's names): the pull fetches every part,
    the stored model loads them as one and answers /api/generate, a delete removes them all; a
    repository missing a part is refused before anything is downloaded."""
    from pyllama_paged.engine import Model
    from pyllama_paged.testing.split_gguf import write_split

    base = write_tiny_model(tmp_path / "tiny.gguf", "gemma3", weight_type="q8_0")
    parts = write_split(base, str(tmp_path / "tiny-Q8_0"), 3)
    for p in parts:
        env.add_hub_file(REPO, Path(p).name, Path(p).read_bytes())
    env.add_hub_file("someone/half-GGUF", Path(parts[0]).name, Path(parts[0]).read_bytes())
    with pytest.raises(ModelNotFoundError, match="has 3 parts, but tiny-Q8_0-00002-of-00003.gguf"):
        pull("hf.co/someone/half-GGUF:Q8_0")
    stored = pull("hf.co/someone/tiny-GGUF:Q8_0")
    assert stored.path.endswith("tiny-Q8_0-00001-of-00003.gguf") and set(stored.files) == {"split-00002", "split-00003"}
    assert stored.size == sum(Path(p).stat().st_size for p in parts)
    with Model(stored.path) as m, Model(base) as whole:
        assert [t.name for t in m.gguf.tensors] == [t.name for t in whole.gguf.tensors]
    (tmp_path / "served").mkdir()
    registry = tiny_registry(tmp_path / "served")
    server = Running(create_app(registry))
    try:
        r = httpx.post(server.url + "/api/generate", json={"model": "hf.co/someone/tiny-GGUF:Q8_0", "prompt": "hi",
                                                           "stream": False, "options": {"num_predict": 2}}, timeout=120)
        assert r.status_code == 200 and r.json()["eval_count"] == 2, r.text
        r = httpx.request("DELETE", server.url + "/api/delete", json={"model": "hf.co/someone/tiny-GGUF:Q8_0"})
        assert r.status_code == 200, r.text
    finally:
        server.close()
        registry.close()
    assert ModelStore().list() == []
    assert not any(Path(p).exists() for p in [stored.path, *stored.files.values()])
