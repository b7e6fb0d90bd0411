"""OpenAI's o200k tokenizer as gpt-oss's GGUF names it (tokenizer.ggml.pre "gpt-4o"): its
pre-tokenizer splits text as the o200k regex does, and the o200k_harmony special tokens are
typed and end generation as llama.cpp has them."""

import random
import warnings

import pytest

from pyllama_paged.tokenizer.bpe import BYTE_TO_CHAR, PreTokenizer, pre_tokenizer_family
from pyllama_paged.tokenizer.tokenizer import Tokenizer
from pyllama_paged.tokenizer.vocab import TokenType

# The o200k regex as tiktoken and gpt-4o's tokenizer.json write it (tiktoken's o200k_base file
# cannot be downloaded here, so the regex is run by the `regex` module, which has \p{..}).
O200K_REGEX = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# Worked out by hand from the regex.
CASES = [
    ("Hello world", ["Hello", " world"]),
    # contractions in either case stay on their word; a word is upper then lower case letters
    ("I'M fine, you're OK. HTTPServer isn't", ["I'M", " fine", ",", " you're", " OK", ".", " HTTPServer", " isn't"]),
    ("they'LL camelCaseWord", ["they'LL", " camel", "Case", "Word"]),
    # numbers in groups of up to three, a space before a number stands alone
    ("1234567 12.5", ["123", "456", "7", " ", "12", ".", "5"]),
    # CJK letters are other letters, both cases at once
    ("東京タワー は", ["東京タワー", " は"]),
    # a symbol run takes the newlines after it; a slash leads the word after it
    ("foo!!!\n\nbar", ["foo", "!!!\n\n", "bar"]),
    ("path/to/file.py", ["path", "/to", "/file", ".py"]),
    ("x = (a+b);\n", ["x", " =", " (", "a", "+b", ");\n"]),   # one symbol may lead a word, not two
    # spaces: the last one joins the next word; newline runs stand alone with the spaces before them
    ("a   b\n\n\n  c", ["a", "  ", " b", "\n\n\n", " ", " c"]),
    ("end  \n", ["end", "  \n"]),
    ("tab\tx  ", ["tab", "\tx", "  "]),
    ("🙂🙂 ok", ["🙂🙂", " ok"]),
]


@pytest.fixture(scope="module")
def o200k():
    return PreTokenizer(pre_tokenizer_family("gpt-4o"))


@pytest.mark.parametrize("text, words", CASES, ids=[c[0] for c in CASES])
def test_splits_as_the_o200k_regex(o200k, text, words):
    assert o200k.split(text) == words


def test_gpt_oss_and_its_kin_are_the_o200k_family():
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # an unknown name warns and falls back to the default regexes
        assert {pre_tokenizer_family(p) for p in ("gpt-4o", "llama4", "kanana2", "talkie")} == {"gpt-4o"}


def test_agrees_with_the_regex_itself_on_random_text(o200k):
    regex = pytest.importorskip("regex")
    rx = regex.compile(O200K_REGEX)
    for text, words in CASES:
        assert rx.findall(text) == words
    # ASCII letters of both cases, digits, every ASCII symbol, spaces and newlines, CJK, an emoji,
    # wide spaces (not cased non-ASCII letters: see the next test)
    alphabet = list("aZbY  \n\t\r'sStTmMdDlLvVeErR0123456789") + [chr(c) for c in range(33, 127)] + \
        ["東", "は", "ー", "🙂", "\u3000", "\xa0"]
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30)))
        assert o200k.split(text) == rx.findall(text), repr(text)


def test_a_non_ascii_capital_is_both_cases_as_in_llama_cpp(o200k):
    # llama.cpp's version of the regex knows case only for ASCII letters; o200k itself would cut
    # " γδ" from "ΑΒ" and "é" from "Vu" (lower then upper case). GGUF engines split as llama.cpp does.
    assert o200k.split("ΑΒγδ γδΑΒ éVu") == ["ΑΒγδ", " γδΑΒ", " éVu"]


def _harmony_bpe(pre: str = "gpt-4o") -> Tokenizer:
    """A byte-level BPE vocabulary with a merge across one of o200k's cuts and the
    o200k_harmony special tokens, typed as gpt-oss's GGUF types them (all control)."""
    specials = ["<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|call|>"]
    merges = ["1 2", "12 3", "123 4", "Ġ y", "Ġy o", "Ġyo u"]
    tokens = list(BYTE_TO_CHAR) + ["12", "123", "1234", "Ġy", "Ġyo", "Ġyou"] + specials
    types = [int(TokenType.NORMAL)] * (len(tokens) - len(specials)) + [int(TokenType.CONTROL)] * len(specials)
    ret = tokens.index("<|return|>")
    return Tokenizer(tokens, token_types=types, merges=merges, model="gpt2", pre=pre, eos_id=ret)


def test_merges_never_cross_the_pre_tokenizers_cuts():
    def pieces(tok, text):
        return [tok.tokens[i] for i in tok.encode(text, add_special=False)]

    tok = _harmony_bpe()
    # o200k cuts "1234" after three digits, so the merge "123 4" never applies (GPT-2's regex keeps it whole)
    assert pieces(tok, "1234 you") == ["123", "4", "Ġyou"]
    assert pieces(_harmony_bpe("gpt-2"), "1234 you") == ["1234", "Ġyou"]
    assert not tok.add_bos and tok.decode(tok.encode("1234 you")) == "1234 you"


def test_harmony_markup_is_text_and_only_return_and_call_end_generation():
    tok = _harmony_bpe()
    ids = {t: tok.token_to_id(t) for t in ("<|return|>", "<|call|>", "<|end|>", "<|channel|>", "<|message|>",
                                           "<|start|>", "<|constrain|>")}
    # <|end|> ends a message, not the reply, even where it would be the EOT
    assert tok.eot_ids == {ids["<|return|>"], ids["<|call|>"]} and tok.eot_id == ids["<|end|>"]
    # llama.cpp makes the headers' tokens user-defined, so a reply's text keeps its channels
    for text in ("<|end|>", "<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
        assert tok.token_type(ids[text]) == TokenType.USER_DEFINED, text
    text = "<|channel|>analysis<|message|>12<|end|><|start|>assistant"
    reply = tok.encode(text, add_special=False) + [ids["<|return|>"]]
    assert reply[0] == ids["<|channel|>"] and ids["<|message|>"] in reply and ids["<|start|>"] in reply
    assert tok.decode(reply, skip_special=True) == text
