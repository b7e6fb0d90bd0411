"""Tokenizer built from GGUF metadata; agrees token for token with llama.cpp.

Two vocabulary kinds are supported, chosen by ``tokenizer.ggml.model``:

* ``"llama"``: SentencePiece style (Llama 2, Mistral, TinyLlama, Gemma). Spaces become ``▁``,
  pieces merge by score, unknown characters fall back to ``<0xXX>`` byte tokens. A space is put
  in front of the text (and after every special token) when ``tokenizer.ggml.add_space_prefix``
  says so; that flag defaults to true, as in llama.cpp (Gemma 3 sets it to false).
  See ``spm``.
* ``"gpt2"``: byte-level BPE (Llama 3, Qwen 2, SmolLM, GPT-2), with the pre-tokenizer regexes
  named by ``tokenizer.ggml.pre``. See ``bpe``.

Encoding follows llama.cpp: first, special-token texts are cut out of the text (user-defined
tokens always; control tokens such as ``<start_of_turn>`` only with ``parse_special=True``),
longest token first; then each remaining text fragment is encoded on its own; BOS/EOS are added
per ``tokenizer.ggml.add_bos_token`` / ``add_eos_token`` when ``add_special`` is true.

Decoding choices (llama.cpp leaves these to the caller):

* ``decode`` joins ``token_to_piece`` bytes and decodes UTF-8 with replacement characters; it
  does not apply llama.cpp's optional "clean up tokenization spaces" pass, so
  ``decode(encode(text, add_special=False)) == text`` (for SPM: unless the text holds a literal
  ``▁``, or special tokens while ``add_space_prefix`` is set).
* With ``add_space_prefix`` (SPM), the space that encoding puts in front of the text is removed
  again: one leading space of the first token after any leading control tokens (BOS). The
  spaces put after special tokens inside the text stay, as in llama.cpp.
* Control and unknown tokens decode to their text unless ``skip_special=True``; unused tokens
  decode to nothing.

``Tokenizer.from_gguf`` accepts a path (read with the package's one, bounds-checked GGUF
reader, ``pyllama_paged.gguf.reader``), a ``gguf.GGUFReader``, an object with a ``metadata`` dict, or a
``{key: value}`` metadata dict.
"""

from __future__ import annotations

import codecs
import os
from enum import IntEnum
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import numpy as np

from ..errors import ModelLoadError
from ..gguf.reader import read_metadata
from .bpe import BpeEncoder, bpe_text_to_bytes, pre_tokenizer_family, pre_tokenizer_flags
from .chat_template import ChatPrompt, ContentGuard
from .spm import SPACE_MARK, SpmEncoder
from .wordpiece import WordPieceEncoder

__all__ = ["TokenType", "Tokenizer", "IncrementalDecoder"]


class TokenType(IntEnum):
    """Values of ``tokenizer.ggml.token_type``."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Token texts that llama.cpp treats as end of generation (and then as control tokens, so they
# are only parsed with parse_special) -- even "</s>", which Gemma 3 has as an HTML tag.
_END_OF_GENERATION_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
)
# Of those, the ones that may serve as the EOT id when the GGUF names none.
_END_OF_TURN_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<end_of_utterance>",
)

# --- GGUF metadata ----------------------------------------------------------------------------

_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _tokenizer_key(key: str) -> bool:
    return key.startswith("tokenizer.") or key == "general.architecture"


def _metadata_from_reader(reader) -> dict[str, Any]:
    """Tokenizer metadata from a ``gguf.GGUFReader``."""
    out = {}
    for key, field in reader.fields.items():
        if not _tokenizer_key(key):
            continue
        types = list(field.types)
        if types[0] == _GGUF_ARRAY:
            if len(types) > 1 and types[1] == _GGUF_STRING:
                out[key] = [bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data]
            elif field.data:
                out[key] = np.concatenate([np.asarray(field.parts[i]).reshape(-1) for i in field.data])
            else:
                out[key] = np.zeros(0)
        elif types[0] == _GGUF_STRING:
            out[key] = bytes(field.parts[field.data[0]]).decode("utf-8", "surrogateescape")
        else:
            out[key] = field.parts[field.data[0]][0].item()
    return out


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _string_list(md: Mapping[str, Any], key: str) -> Optional[list]:
    """A GGUF string array (a list of str/bytes), or None when absent."""
    value = md.get(key)
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, (str, bytes)) for v in value):
        raise ModelLoadError(f"metadata field '{key}' must be an array of strings, got {_short(value)}")
    return list(value)


def _number_array(md: Mapping[str, Any], key: str, n: int, kinds: str) -> Optional[np.ndarray]:
    """A 1-D numeric array of n items (numpy dtype kind in kinds), or None when absent."""
    value = md.get(key)
    if value is None:
        return None
    arr = value if isinstance(value, np.ndarray) else None
    if arr is None and isinstance(value, (list, tuple)):
        try:
            arr = np.asarray(value)
        except (ValueError, TypeError):  # ragged or mixed lists
            arr = None
    if arr is None or arr.ndim != 1 or arr.dtype.kind not in kinds:
        what = "numbers" if "f" in kinds else "integers"
        raise ModelLoadError(f"metadata field '{key}' must be an array of {what}, got {_short(value)}")
    if len(arr) != n:
        raise ModelLoadError(f"metadata field '{key}' has {len(arr)} entries for {n} tokens")
    return arr


# --- the tokenizer ----------------------------------------------------------------------------

def _as_text(token: Union[str, bytes]) -> str:
    return token.decode("utf-8", "surrogateescape") if isinstance(token, bytes) else token


class Tokenizer:
    """Text <-> token ids for one vocabulary.

    Build it with ``from_gguf`` or directly from lists (handy for tests)::

        Tokenizer(tokens, scores=..., token_types=..., model="llama", bos_id=1, eos_id=2)
        Tokenizer(tokens, merges=["a b", ...], model="gpt2", pre="llama-bpe")

    ``model`` is "llama" (SentencePiece style) or "gpt2" (byte-level BPE). Special ids that are
    None (or out of range) are absent. ``add_bos``/``add_eos``/``add_space_prefix``/
    ``ignore_merges`` left as None take llama.cpp's default for the model and pre-tokenizer.
    """

    def __init__(
        self,
        tokens: Sequence[Union[str, bytes]],
        scores: Optional[Sequence[float]] = None,
        token_types: Optional[Sequence[int]] = None,
        merges: Optional[Sequence[str]] = None,
        *,
        model: str = "llama",
        pre: Optional[str] = None,
        bos_id: Optional[int] = None,
        eos_id: Optional[int] = None,
        unk_id: Optional[int] = None,
        eot_id: Optional[int] = None,
        eom_id: Optional[int] = None,
        pad_id: Optional[int] = None,
        add_bos: Optional[bool] = None,
        add_eos: Optional[bool] = None,
        add_space_prefix: Optional[bool] = None,
        ignore_merges: Optional[bool] = None,
    ):
        n = len(tokens)
        if n == 0:
            raise ValueError("empty vocabulary")
        self.tokens: list[str] = [_as_text(t) for t in tokens]
        self.scores: list[float] = [0.0] * n if scores is None else [float(s) for s in scores]
        if token_types is None:
            types = [int(TokenType.NORMAL)] * n
        else:
            known = {int(t) for t in TokenType}
            types = [int(t) if int(t) in known else int(TokenType.UNDEFINED) for t in token_types]
        if len(self.scores) != n or len(types) != n:
            raise ValueError("tokens, scores and token_types must have the same length")
        self._vocab: dict[str, int] = {text: i for i, text in enumerate(self.tokens)}

        def valid(tid):
            return int(tid) if tid is not None and 0 <= int(tid) < n else None

        self.bos_id, self.eos_id, self.unk_id = valid(bos_id), valid(eos_id), valid(unk_id)
        self.eot_id, self.eom_id, self.pad_id = valid(eot_id), valid(eom_id), valid(pad_id)

        self._find_end_of_generation(types)
        self.token_types: list[int] = types

        if model == "llama":
            self.model = "llama"
            self.pre = pre
            self.add_bos = True if add_bos is None else bool(add_bos)
            self.add_eos = False if add_eos is None else bool(add_eos)
            self.add_space_prefix = True if add_space_prefix is None else bool(add_space_prefix)
            self._encoder = SpmEncoder(self._vocab, self.scores, self.unk_id)
        elif model == "gpt2":
            self.model = "gpt2"
            family = pre_tokenizer_family(pre)
            flags = pre_tokenizer_flags(family)
            self.pre = pre
            self.add_bos = flags.get("add_bos", False) if add_bos is None else bool(add_bos)
            self.add_eos = False if add_eos is None else bool(add_eos)
            self.add_space_prefix = False if add_space_prefix is None else bool(add_space_prefix)
            if ignore_merges is None:
                ignore_merges = flags.get("ignore_merges", False)
            self._encoder = BpeEncoder(self._vocab, merges or [], family, ignore_merges)
        elif model == "bert":
            # WordPiece; [CLS] and [SEP] around every input (as BOS and EOS here: llama.cpp
            # reads CLS as BOS), see wordpiece
            self.model = "bert"
            self.pre = pre
            self.add_bos = True if add_bos is None else bool(add_bos)
            self.add_eos = True if add_eos is None else bool(add_eos)
            self.add_space_prefix = False
            self._encoder = WordPieceEncoder(self._vocab, self.unk_id)
        else:
            raise NotImplementedError(f"tokenizer model {model!r} is not supported (only 'llama', 'gpt2' "
                                      "and 'bert')")

        self._special_groups: dict[bool, list] = {}
        self._pieces: dict[tuple[int, bool], bytes] = {}

    def _find_end_of_generation(self, types: list[int]) -> None:
        """Set ``eot_id`` (if the GGUF names none) and the end-of-generation ids the way
        llama.cpp does, marking the tokens found by text as control tokens."""
        vocab = self._vocab
        if self.eot_id is None:
            self.eot_id = next((vocab[t] for t in _END_OF_TURN_TEXTS if t in vocab), None)
        if self.eom_id is None:
            self.eom_id = vocab.get("<|eom_id|>")
        found = {t: vocab[t] for t in _END_OF_GENERATION_TEXTS if t in vocab}
        for tid in found.values():
            types[tid] = int(TokenType.CONTROL)
        # llama.cpp's exceptions: with <|return|>+<|call|> (or <|calls|>+<|flush|>), <|end|> is
        # plain text; next to <|tool_response>, </s> is a normal token.
        if "<|end|>" in found and (("<|return|>" in found and "<|call|>" in found)
                                   or ("<|calls|>" in found and "<|flush|>" in found)):
            types[found.pop("<|end|>")] = int(TokenType.USER_DEFINED)
        if "</s>" in found and "<|tool_response>" in found:
            types[found.pop("</s>")] = int(TokenType.NORMAL)
        eog = set(found.values())
        eog.update(t for t in (self.eos_id, self.eot_id, self.eom_id) if t is not None)
        self._eot_ids = frozenset(eog)

    # -- construction from GGUF -----------------------------------------------------------------

    @classmethod
    def from_gguf(cls, source) -> "Tokenizer":
        """From a GGUF path, a ``gguf.GGUFReader``, an object with a ``metadata`` dict (our
        ``GGUFFile``) or a metadata dict."""
        if isinstance(source, Mapping):
            return cls.from_metadata(source)
        if isinstance(getattr(source, "metadata", None), Mapping):
            return cls.from_metadata(source.metadata)
        if hasattr(source, "fields"):
            return cls.from_metadata(_metadata_from_reader(source))
        # metadata only, strings lossless: vocabularies may hold bytes that are not UTF-8
        return cls.from_metadata(read_metadata(os.fspath(source), errors="surrogateescape"))

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any]) -> "Tokenizer":
        """From GGUF metadata. A missing or mistyped field (e.g. scores that are strings, or
        fewer token types than tokens) raises ``ModelLoadError`` (a ``ValueError``) naming it."""
        model = md.get("tokenizer.ggml.model")
        if model is None:
            raise ModelLoadError("GGUF metadata has no tokenizer.ggml.model")
        if not isinstance(model, str) or model not in ("llama", "gpt2", "bert"):  # (an array has no `in`)
            raise ModelLoadError(f"tokenizer model {_short(model)} is not supported (only 'llama', 'gpt2' "
                                 "and 'bert')")
        if "tokenizer.ggml.tokens" not in md:
            raise ModelLoadError("GGUF metadata has no tokenizer.ggml.tokens")
        tokens = _string_list(md, "tokenizer.ggml.tokens")
        if not tokens:
            raise ModelLoadError("metadata field 'tokenizer.ggml.tokens' is empty")
        n = len(tokens)

        def get_id(name: str, default: Optional[int] = None) -> Optional[int]:
            value = md.get(f"tokenizer.ggml.{name}")
            if value is None:
                return default
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                raise ModelLoadError(f"metadata field 'tokenizer.ggml.{name}' must be an integer, "
                                     f"got {_short(value)}")
            return int(value)  # out of range: absent (see __init__)

        def get_flag(name: str) -> Optional[bool]:
            value = md.get(f"tokenizer.ggml.{name}")
            if value is not None and not isinstance(value, (bool, int, np.bool_, np.integer)):
                raise ModelLoadError(f"metadata field 'tokenizer.ggml.{name}' must be a boolean, "
                                     f"got {_short(value)}")
            return None if value is None else bool(value)

        pre = md.get("tokenizer.ggml.pre")
        if pre is not None and not isinstance(pre, str):
            raise ModelLoadError(f"metadata field 'tokenizer.ggml.pre' must be a string, got {_short(pre)}")
        spm = model == "llama"  # llama.cpp's defaults for SentencePiece vocabularies
        if model == "bert":
            return cls._bert_from_metadata(md, tokens, get_id, get_flag)
        scores = _number_array(md, "tokenizer.ggml.scores", n, "biuf")
        types = _number_array(md, "tokenizer.ggml.token_type", n, "biu")
        return cls(
            tokens,
            scores=None if scores is None else scores.astype(np.float32).tolist(),
            token_types=None if types is None else types.tolist(),
            merges=_string_list(md, "tokenizer.ggml.merges"),
            model=model,
            pre=pre,
            bos_id=get_id("bos_token_id", 1 if spm else None),
            eos_id=get_id("eos_token_id", 2 if spm else None),
            unk_id=get_id("unknown_token_id", 0 if spm else None),
            eot_id=get_id("eot_token_id"),
            eom_id=get_id("eom_token_id"),
            pad_id=get_id("padding_token_id"),
            add_bos=get_flag("add_bos_token"),
            add_eos=get_flag("add_eos_token"),
            add_space_prefix=get_flag("add_space_prefix"),
        )

    @classmethod
    def _bert_from_metadata(cls, md, tokens, get_id, get_flag) -> "Tokenizer":
        """WordPiece from GGUF metadata: [CLS] is bos_token_id (llama.cpp's reading), [SEP]
        seperator_token_id (sic, llama.cpp's key) or eos_token_id; either found by its text
        when the file names neither."""
        n = len(tokens)
        types = _number_array(md, "tokenizer.ggml.token_type", n, "biu")
        texts = {_as_text(t): i for i, t in enumerate(tokens)}
        sep = get_id("seperator_token_id", get_id("eos_token_id", texts.get("[SEP]")))
        add_sep = get_flag("add_sep_token")   # llama.cpp adds [SEP] unless this says not to
        return cls(tokens, token_types=None if types is None else types.tolist(), model="bert",
                   bos_id=get_id("bos_token_id", texts.get("[CLS]")), eos_id=sep,
                   unk_id=get_id("unknown_token_id", texts.get("[UNK]")), pad_id=get_id("padding_token_id"),
                   add_bos=get_flag("add_bos_token"), add_eos=True if add_sep is None else add_sep)

    # -- properties -------------------------------------------------------------------------------

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    @property
    def eot_ids(self) -> frozenset:
        """Ids that end generation: EOS, EOT/EOM and known end-of-turn tokens (``<end_of_turn>``...)."""
        return self._eot_ids

    def token_type(self, token_id: int) -> TokenType:
        return TokenType(self.token_types[token_id])

    def is_special(self, token_id: int) -> bool:
        """True for control, unknown and unused tokens (those ``decode(skip_special=True)`` drops)."""
        return self.token_types[token_id] in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.UNUSED)

    def token_to_id(self, text: str) -> Optional[int]:
        return self._vocab.get(text)

    def __repr__(self) -> str:
        return (f"Tokenizer(model={self.model!r}, pre={self.pre!r}, n_vocab={self.n_vocab}, "
                f"bos={self.bos_id}, eos={self.eos_id}, add_bos={self.add_bos})")

    # -- encoding ---------------------------------------------------------------------------------

    def encode(self, text: Union[str, bytes], add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text``. ``add_special`` adds BOS/EOS as the model asks; ``parse_special``
        turns control-token texts in ``text`` (e.g. ``<start_of_turn>``) into those tokens --
        for a rendered chat (a ``ChatPrompt``) only those of the template's own markup.
        ``bytes`` are read as UTF-8; bytes that are not valid UTF-8 become byte tokens."""
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8", "surrogateescape")
        if parse_special and isinstance(text, ChatPrompt):
            return text.token_ids(self, add_special)
        return self._encode_parts(self._partition(text, parse_special), add_special)

    def encode_chat(self, prompt: ChatPrompt, add_special: bool = True) -> list[int]:
        """Token ids of a rendered chat: the template's markup as control tokens, the
        request's strings (messages, tool results and definitions) as plain text."""
        return prompt.token_ids(self, add_special)

    def encode_guarded(self, marked: str, guard: ContentGuard, add_special: bool = True) -> list[int]:
        """Token ids of a chat rendered with ``guard``'s placeholders: control tokens are cut
        where the template wrote them, then each fragment gets its request text back and is
        tokenized without special parsing (user-defined tokens still apply, as in llama.cpp)."""
        parts: list[Union[str, int]] = []
        restored = 0
        for frag in self._partition(marked, True):
            if isinstance(frag, int) or guard.nonce not in frag:
                parts.append(frag)
                continue
            restored += guard.count(frag)
            parts += self._partition(guard.restore(frag), False)
        if restored != guard.count(marked):
            # a control token of the template's ran into a placeholder (no real vocabulary has
            # one that could): nothing of the request may become a control token, so no text does
            return self.encode(guard.restore(marked), add_special, parse_special=False)
        return self._encode_parts(parts, add_special)

    def control_spans(self, text: str) -> list[tuple[int, int]]:
        """(start, end) of each text that special-token parsing would make a control (or
        unknown) token and plain encoding would not, in order."""
        spans, pos = [], 0
        for frag in self._partition(text, True):
            if isinstance(frag, str):
                pos += len(frag)
                continue
            size = len(self.tokens[frag])
            if self.token_types[frag] != TokenType.USER_DEFINED:
                spans.append((pos, pos + size))
            pos += size
        return spans

    def _encode_parts(self, parts: Iterable[Union[str, int]], add_special: bool) -> list[int]:
        """Ids of text fragments and special ids in order, with BOS/EOS when add_special."""
        out: list[int] = []
        if add_special and self.add_bos and self.bos_id is not None:
            out.append(self.bos_id)
        spm = self.model == "llama"
        after_special = True
        for frag in parts:
            if isinstance(frag, int):
                out.append(frag)
                after_special = True
                continue
            if spm:
                if self.add_space_prefix and after_special:
                    frag = " " + frag
                frag = frag.replace(" ", SPACE_MARK)
            out.extend(self._encoder.encode(frag))
            after_special = False
        if add_special and self.add_eos and self.eos_id is not None:
            out.append(self.eos_id)
        return out

    def _special_index(self, parse_special: bool) -> list[tuple[str, Any]]:
        """The special-token texts matched in this mode, grouped by first character: a small
        group is a list of ``(text, id)`` (each looked for with ``str.find``), a big one (e.g.
        Gemma's 6000 ``<unused..>`` tokens) a character trie whose terminal nodes hold the id
        under the key ``""``."""
        if parse_special not in self._special_groups:
            wanted = (TokenType.USER_DEFINED, TokenType.CONTROL, TokenType.UNKNOWN) if parse_special \
                else (TokenType.USER_DEFINED,)
            by_first: dict[str, list[tuple[str, int]]] = {}
            # Select by type in NumPy: a Python loop over a 262k vocabulary made
            # the first request of a process ~0.4 s slower.
            special_ids = np.flatnonzero(np.isin(np.asarray(self.token_types), [int(t) for t in wanted]))
            for tid in special_ids.tolist():
                text = self.tokens[tid]
                if text:
                    by_first.setdefault(text[0], []).append((text, tid))
            groups = []
            for ch, members in by_first.items():
                if len(members) <= 64:
                    groups.append((ch, members))
                    continue
                trie: dict = {}
                for text, tid in members:
                    node = trie
                    for c in text[1:]:
                        node = node.setdefault(c, {})
                    node.setdefault("", tid)
                groups.append((ch, trie))
            self._special_groups[parse_special] = groups
        return self._special_groups[parse_special]

    def _partition(self, text: str, parse_special: bool) -> list[Union[str, int]]:
        """Cut special tokens out of ``text``, as llama.cpp does: special tokens are taken
        longest (in bytes) first, each at every non-overlapping place, leftmost first, where it
        lies wholly in text not already taken by a longer one."""
        if not text:
            return []
        n = len(text)
        present = set()  # special tokens that occur somewhere in the text
        for ch, group in self._special_index(parse_special):
            pos = text.find(ch)
            if pos < 0:
                continue
            if isinstance(group, list):
                present.update(tid for special, tid in group if special in text)
                continue
            while pos >= 0:  # walk the trie from every place the first character occurs
                node, end = group, pos + 1
                while node is not None:
                    tid = node.get("")
                    if tid is not None:
                        present.add(tid)
                    if end >= n:
                        break
                    node = node.get(text[end])
                    end += 1
                pos = text.find(ch, pos + 1)
        if not present:
            return [text]

        def longest_first(tid: int):
            return (-len(self.tokens[tid].encode("utf-8", "surrogateescape")), tid)

        taken = bytearray(n)
        chosen = []
        for tid in sorted(present, key=longest_first):
            special = self.tokens[tid]
            size = len(special)
            pos = text.find(special)
            while pos >= 0:
                blocked = taken.find(1, pos, pos + size)
                if blocked < 0:
                    taken[pos:pos + size] = b"\x01" * size
                    chosen.append((pos, tid))
                    pos = text.find(special, pos + size)
                else:  # overlaps a longer token: resume after that token
                    free = taken.find(0, blocked)
                    pos = -1 if free < 0 else text.find(special, free)
        chosen.sort()
        out: list[Union[str, int]] = []
        pos = 0
        for start, tid in chosen:
            if start > pos:
                out.append(text[pos:start])
            out.append(tid)
            pos = start + len(self.tokens[tid])
        if pos < n:
            out.append(text[pos:])
        return out

    # -- decoding ---------------------------------------------------------------------------------

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """The bytes a token stands for (may be part of a UTF-8 character). Control and unknown
        tokens give their text when ``special`` is true and nothing otherwise."""
        key = (token_id, special)
        piece = self._pieces.get(key)
        if piece is None:
            piece = self._make_piece(token_id, special)
            self._pieces[key] = piece
        return piece

    def _make_piece(self, token_id: int, special: bool) -> bytes:
        if not 0 <= token_id < len(self.tokens):
            raise ValueError(f"token id {token_id} out of range (n_vocab={len(self.tokens)})")
        text = self.tokens[token_id]
        ttype = self.token_types[token_id]
        if ttype in (TokenType.CONTROL, TokenType.UNKNOWN):
            return text.encode("utf-8", "surrogateescape") if special else b""
        if ttype == TokenType.USER_DEFINED:
            return text.encode("utf-8", "surrogateescape")
        if ttype == TokenType.NORMAL:
            if self.model == "bert":
                return self._encoder.piece_text(text).encode("utf-8", "surrogateescape")
            if self.model == "llama":
                return text.replace(SPACE_MARK, " ").encode("utf-8", "surrogateescape")
            return bpe_text_to_bytes(text)
        if ttype == TokenType.BYTE:
            if self.model == "llama":
                return bytes([int(text[3:5], 16)])
            return bpe_text_to_bytes(text)
        return b""  # unused / undefined

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        """Concatenated pieces (see ``decode`` for the space-prefix rule)."""
        strip = (self.model == "llama" and self.add_space_prefix) or self.model == "bert"
        out = bytearray()
        for tid in ids:
            tid = int(tid)
            piece = self.token_to_piece(tid, special=not skip_special)
            if strip and self.token_types[tid] not in (TokenType.CONTROL, TokenType.UNKNOWN):
                if piece.startswith(b" "):
                    piece = piece[1:]
                strip = False
            out += piece
        return bytes(out)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", "replace")


class IncrementalDecoder:
    """Streams text from token ids, holding back bytes of a UTF-8 character until it is whole::

        dec = IncrementalDecoder(tok)
        for tid in generated:
            print(dec.add(tid), end="")
        print(dec.flush())

    No space-prefix stripping is done (the tokens continue a prompt).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """Text that became complete with this token (possibly "")."""
        return self.add_bytes(self.tokenizer.token_to_piece(int(token_id), special=not self.skip_special))

    def add_bytes(self, data: bytes) -> str:
        return self._utf8.decode(data)

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character becomes U+FFFD)."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text

    def reset(self) -> None:
        self._utf8.reset()
