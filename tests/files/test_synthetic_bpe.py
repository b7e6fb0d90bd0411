"""pyllama_paged/testing/synthetic_bpe.py: the synthetic byte-level BPE vocabularies of the
Llama 3 and Qwen 2.5 presets are laid out like the real ones and tokenize any text."""

import pytest

from pyllama_paged.testing.synthetic_bpe import CONTROL, NORMAL, UNUSED, USER_DEFINED, build_bpe_vocab
from pyllama_paged.tokenizer.tokenizer import Tokenizer

# (family, n_vocab, id of the first special token, the specials whose ids the real tokenizers fix)
LAYOUTS = [
    ("llama3", 128256, 128000, {"<|begin_of_text|>": 128000, "<|start_header_id|>": 128006,
                                "<|end_header_id|>": 128007, "<|eot_id|>": 128009,
                                "<|reserved_special_token_247|>": 128255}),
    ("qwen2", 151936, 151643, {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                               "<tool_call>": 151657, "<|file_sep|>": 151664}),
]


@pytest.fixture(scope="module", params=LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def vocab(request):
    family, n_vocab, first_special, specials = request.param
    return family, n_vocab, first_special, specials, build_bpe_vocab(family, n_vocab)


def test_the_layout_is_the_real_one(vocab):
    family, n_vocab, first_special, specials, v = vocab
    tokens, types = v["tokens"], v["types"]
    assert len(tokens) == len(types) == n_vocab and len(set(tokens)) == n_vocab
    assert all(tokens[i] == text for text, i in specials.items())
    assert set(types[:first_special]) == {NORMAL}
    assert set(types[first_special:]) <= {CONTROL, USER_DEFINED, UNUSED}
    # GPT-2's 256 byte characters first, in its order ("!" is token 0, as in both real vocabularies)
    assert tokens[0] == "!" and len({len(t) for t in tokens[:256]}) == 1
    if family == "qwen2":
        assert tokens[-1] == "[PAD151935]" and types[-1] == UNUSED


def test_every_merge_joins_two_earlier_tokens_into_the_next(vocab):
    _, _, first_special, _, v = vocab
    index = {t: i for i, t in enumerate(v["tokens"])}
    assert len(v["merges"]) == first_special - 256
    for rank, merge in enumerate(v["merges"]):
        left, right = merge.split(" ")
        made = index[left + right]
        assert made == 256 + rank and index[left] < made and index[right] < made


@pytest.mark.parametrize("text", ["The capital of France is", "Hello world!\n\nWhat is 2 + 2?",
                                  "naïve café 東京 🙂", "   indented\tcode()"])
def test_any_text_tokenizes_and_round_trips(vocab, text):
    _, _, _, _, v = vocab
    tok = Tokenizer(v["tokens"], token_types=v["types"], merges=v["merges"], model="gpt2", pre=v["pre"],
                    bos_id=v["bos"], eos_id=v["eos"], add_bos=v["add_bos"])
    ids = tok.encode(text, add_special=False)
    assert tok.decode(ids) == text
    assert all(v["types"][i] == NORMAL for i in ids)


def test_common_words_are_one_token_each(vocab):
    _, _, _, _, v = vocab
    tok = Tokenizer(v["tokens"], token_types=v["types"], merges=v["merges"], model="gpt2", pre=v["pre"])
    assert len(tok.encode("The capital of France is", add_special=False)) == 5


def test_a_vocabulary_too_small_for_bytes_and_specials_is_refused():
    with pytest.raises(ValueError, match="no room"):
        build_bpe_vocab("llama3", 500)
