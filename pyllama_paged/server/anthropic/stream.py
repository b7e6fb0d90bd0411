"""Anthropic's server-sent events for one streamed answer: message_start, a thinking
block (a model that thinks, when asked), a text block opened on the first text,
tool_use blocks when the answer ends, then message_delta (stop reason, usage) and
message_stop."""

from __future__ import annotations

import json

from ...tools.calls import ToolCall
from ..sse import sse as sse_event
from .messages import stop_reason, tool_use_block


def sse(data: dict) -> str:
    """One event: Anthropic names each event after its data's type."""
    return sse_event(data, data["type"])


class AnswerEvents:
    """Turns an answer, as its text and then its tool calls come (AnswerPiece), into
    Anthropic's event sequence."""

    def __init__(self, message: dict):
        self.message = message   # id, type, role, model, usage (the prompt's tokens)
        self.index = 0           # the index of the block being written (or the next one)
        self.text_open = False
        self.thinking_open = False

    def start(self) -> list[str]:
        """message_start (the message with no content yet) and a ping, sent before the
        first token: a client sees the answer begin while the prompt is read."""
        empty = {**self.message, "content": [], "stop_reason": None, "stop_sequence": None}
        return [sse({"type": "message_start", "message": empty}), sse({"type": "ping"})]

    def _text(self, text: str) -> list[str]:
        out = self._end_thinking()
        if not self.text_open:
            self.text_open = True
            out.append(sse({"type": "content_block_start", "index": self.index,
                            "content_block": {"type": "text", "text": ""}}))
        if text:
            out.append(sse({"type": "content_block_delta", "index": self.index,
                            "delta": {"type": "text_delta", "text": text}}))
        return out

    def _close(self) -> list[str]:
        self.index += 1
        return [sse({"type": "content_block_stop", "index": self.index - 1})]

    def feed(self, text: str) -> list[str]:
        """Events for a piece of the answer's text (none for no text)."""
        return self._text(text) if text else []

    def think(self, thinking: str | None) -> list[str]:
        """Events for a piece of the answer's thinking, in a thinking block before the text
        (None: nothing to show; "": the block, its text left out)."""
        if thinking is None:
            return []
        out = []
        if not self.thinking_open:
            self.thinking_open = True
            out.append(sse({"type": "content_block_start", "index": self.index,
                            "content_block": {"type": "thinking", "thinking": "", "signature": ""}}))
        if thinking:
            out.append(sse({"type": "content_block_delta", "index": self.index,
                            "delta": {"type": "thinking_delta", "thinking": thinking}}))
        return out

    def _end_thinking(self) -> list[str]:
        if not self.thinking_open:
            return []
        self.thinking_open = False
        return [sse({"type": "content_block_delta", "index": self.index,
                     "delta": {"type": "signature_delta", "signature": ""}})] + self._close()

    def end(self, calls: list[ToolCall], finish: str | None, stop: str | None, output_tokens: int) -> list[str]:
        """The closing events: each tool_use block, the stop reason and usage (an answer with
        neither text nor calls still gets its empty text block)."""
        out = self._text("") if not (calls or self.text_open) else self._end_thinking()
        if self.text_open:
            self.text_open = False
            out += self._close()
        for call in calls:
            block = tool_use_block(call)
            # the input comes as JSON text in deltas, after a start block whose input is empty
            out.append(sse({"type": "content_block_start", "index": self.index,
                            "content_block": {**block, "input": {}}}))
            out.append(sse({"type": "content_block_delta", "index": self.index,
                            "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}}))
            out += self._close()
        reason, sequence = stop_reason(finish, stop, calls)
        usage = {**self.message["usage"], "output_tokens": output_tokens}
        out.append(sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": usage}))
        out.append(sse({"type": "message_stop"}))
        return out
