"""A synthetic byte-level BPE vocabulary ("gpt2" tokenizer model) laid out like Llama 3's,
Qwen 2.5's, Qwen3.5's or gpt-oss's (o200k_harmony), for the synthetic GGUF writer (pyllama_paged/testing/synthetic_gguf.py).

The real vocabularies cannot be shipped, but their layout is what matters to a benchmark
or a loader: the 256 byte characters of GPT-2's byte-to-unicode table, then merged tokens
(each made by one merge of two earlier tokens, so the merges list and the vocabulary agree
and every word tokenizes), then the family's special tokens at the real ids, then padding
up to the embedding's row count. The merged tokens are English words and their prefixes
first (so prompts come out a realistic number of tokens), then every letter string in
length order until the vocabulary is full; all of it deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf

from ..tokenizer.bpe import BYTE_TO_CHAR, bytes_to_bpe_text
from ..tokenizer.chat_template import CHATML_TEMPLATE, LLAMA3_TEMPLATE
from .scripted_gguf import HARMONY_TEMPLATE

NORMAL, CONTROL, USER_DEFINED, UNUSED = (int(gguf.TokenType.NORMAL), int(gguf.TokenType.CONTROL),
                                         int(gguf.TokenType.USER_DEFINED), int(gguf.TokenType.UNUSED))


@dataclass(frozen=True)
class BpeFamily:
    """What a family's tokenizer metadata holds besides the merged tokens."""

    pre: str                  # tokenizer.ggml.pre, a name llama.cpp knows
    n_bpe: int                # byte and merged tokens before the first special token
    specials: tuple[tuple[str, int], ...]   # (text, token type), from id n_bpe on
    bos: str
    eos: str
    pad: str | None
    add_bos: bool
    chat_template: str


def _llama3_specials() -> tuple[tuple[str, int], ...]:
    # Llama 3.1/3.2: 256 control tokens from 128000; the unnamed ones are numbered reserved tokens
    named = {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 4: "<|finetune_right_pad_id|>",
             6: "<|start_header_id|>", 7: "<|end_header_id|>", 8: "<|eom_id|>", 9: "<|eot_id|>",
             10: "<|python_tag|>"}
    out, reserved = [], 0
    for i in range(256):
        if i in named:
            out.append((named[i], CONTROL))
        else:
            out.append((f"<|reserved_special_token_{reserved}|>", CONTROL))
            reserved += 1
    return tuple(out)


# Qwen 2.5 from id 151643; the ones its tokenizer does not mark special are user-defined
# (llama.cpp's converter types them so: they stay literal text in prompts and outputs).
_QWEN2_SPECIALS = tuple(
    [(t, CONTROL) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
                            "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
                            "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
                            "<|image_pad|>", "<|video_pad|>")]
    + [(t, USER_DEFINED) for t in ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
                                   "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")])

# Qwen3.5/3.6 from id 248044 (<|endoftext|>, <|im_start|>, <|im_end|> at their real ids); the rest
# in Qwen 2.5's order with Qwen3's thinking tags, not checked against the real file's later ids
_QWEN35_SPECIALS = _QWEN2_SPECIALS + tuple((t, USER_DEFINED) for t in ("<think>", "</think>"))

# gpt-oss's o200k_harmony from id 199998, all control in its GGUF (the tokenizer itself makes
# <|end|> and the harmony headers user-defined); the real file's reserved tokens past <|call|>
# up to 201087 are left to the padding.
_HARMONY_SPECIALS = tuple((t, CONTROL) for t in (
    "<|startoftext|>", "<|endoftext|>", "<|reserved_200000|>", "<|reserved_200001|>", "<|return|>",
    "<|constrain|>", "<|reserved_200004|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>",
    "<|reserved_200009|>", "<|reserved_200010|>", "<|reserved_200011|>", "<|call|>"))

FAMILIES: dict[str, BpeFamily] = {
    # bos/eos as in the instruct models' GGUFs: a turn ends generation
    "llama3": BpeFamily("llama-bpe", 128000, _llama3_specials(), bos="<|begin_of_text|>", eos="<|eot_id|>",
                        pad=None, add_bos=True, chat_template=LLAMA3_TEMPLATE),
    "qwen2": BpeFamily("qwen2", 151643, _QWEN2_SPECIALS, bos="<|endoftext|>", eos="<|im_end|>",
                       pad="<|endoftext|>", add_bos=False, chat_template=CHATML_TEMPLATE),
    # Qwen3.5/3.6 (tokenizer.ggml.pre "qwen35": Qwen 2.5's pre-tokenizer with combining marks in words)
    "qwen35": BpeFamily("qwen35", 248044, _QWEN35_SPECIALS, bos="<|endoftext|>", eos="<|im_end|>",
                        pad="<|endoftext|>", add_bos=False, chat_template=CHATML_TEMPLATE),
    # <|return|> the EOS as in gpt-oss's GGUF; the template is harmony's shape, written here
    "gpt-oss": BpeFamily("gpt-4o", 199998, _HARMONY_SPECIALS, bos="<|startoftext|>", eos="<|return|>",
                         pad="<|endoftext|>", add_bos=False, chat_template=HARMONY_TEMPLATE),
}

# Merged first: what chat prompts and the tests' sentences are made of, and whitespace runs.
_WORDS = ("the", "The", "capital", "of", "France", "is", "Paris", "Hello", "hello", "world", "a", "and",
          "system", "user", "assistant", "You", "you", "are", "helpful", "What", "what", "to", "in",
          "Write", "story", "about", "cat", "dog", "one", "two", "three", "sentence", "answer")
_WHITESPACE = ("\n\n", "\n\n\n", "  ", "    ", "        ")
_LETTERS = "etaoinsrhldcumfpgwybvkxjqz"


def _words() -> list[str]:
    """Byte-level texts of the words to merge first: after a space, bare, and whitespace runs.
    The spaced forms come first: BPE merges lowest rank first, and a word's own chain must
    outrank the bare word's ("c a" before "Ġ c" would leave " capital" as "Ġ", "capital")."""
    out = [bytes_to_bpe_text(b" " + w.encode()) for w in _WORDS]
    out += [bytes_to_bpe_text(w.encode()) for w in _WORDS]
    return out + [bytes_to_bpe_text(w.encode()) for w in _WHITESPACE]


def _letter_strings():
    """Every letter string after a space mark, capital or nothing, in length order, forever."""
    space = BYTE_TO_CHAR[ord(" ")]
    level = [space] + list(_LETTERS) + list(_LETTERS.upper())
    while True:
        level = [s + c for s in level for c in _LETTERS]
        yield from level


def merged_tokens(n_merged: int) -> list[str]:
    """The first n_merged merged tokens; each one's last character split off is an earlier token."""
    seen = set(BYTE_TO_CHAR)
    out: list[str] = []

    def add(text: str) -> None:
        # add the prefixes first so that each token is one merge of earlier ones
        for k in range(2, len(text) + 1):
            if len(out) < n_merged and text[:k] not in seen:
                seen.add(text[:k])
                out.append(text[:k])

    for word in _words():
        add(word)
    strings = _letter_strings()
    while len(out) < n_merged:
        add(next(strings))
    return out


def build_bpe_vocab(family: str, n_vocab: int) -> dict:
    """tokens, token types, merges and special ids for a vocabulary of n_vocab tokens laid out
    like the family's: bytes and merged tokens, specials at the real ids, [PAD<id>] padding."""
    fam = FAMILIES[family]
    n_bpe = min(fam.n_bpe, n_vocab - len(fam.specials))
    if n_bpe < len(BYTE_TO_CHAR):
        raise ValueError(f"n_vocab {n_vocab} leaves no room for the 256 byte tokens and "
                         f"{len(fam.specials)} special tokens")
    merged = merged_tokens(n_bpe - len(BYTE_TO_CHAR))
    # GPT-2's order: the byte characters sorted (printable bytes stand for themselves and come first)
    tokens = sorted(BYTE_TO_CHAR) + merged + [text for text, _ in fam.specials]
    types = [NORMAL] * n_bpe + [kind for _, kind in fam.specials]
    # padding rows as llama.cpp's converter names them, unused
    tokens += [f"[PAD{i}]" for i in range(len(tokens), n_vocab)]
    types += [UNUSED] * (n_vocab - len(types))
    ids = {text: i for i, text in enumerate(tokens)}
    return dict(tokens=tokens, types=types, merges=[f"{t[:-1]} {t[-1]}" for t in merged], pre=fam.pre,
                bos=ids[fam.bos], eos=ids[fam.eos], pad=None if fam.pad is None else ids[fam.pad],
                add_bos=fam.add_bos, chat_template=fam.chat_template)
