"""Llama.from_pretrained downloading from a (local) Hugging Face Hub through huggingface_hub:
into Hugging Face's cache layout or local_dir, sha256-checked, resumed across a dropped
connection, found locally the next time (issue 27)."""

import hashlib
import os
from pathlib import Path

import pytest

from pyllama_paged.api.llama import Llama
from pyllama_paged.api.llama_pretrained import find_pretrained
from pyllama_paged.errors import IntegrityError, ModelNotFoundError
from pyllama_paged.testing.model_sources import COMMIT

REPO = "someone/tiny-GGUF"


def test_from_pretrained_downloads_into_the_hf_cache(model_sources, tiny_gguf_bytes, tmp_path):
    model_sources.add_hub_file(REPO, "tiny-Q8_0.gguf", tiny_gguf_bytes)
    model_sources.add_hub_file(REPO, "tiny-Q4_K_M.gguf", tiny_gguf_bytes + b"\0")   # another file that must not be fetched
    seen = []
    with Llama.from_pretrained(REPO, "*q8_0.gguf", n_ctx=64, n_threads=2,
                               progress=lambda *event: seen.append(event)) as llm:
        assert llm.model_path == str(tmp_path / "hf" / "hub" / "models--someone--tiny-GGUF" / "snapshots" / COMMIT /
                                     "tiny-Q8_0.gguf")
        assert llm("hi", max_tokens=2)["usage"]["completion_tokens"] == 2
    blob = Path(os.path.realpath(llm.model_path))
    assert blob.name == hashlib.sha256(tiny_gguf_bytes).hexdigest() and blob.read_bytes() == tiny_gguf_bytes
    pulled = [e for e in seen if e[0].startswith("pulling ")]
    # bytes as huggingface_hub writes them (its progress hook), then the hash check's
    assert pulled[0][1:] == (0, len(tiny_gguf_bytes)) and pulled[-1][1:] == (len(tiny_gguf_bytes), len(tiny_gguf_bytes))
    assert seen[-1] == ("verifying sha256 digest", len(tiny_gguf_bytes), len(tiny_gguf_bytes))
    assert not model_sources.seen("GET", "tiny-Q4_K_M")
    # the next time it is found in the cache, before anything is asked of the Hub
    before = len(model_sources.seen())
    assert find_pretrained(REPO, "*Q8_0.gguf") == llm.model_path
    assert len(model_sources.seen()) == before


def test_from_pretrained_into_local_dir_and_its_errors(model_sources, tiny_gguf_bytes, tmp_path):
    model_sources.add_hub_file(REPO, "tiny-Q8_0.gguf", tiny_gguf_bytes)
    model_sources.add_hub_file(REPO, "tiny-Q4_K_M.gguf", tiny_gguf_bytes, published_sha=hashlib.sha256(b"something else").hexdigest())
    path = find_pretrained(REPO, "*Q8_0.gguf", local_dir=tmp_path / "models")
    assert path == str(tmp_path / "models" / "tiny-Q8_0.gguf") and Path(path).read_bytes() == tiny_gguf_bytes
    with pytest.raises(IntegrityError, match="the Hub publishes .*deleted"):
        Llama.from_pretrained(REPO, "*Q4_K_M.gguf", verbose=False)
    assert not [p for p in (tmp_path / "hf").rglob("*") if p.is_file() and "blobs" in p.parts]
    with pytest.raises(ValueError, match="several files of someone/tiny-GGUF match '\\*.gguf'"):
        Llama.from_pretrained(REPO, "*.gguf", cache_dir=tmp_path / "elsewhere", verbose=False)
    with pytest.raises(ModelNotFoundError, match="the Hub has none: .*repository nobody/none not found"):
        Llama.from_pretrained("nobody/none", "*.gguf", verbose=False)
    with pytest.raises(ModelNotFoundError, match="no file of someone/tiny-GGUF matches '\\*IQ1_S.gguf'"):
        Llama.from_pretrained(REPO, "*IQ1_S.gguf", verbose=False)


def test_a_hub_download_resumes_a_dropped_connection(model_sources, tmp_path):
    # bigger than huggingface_hub's read chunk (10 MB), so bytes were written before the cut
    data = os.urandom(24 << 20)
    model_sources.add_hub_file(REPO, "big.gguf", data)
    model_sources.cut("big.gguf", 21 << 20)
    path = find_pretrained(REPO, "big.gguf")
    ranged = [s.range for s in model_sources.seen("GET", "/resolve/") if s.range]
    assert len(ranged) == 1 and ranged[0].startswith("bytes=") and ranged[0] != "bytes=0-"
    assert hashlib.sha256(Path(path).read_bytes()).hexdigest() == hashlib.sha256(data).hexdigest()


def test_from_pretrained_fetches_every_part_of_a_split(model_sources, tmp_path):
    """llama-cpp-python's split call (the first part's filename, the others as additional_files):
    every part is downloaded beside the first and the model loads from it."""
    from pyllama_paged.testing.reference.tiny_gguf import write_tiny_model
    from pyllama_paged.testing.split_gguf import write_split

    parts = write_split(write_tiny_model(tmp_path / "tiny.gguf", "gemma3", weight_type="q8_0"),
                        str(tmp_path / "tiny-Q8_0"), 3)
    for p in parts:
        model_sources.add_hub_file(REPO, Path(p).name, Path(p).read_bytes())
    with Llama.from_pretrained(REPO, "*Q8_0-00001-of-00003.gguf", additional_files=["*-00002-of-00003.gguf",
                               "*-00003-of-00003.gguf"], n_ctx=64, n_threads=2, verbose=False) as llm:
        assert llm.model_path.endswith("tiny-Q8_0-00001-of-00003.gguf")
        assert llm("hi", max_tokens=2)["usage"]["completion_tokens"] == 2
    assert all(Path(llm.model_path).with_name(Path(p).name).exists() for p in parts)
    with pytest.raises(ValueError, match="additional_files is for the other parts of a split GGUF"):
        Llama.from_pretrained(REPO, "*Q4_K_M.gguf", additional_files=["x.gguf"], verbose=False)
