"""Tokenizer built from GGUF metadata; agrees token for token with llama.cpp.

These vocabulary kinds are supported, chosen by ``tokenizer.ggml.model``:

* ``"llama"``: SentencePiece style (Llama 2, Mistral, TinyLlama, Gemma). Spaces become ``▁``,
  pieces merge by score, unknown characters fall back to ``<0xXX>`` byte tokens. A space is put
  in front of the text (and after every special token) when ``tokenizer.ggml.add_space_prefix``
  says so; that flag defaults to true, as in llama.cpp (Gemma 3 sets it to false).
  See ``spm``.
* ``"gpt2"``: byte-level BPE (Llama 3, Qwen 2, SmolLM, GPT-2), with the pre-tokenizer regexes
  named by ``tokenizer.ggml.pre``. See ``bpe``.
* ``"gemma4"``: Gemma 4's merge-rank BPE over SentencePiece-style text (spaces as ``▁``, byte
  tokens ``<0xXX>``), always with a BOS. See ``gemma4_bpe``.

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

The GGUF metadata is read and checked in ``vocab`` (``Tokenizer.from_gguf`` accepts what
``read_tokenizer_metadata`` does: a path, a ``gguf.GGUFReader``, an object with a ``metadata``
dict, or a metadata dict); this module encodes and decodes.
"""

from __future__ import annotations

import codecs
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

from .bpe import BpeEncoder, bpe_text_to_bytes, pre_tokenizer_family, pre_tokenizer_flags
from .chat_template import ChatPrompt, ContentGuard
from .gemma4_bpe import Gemma4Encoder
from .special import SpecialTokens
from .spm import SPACE_MARK, SpmEncoder
from .vocab import TokenType, Vocab, as_text, end_of_generation, read_tokenizer_metadata, vocab_from_metadata
from .wordpiece import WordPieceEncoder

__all__ = ["TokenType", "Tokenizer", "IncrementalDecoder"]


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
        self.tokens: list[str] = [as_text(t) for t in tokens]
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

        self.eot_id, self.eom_id, self._eot_ids = end_of_generation(
            self._vocab, types, self.eos_id, self.eot_id, self.eom_id)
        self.token_types: list[int] = types

        self._choose_encoder(model, pre, merges, add_bos, add_eos, add_space_prefix, ignore_merges)

        self._special = SpecialTokens(self.tokens, self.token_types)
        self._pieces: dict[tuple[int, bool], bytes] = {}

    def _choose_encoder(self, model, pre, merges, add_bos, add_eos, add_space_prefix, ignore_merges) -> None:
        """The tokenizer model's encoder and its BOS/EOS/space-prefix defaults (the file's flags win)."""
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
        elif model == "gemma4":
            # SentencePiece-style text under merge ranks (gemma4_bpe); llama.cpp adds the BOS
            # even where the file says not to
            self.model = "gemma4"
            self.pre = pre
            self.add_bos = True
            self.add_eos = False if add_eos is None else bool(add_eos)
            self.add_space_prefix = False
            self._encoder = Gemma4Encoder(self._vocab, merges or [])
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
            raise NotImplementedError(f"tokenizer model {model!r} is not supported (only 'llama', 'gpt2', "
                                      "'gemma4' and 'bert')")

    # -- construction from GGUF -----------------------------------------------------------------

    @classmethod
    def from_gguf(cls, source) -> "Tokenizer":
        """From a GGUF path, a ``gguf.GGUFReader``, an object with a ``metadata`` dict (our
        ``GGUFFile``) or a metadata dict."""
        return cls.from_metadata(read_tokenizer_metadata(source))

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any]) -> "Tokenizer":
        """From GGUF metadata. A missing or mistyped field (e.g. scores that are strings, or
        fewer token types than tokens) raises ``ModelLoadError`` (a ``ValueError``) naming it."""
        return cls.from_vocab(vocab_from_metadata(md))

    @classmethod
    def from_vocab(cls, vocab: Vocab) -> "Tokenizer":
        """From a vocabulary read from GGUF metadata."""
        return cls(vocab.tokens, vocab.scores, vocab.token_types, vocab.merges, model=vocab.model,
                   pre=vocab.pre, bos_id=vocab.bos_id, eos_id=vocab.eos_id, unk_id=vocab.unk_id,
                   eot_id=vocab.eot_id, eom_id=vocab.eom_id, pad_id=vocab.pad_id, add_bos=vocab.add_bos,
                   add_eos=vocab.add_eos, add_space_prefix=vocab.add_space_prefix)

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

    # (marker text, token id) of a vision model's images (vision/prompt_images.py): the marker is
    # a per-process secret a message's image leaves in its text, which becomes the image's begin
    # token wherever it is tokenized (through the chat guard too, which it does not look like)
    media_marker: Optional[tuple[str, int]] = None

    def _with_media(self, parts: Iterable[Union[str, int]]) -> Iterable[Union[str, int]]:
        marker, token = self.media_marker
        for frag in parts:
            if isinstance(frag, int) or marker not in frag:
                yield frag
                continue
            pieces = frag.split(marker)
            for k, piece in enumerate(pieces):
                if k:
                    yield token
                if piece:
                    yield piece

    def _encode_parts(self, parts: Iterable[Union[str, int]], add_special: bool) -> list[int]:
        """Ids of text fragments and special ids in order, with BOS/EOS when add_special."""
        if self.media_marker is not None:
            parts = self._with_media(parts)
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

    def _partition(self, text: str, parse_special: bool) -> list[Union[str, int]]:
        """``text`` as plain text fragments and the ids of the special tokens cut out of it."""
        return self._special.split(text, parse_special)

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
            if self.model in ("llama", "gemma4"):
                return text.replace(SPACE_MARK, " ").encode("utf-8", "surrogateescape")
            return bpe_text_to_bytes(text)
        if ttype == TokenType.BYTE:
            if self.model in ("llama", "gemma4"):
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
