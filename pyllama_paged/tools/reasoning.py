"""A reasoning model's thinking apart from its answer: Qwen3's and DeepSeek-R1's
`<think>...</think>` and Gemma 4's `<|channel>thought...<channel|>` (gemma4.py) split out of the
generated text, whole or one delta at a time (gpt-oss's harmony channels are read in
harmony.py; which way a model writes is told here).

Clients look for the thinking in its own field (Ollama's `message.thinking`, OpenAI-style
`reasoning_content`, Responses' reasoning items, Anthropic's `thinking` blocks), so the split
happens once, on the text the model writes, before any dialect renders it."""

from __future__ import annotations

from dataclasses import dataclass

from .gemma4 import THOUGHT_CLOSE, THOUGHT_OPEN

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
# each way a reply opens its thinking, and what closes it: told apart by the reply itself
THINK_BLOCKS = {THINK_OPEN: THINK_CLOSE, THOUGHT_OPEN: THOUGHT_CLOSE}
# Gemma 4's thinking switch at the head of its system turn
GEMMA4_THINK = "<|think|>"


# The mark of gpt-oss's harmony format: its templates write every message's channel after it,
# which no other family's does (llama.cpp tells gpt-oss's templates by the same text).
HARMONY_CHANNEL = "<|channel|>"
# The efforts gpt-oss's template reads as reasoning_effort (it has no "off").
HARMONY_EFFORTS = ("low", "medium", "high")


# A reasoning effort as a thinking budget, on a model that writes think blocks (gpt-oss's
# template reads the effort itself): Ollama's think levels, OpenAI's reasoning_effort and the
# Responses API's reasoning.effort. "high" sets none of its own (the server's, if any).
EFFORT_BUDGETS = {"minimal": 256, "low": 1024, "medium": 4096}


def budget_tokens(asked: int | None, effort: str | None, default: int | None = None) -> int | None:
    """A request's thinking budget in tokens: the one it asked for, else its effort's, else
    default (the server's --reasoning-budget); None or a negative number: no budget."""
    for tokens in (asked, EFFORT_BUDGETS.get(effort or ""), default):
        if tokens is not None:
            return tokens if tokens >= 0 else None
    return None


def speaks_harmony(template_source: str) -> bool:
    """Whether a chat template writes harmony (gpt-oss): the reply's channels are read, not think tags."""
    return HARMONY_CHANNEL in template_source


def template_thinks(template_source: str) -> bool:
    """Whether a chat template knows a think block (renders, strips or switches it), or
    speaks harmony, whose analysis channel is the thinking."""
    return (THINK_CLOSE in template_source or "enable_thinking" in template_source
            or GEMMA4_THINK in template_source or speaks_harmony(template_source))


def thinking_variables(template_source: str, thinking: bool | None, effort: str | None) -> dict | None:
    """The template variables that carry a request's thinking switch (None: the template's
    default): Qwen3's enable_thinking, or for harmony the effort (low, medium, high) as
    gpt-oss's reasoning_effort. gpt-oss always writes its analysis, so a harmony template
    takes no switch: thinking off (think: false, effort "none") keeps its default effort, as
    Ollama does, and the analysis still comes back as thinking."""
    if speaks_harmony(template_source):
        return {"reasoning_effort": effort} if effort in HARMONY_EFFORTS else None
    if thinking is not None and template_thinks(template_source):
        return {"enable_thinking": thinking}
    return None


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether the rendered prompt leaves the reply inside an open think block.

    DeepSeek-R1's distills (and Qwen3's templates in some versions) end the generation prompt
    with `<think>\\n`: the model then writes its thinking with no opening tag of its own."""
    start = prompt.rfind(THINK_OPEN)
    return start >= 0 and prompt.find(THINK_CLOSE, start) < 0


@dataclass
class ReasoningDelta:
    """What one piece of generated text adds to the thinking and to the answer."""

    thinking: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.thinking or self.content)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of text that could be the start of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """Splits a reply, delta by delta, into thinking and answer.

    A think block (`<think>`, or Gemma 4's `<|channel>thought`, each closed by its own tag) is
    recognised only at the start of the reply (after whitespace) or, when the prompt opened a
    `<think>`, from the first token: an opening the model writes later in its answer is
    answer text. Text that might be the start of a tag is held back until the next delta says
    which it is, so every way of cutting the reply into deltas gives the same two strings.
    Whitespace between the block and the answer, and at the block's edges, is dropped."""

    def __init__(self, in_thinking: bool = False):
        self._state = "thinking" if in_thinking else "start"
        self._close = THINK_CLOSE
        self._held = ""
        self._thinking_started = False

    @property
    def in_thinking(self) -> bool:
        """Whether the reply is inside its think block now."""
        return self._state == "thinking"

    def feed(self, text: str) -> ReasoningDelta:
        """The thinking and answer text that this delta makes certain."""
        out = ReasoningDelta()
        self._held += text
        while self._held:
            if self._state == "start":
                stripped = self._held.lstrip()
                opening = next((o for o in THINK_BLOCKS if stripped.startswith(o)), None)
                if opening is not None:
                    self._held, self._close = stripped[len(opening):], THINK_BLOCKS[opening]
                    self._state = "thinking"
                elif not stripped or any(o.startswith(stripped) for o in THINK_BLOCKS):
                    return out   # still could open a think block: wait for more
                else:
                    self._state = "answer"
            elif self._state == "thinking":
                end = self._held.find(self._close)
                if end >= 0:
                    out.thinking += self._thinking_text(self._held[:end].rstrip())
                    self._held = self._held[end + len(self._close):]
                    self._state = "after"
                    continue
                keep = _partial_suffix(self._held, self._close)
                body = self._held[:len(self._held) - keep]
                # trailing whitespace waits: it is dropped if the block closes right after it
                certain = body.rstrip()
                out.thinking += self._thinking_text(certain)
                self._held = self._held[len(certain):]
                return out
            elif self._state == "after":
                stripped = self._held.lstrip()
                if not stripped:
                    self._held = ""
                    return out
                self._held = stripped
                self._state = "answer"
            else:
                out.content += self._held
                self._held = ""
        return out

    def _thinking_text(self, text: str) -> str:
        if not self._thinking_started:
            text = text.lstrip()
            self._thinking_started = bool(text)
        return text

    def finish(self) -> ReasoningDelta:
        """What is still held when the reply ends (an unclosed block is all thinking)."""
        held, self._held = self._held, ""
        if self._state == "thinking":
            return ReasoningDelta(thinking=self._thinking_text(held.rstrip()))
        if self._state == "after":
            return ReasoningDelta()
        return ReasoningDelta(content=held)


def split_reasoning(text: str, in_thinking: bool = False) -> tuple[str, str]:
    """(thinking, answer) of a whole reply."""
    splitter = ReasoningSplitter(in_thinking)
    first, last = splitter.feed(text), splitter.finish()
    return first.thinking + last.thinking, first.content + last.content
