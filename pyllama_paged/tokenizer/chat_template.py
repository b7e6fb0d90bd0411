"""Chat prompts: the GGUF's own Jinja template when it has one, else a
built-in template for the architecture (the default Gemma 3 file has none).

Request text never becomes control tokens. A template renders markup (``<start_of_turn>``,
``<|im_end|>``...) around strings the client sent: message content, tool results, tool
definitions, call arguments. Tokenizing the rendered text with special-token parsing would
turn a user's literal ``<end_of_turn>`` into the control token and let them forge turns. So
``render`` returns a ``ChatPrompt``: the text, which can render itself a second time with
every control-token text inside those strings swapped for a placeholder; that text is cut at
the template's own control tokens, and only then are the placeholders put back, in fragments
tokenized without special parsing. Strings holding no control-token text are not touched, so
the template sees the very same values and the tokens are the ones it always gave.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from typing import Any, Callable

import jinja2

from ..errors import ModelLoadError, PagedError
from . import render_pool
from .template_sandbox import check_syntax

Escape = Callable[[Any], Any]

# A string that still holds control-token text after this many passes is left as it is
# (each pass swaps every occurrence found; a second pass is only ever needed when a
# placeholder happens to complete another token, which no real vocabulary does).
_MAX_PASSES = 8

def no_escape(value: Any) -> Any:
    """The identity: what a plain (unguarded) render passes its strings through."""
    return value


class ContentGuard:
    """Swaps control-token texts inside request strings for placeholders, for one render."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # A placeholder is the nonce, a fixed-width index (unambiguous when two are adjacent)
        # and \x01: no whitespace, so trim/strip see the string as before, and a character
        # JSON escapes, so one that went through the template's tojson is told apart (and
        # gets its text back JSON-escaped, as tojson would have written it).
        self.nonce = "".join(secrets.choice(string.ascii_lowercase) for _ in range(24))
        self._placeholder = re.compile(self.nonce + r"(\d{8})(\x01|\\u0001)")
        self.literals: list[str] = []

    def escape(self, value: Any) -> Any:
        """value with control-token texts in every string (dict keys included) swapped out."""
        if isinstance(value, str):
            return self._escape_text(value)
        if isinstance(value, dict):
            return {self.escape(k): self.escape(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.escape(v) for v in value)
        return value

    def _escape_text(self, text: str) -> str:
        for _ in range(_MAX_PASSES):
            spans = self.tokenizer.control_spans(text)
            if not spans:
                break
            pieces, pos = [], 0
            for start, end in spans:
                pieces += [text[pos:start], f"{self.nonce}{len(self.literals):08d}\x01"]
                self.literals.append(text[start:end])
                pos = end
            pieces.append(text[pos:])
            text = "".join(pieces)
        return text

    def count(self, text: str) -> int:
        """How many placeholders text holds."""
        return text.count(self.nonce)

    def restore(self, text: str) -> str:
        """text with the placeholders' original texts put back."""
        for _ in range(_MAX_PASSES):   # a literal may itself hold a placeholder of an earlier pass
            if self.nonce not in text:
                break
            text = self._placeholder.sub(self._literal, text)
        return text

    def _literal(self, match: "re.Match[str]") -> str:
        index = int(match.group(1))
        if index >= len(self.literals):
            return match.group(0)
        if match.group(2) == "\x01":
            return self.literals[index]
        return _tojson_text(self.literals[index])


def _tojson_text(text: str) -> str:
    """text inside a JSON string as Jinja's tojson writes it (HTML-safe)."""
    quoted = json.dumps(text)[1:-1]
    return (quoted.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("'", "\\u0027"))


class ChatPrompt(str):
    """The rendered prompt text (a ``str``: everything that took the old text still works),
    plus ``token_ids``: the tokens with only the template's own markup parsed as control
    tokens. ``Tokenizer.encode(prompt, parse_special=True)`` calls ``token_ids`` itself.
    Any string operation on it gives a plain ``str``, which tokenizes as before."""

    _render: Callable[[Escape], str]

    def __new__(cls, text: str, render: Callable[[Escape], str]):
        self = super().__new__(cls, text)
        self._render = render   # render(escape): the same prompt, request strings through escape
        return self

    def token_ids(self, tokenizer, add_special: bool = True) -> list[int]:
        """Token ids of the prompt: BOS/EOS per the model when add_special; control-token
        texts only from the template, never from the request's strings."""
        guard = ContentGuard(tokenizer)
        marked = self._render(guard.escape)
        if not guard.literals:   # nothing to keep out: exactly the old tokens
            return tokenizer.encode(str(self), add_special=add_special, parse_special=True)
        return tokenizer.encode_guarded(marked, guard, add_special=add_special)


# Literal text is emitted through {{ '...' }} so whitespace control never eats newlines.
# Gemma: system text is folded into the first user turn; the assistant role is "model".
GEMMA_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{%- set ns.system = ns.system + m['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{%- if role == 'user' and ns.system -%}{{ ns.system }}{%- set ns.system = '' -%}{%- endif -%}"
    "{{ m['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

CHATML_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)

LLAMA3_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + (m['content'] | trim) + '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif -%}"
)

LLAMA2_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'system' -%}{%- set ns.system = '<<SYS>>\n' + m['content'] + '\n<</SYS>>\n\n' -%}"
    "{%- elif m['role'] == 'user' -%}{{ '[INST] ' + ns.system + (m['content'] | trim) + ' [/INST]' }}"
    "{%- set ns.system = '' -%}"
    "{%- else -%}{{ ' ' + (m['content'] | trim) + ' </s>' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def builtin_template(arch: str, tokens: list[str] | None) -> str:
    """The built-in template for an architecture (and vocabulary) without one."""
    vocab = set(tokens or ())
    if arch == "gemma3" or "<start_of_turn>" in vocab:
        return GEMMA_TEMPLATE
    if "<|im_start|>" in vocab:
        return CHATML_TEMPLATE
    if "<|start_header_id|>" in vocab:
        return LLAMA3_TEMPLATE
    return LLAMA2_TEMPLATE


BUILTIN_TEMPLATES = frozenset([GEMMA_TEMPLATE, CHATML_TEMPLATE, LLAMA3_TEMPLATE, LLAMA2_TEMPLATE])


class ChatTemplate:
    """Renders a message list to the prompt text the model was trained on. A template is
    untrusted input (it came with a GGUF): it renders in a renderer process
    (``render_pool``); only this package's own templates render in this process."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        check_syntax(source)   # parsed only: compiling runs constant parts, which is the renderer's job
        self.source = source
        self.bos_token, self.eos_token = bos_token, eos_token
        self.trusted = source in BUILTIN_TEMPLATES

    @classmethod
    def for_model(cls, metadata: dict, arch: str) -> "ChatTemplate":
        """The file's template, or the built-in one for its architecture."""
        tokens = metadata.get("tokenizer.ggml.tokens")
        source = metadata.get("tokenizer.chat_template")
        if source is not None and not isinstance(source, str):
            raise ModelLoadError("metadata field 'tokenizer.chat_template' must be a string")
        if not source:
            return cls(builtin_template(arch, tokens if isinstance(tokens, list) else None))
        try:
            return cls(source)
        except jinja2.TemplateError as e:  # a syntax error: the file's template cannot be used
            raise ModelLoadError(f"metadata field 'tokenizer.chat_template' does not parse: {e}") from e

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, variables: dict | None = None) -> ChatPrompt:
        """Prompt text for messages (the tokenizer adds BOS itself); tools, when given, are
        passed to the template as transformers passes them. The text is a ``ChatPrompt``:
        ``tokenizer.encode(text, parse_special=True)`` parses control tokens only where the
        template put them, never inside message content or tools. variables are further names
        the template reads (e.g. Qwen3's ``enable_thinking``)."""
        return self.render_with(lambda escape: (escape(messages), escape(tools) if tools else None),
                                add_generation_prompt, variables)

    def render_with(self, inputs: Callable[[Escape], tuple[list[dict], list[dict] | None]],
                    add_generation_prompt: bool = True, variables: dict | None = None) -> ChatPrompt:
        """Render ``inputs(escape)``: (messages, tools) built with every string the request
        supplied passed through escape (markup of our own, e.g. a tool call written out as
        text, is left out of it so that it keeps its control tokens)."""
        messages, tools = inputs(no_escape)
        self._check(messages)
        text = self._render_text(messages, tools, add_generation_prompt, variables)
        return ChatPrompt(text, lambda escape: self._render_text(*inputs(escape), add_generation_prompt, variables))

    @staticmethod
    def _check(messages: list[dict]) -> None:
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise PagedError(f"messages[{i}] must be an object with 'role' and 'content'")
            if m["role"] not in ("system", "user", "assistant", "tool"):
                raise PagedError(f"messages[{i}].role '{m['role']}' is not one of system, user, assistant, tool")
            if not isinstance(m["content"], str):
                raise PagedError(f"messages[{i}].content must be a string")

    def _render_text(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool,
                     variables: dict | None = None) -> str:
        # the template's own names win over a caller's variables of the same name
        names = {**(variables or {}), **({"tools": tools} if tools else {}), "messages": messages,
                 "add_generation_prompt": add_generation_prompt, "bos_token": "", "eos_token": self.eos_token}
        renderer = render_pool.trusted_renderer() if self.trusted else render_pool.renderer()
        return renderer.render(self.source, names)
