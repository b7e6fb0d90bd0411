"""Pulls tried as an attacker would, after issue 54: a registry or repository that serves
something other than a GGUF under a model's name, and addresses that wrap a private IPv4
address in an IPv6 form (NAT64, IPv4-compatible, IPv4-translated). The sources are the local
stand-ins of pyllama_paged.testing.model_sources; the server is real."""

import ipaddress
from pathlib import Path

import httpx
import pytest

from pyllama_paged.errors import DownloadError, RequestError
from pyllama_paged.models import egress
from pyllama_paged.models.pull import pull
from pyllama_paged.models.store import ModelStore
from pyllama_paged.server.app import create_app
from pyllama_paged.testing.serving import Running, tiny_registry

NOT_GGUF = b"<!doctype html><html><body>Sign in to continue</body></html>\n" * 64


def _left_nothing(tmp_path: Path) -> None:
    """No model in the store, no blob or partial in it, nothing in Hugging Face's cache."""
    def files(root: Path) -> list[str]:
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []
    assert ModelStore().list() == []
    assert [f for f in files(tmp_path / "store") if not f.endswith((".lock", "index.json"))] == []
    assert not [f for f in files(tmp_path / "hf" / "hub") if "blobs/" in f or "snapshots/" in f]


def test_a_registry_layer_that_is_not_gguf_is_refused_and_deleted(model_sources, tmp_path):
    digest = model_sources.add_registry_model("page", "latest", NOT_GGUF)
    with pytest.raises(DownloadError, match=r"not a GGUF model \(it starts with b'<!do'.*deleted and nothing was stored"):
        pull("page")
    assert not ModelStore().blob_path(digest).exists()
    _left_nothing(tmp_path)
    registry = tiny_registry(tmp_path, name="base")
    server = Running(create_app(registry))
    try:   # the same through the server: an error naming the problem, and the name does not exist
        r = httpx.post(server.url + "/api/pull", json={"model": "page", "stream": False}, timeout=60)
        assert r.status_code >= 400 and "not a GGUF model" in r.json()["error"]
        r = httpx.post(server.url + "/api/show", json={"model": "page"}, timeout=60)
        assert r.status_code == 404
    finally:
        server.close()
        registry.close()


def test_a_hub_file_that_is_not_gguf_is_refused_and_deleted(model_sources, tmp_path):
    model_sources.add_hub_file("someone/page-GGUF", "page-Q4_K_M.gguf", NOT_GGUF)
    with pytest.raises(DownloadError, match="someone/page-GGUF/page-Q4_K_M.gguf: the downloaded file is not a GGUF"):
        pull("hf.co/someone/page-GGUF")
    _left_nothing(tmp_path)


def test_a_real_gguf_still_pulls(model_sources, tiny_gguf_bytes):
    model_sources.add_registry_model("tiny", "latest", tiny_gguf_bytes)
    stored = pull("tiny")
    assert Path(stored.path).read_bytes()[:4] == b"GGUF"


@pytest.mark.parametrize("address", [
    "64:ff9b::a00:1", "64:ff9b::7f00:1", "64:ff9b::a9fe:a9fe", "64:ff9b::c0a8:1",   # NAT64 of 10/8, loopback,
    "64:ff9b:1::a00:1", "64:ff9b:1:ffff::808:808",                                  # metadata, 192.168/16;
    "::a00:1", "::7f00:1", "::a9fe:a9fe",                                           # local-use NAT64: never;
    "::ffff:0:a00:1", "::ffff:0:7f00:1",                                            # IPv4-compatible and
    "::ffff:10.0.0.1", "2002:a00:1::", "::", "::1", "::2",                          # -translated forms
])
def test_ipv6_forms_of_private_ipv4_addresses_are_refused(model_sources, address):
    with pytest.raises(RequestError, match="not public"):
        egress.checked_addresses(address, 443)


@pytest.mark.parametrize("address", ["64:ff9b::808:808", "::ffff:8.8.8.8", "2606:4700::1111", "8.8.8.8"])
def test_the_same_forms_of_public_addresses_pass(model_sources, address):
    assert egress.checked_addresses(address, 443) == [str(ipaddress.ip_address(address))]
