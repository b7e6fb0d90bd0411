"""Gemma 4's tokenizer (tokenizer.ggml.model "gemma4", tokenizer/gemma4_bpe.py): merge ranks over
SentencePiece-style text, newline runs whole, byte tokens for what the vocabulary lacks, always a
BOS; on the tiny gemma4 file's vocabulary, token for token what llama.cpp's llama-server gives
(where bench/build_llama_cpp.sh built it)."""
import json
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from pyllama_paged.testing import gguf_mutate
from pyllama_paged.testing.reference.tiny_gemma4 import write_tiny_gemma4
from pyllama_paged.testing.serving import free_port, stop_server, wait_healthy
from pyllama_paged.tokenizer.tokenizer import Tokenizer

CASES = [line for line in (Path(__file__).resolve().parents[1] / "data" / "tokenizer_cases.txt")
         .read_text(encoding="utf-8").split("\n") if line]
CASES += ["Hello world", "  two  spaces\n\n\nx", "\n", "\n\n\n\n", "a\n\nb", "<|turn>user\nHi<turn|>\n",
          "é ü 😀 tab\there", "<|tool_call>call:f{a:<|\"|>x<|\"|>}<tool_call|>", ""]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_gemma4(tmp_path_factory.mktemp("gemma4-tok") / "tiny.gguf", "moe", weight_type="f16")


@pytest.fixture(scope="module")
def tok(tiny):
    return Tokenizer.from_gguf(tiny)


def pieces(tok, text):
    return [tok.tokens[i] for i in tok.encode(text, add_special=False)]


def test_words_merge_by_rank_over_spaces_written_as_marks(tok):
    assert tok.model == "gemma4"
    # "▁capital" is built by its merges; "The" has none (the vocabulary's words start with ▁)
    assert pieces(tok, "The capital of France") == ["T", "h", "e", "▁capital", "▁of", "▁France"]
    assert pieces(tok, "  two") == ["▁", "▁t", "w", "o"]


def test_newline_runs_are_whole_where_the_vocabulary_has_them(tok):
    assert pieces(tok, "a\n\nb") == ["a", "\n\n", "b"]
    # three newlines are no entry: merged from single ones, left first
    assert pieces(tok, "\n\n\n") == ["\n\n", "\n"]


def test_what_the_vocabulary_lacks_is_spelled_in_bytes_and_decodes_back(tok):
    assert pieces(tok, "é") == ["<0xC3>", "<0xA9>"]
    for text in CASES:
        ids = tok.encode(text, add_special=True, parse_special=True)
        assert ids[:1] == [tok.bos_id] and tok.decode(ids[1:]) == text


def test_the_bos_is_added_even_where_the_file_says_not(tmp_path, tiny):
    doc = gguf_mutate.parse(Path(tiny).read_bytes())
    path = tmp_path / "no-bos.gguf"
    path.write_bytes(gguf_mutate.build(doc, [["kv", "tokenizer.ggml.add_bos_token", gguf_mutate.BOOL, False]]))
    tok = Tokenizer.from_gguf(str(path))
    assert tok.encode("Hi", add_special=True)[0] == tok.bos_id


def test_llama_cpp_tokenizes_as_we_do(tmp_path, tiny, tok):
    bin_dir = Path(os.environ.get("LLAMA_CPP_BIN", Path(__file__).resolve().parents[2] / "bench" / ".llama.cpp"
                                  / "build" / "bin"))
    if not (bin_dir / "llama-server").is_file():
        pytest.skip("llama-server is not built (bench/build_llama_cpp.sh builds it)")
    url, log = f"http://127.0.0.1:{(port := free_port())}", tmp_path / "llama-server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(bin_dir / "llama-server"), "-m", tiny, "--port", str(port), "-t", "1", "-c", "256",
                                 "--no-warmup"], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, "/health", timeout=120, log=log)
        for text in CASES:
            body = json.dumps({"content": text, "add_special": True, "parse_special": True})
            theirs = httpx.post(f"{url}/tokenize", content=body, timeout=60).json()["tokens"]
            assert tok.encode(text, add_special=True, parse_special=True) == theirs, text
    finally:
        stop_server(proc)
