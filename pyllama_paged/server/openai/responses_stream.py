"""The Responses API's server-sent events for one answer, in the order OpenAI sends
them: the response created and in progress; a reasoning item whose one reasoning_text
part grows by deltas (a model that thinks); a message item whose one output_text part
grows by deltas; a function_call item per tool call with its arguments; and the final
response (completed, incomplete or failed)."""

from __future__ import annotations

import json

from ...tools.calls import ToolCall
from ..sse import sse
from .responses_items import (ResponseObject, call_item, message_item, new_id, reasoning_item, reasoning_text,
                              text_part)


class ResponseEvents:
    """Numbers the events and keeps the output items they describe, so the final
    response carries exactly what was streamed."""

    def __init__(self, response: ResponseObject):
        self.response = response
        self.sequence = 0
        self.output: list[dict] = []
        self._message: dict | None = None   # the message item while its text streams
        self._text: list[str] = []
        self._reasoning: dict | None = None   # the reasoning item while the thinking streams
        self._thinking: list[str] = []

    def _event(self, kind: str, **fields) -> str:
        # the event line as OpenAI sends it; clients read the type inside the data too
        data = {"type": kind, **fields, "sequence_number": self.sequence}
        self.sequence += 1
        return sse(data, kind)

    def _item_fields(self, item: dict) -> dict:
        # by identity: the items are dicts that change as they stream
        return {"output_index": next(i for i, o in enumerate(self.output) if o is item), "item_id": item["id"]}

    def start(self) -> list[str]:
        """response.created and response.in_progress."""
        body = self.response.body("in_progress", [])
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def thinking(self, delta: str) -> list[str]:
        """A piece of the thinking (the reasoning item and its part opened first)."""
        events = []
        if self._reasoning is None:
            self._reasoning = reasoning_item(new_id("rs"), None, "in_progress")
            self.output.append(self._reasoning)
            fields = self._item_fields(self._reasoning)
            events += [self._event("response.output_item.added", output_index=fields["output_index"],
                                   item=dict(self._reasoning)),
                       self._event("response.content_part.added", **fields, content_index=0,
                                   part=reasoning_text(""))]
        self._thinking.append(delta)
        events.append(self._event("response.reasoning_text.delta", **self._item_fields(self._reasoning),
                                  content_index=0, delta=delta))
        return events

    def _close_reasoning(self, status: str) -> list[str]:
        """The reasoning item's closing events, once, when the thinking is over."""
        if self._reasoning is None or self._reasoning["status"] != "in_progress":
            return []
        text = "".join(self._thinking)
        fields = self._item_fields(self._reasoning)
        self._reasoning.update(status=status, content=[reasoning_text(text)])
        return [self._event("response.reasoning_text.done", **fields, content_index=0, text=text),
                self._event("response.content_part.done", **fields, content_index=0, part=reasoning_text(text)),
                self._event("response.output_item.done", output_index=fields["output_index"], item=self._reasoning)]

    def text(self, delta: str) -> list[str]:
        """A piece of the answer's text (the thinking closed, the message item and its part
        opened first)."""
        events = [] if self._message is not None else self._close_reasoning("completed") + self._open_message()
        if delta:
            self._text.append(delta)
            events.append(self._event("response.output_text.delta", **self._item_fields(self._message),
                                      content_index=0, delta=delta, logprobs=[]))
        return events

    def _open_message(self) -> list[str]:
        self._message = message_item(new_id("msg"), None, "in_progress")
        self.output.append(self._message)
        fields = self._item_fields(self._message)
        return [self._event("response.output_item.added", output_index=fields["output_index"],
                            item=dict(self._message)),
                self._event("response.content_part.added", **fields, content_index=0, part=text_part(""))]

    def finish(self, calls: list[ToolCall], status: str, usage: dict) -> tuple[list[str], dict]:
        """The events that close the answer, and the final response object. An answer with
        neither text nor calls still gets its (empty) message, as the non-streamed one does."""
        events = self._close_reasoning(status)
        events += self._open_message() if self._message is None and not calls else []
        if self._message is not None:
            text = "".join(self._text)
            fields = self._item_fields(self._message)
            self._message.update(status=status, content=[text_part(text)])
            events += [self._event("response.output_text.done", **fields, content_index=0, text=text, logprobs=[]),
                       self._event("response.content_part.done", **fields, content_index=0, part=text_part(text)),
                       self._event("response.output_item.done", output_index=fields["output_index"],
                                   item=self._message)]
        for call in calls:
            item = call_item(new_id("fc"), call, "in_progress", arguments="")
            self.output.append(item)
            fields = self._item_fields(item)
            arguments = json.dumps(call.arguments)
            events.append(self._event("response.output_item.added", output_index=fields["output_index"],
                                      item=dict(item)))
            events.append(self._event("response.function_call_arguments.delta", **fields, delta=arguments))
            events.append(self._event("response.function_call_arguments.done", **fields, name=call.name,
                                      arguments=arguments))
            item.update(status="completed", arguments=arguments)
            events.append(self._event("response.output_item.done", output_index=fields["output_index"], item=item))
        body = self.response.body(status, self.output, usage)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return events + [self._event(kind, response=body)], body

    def fail(self, code: str, message: str) -> str:
        """response.failed, for an error after the stream began (the 200 was already sent)."""
        body = self.response.body("failed", self.output, error={"code": code, "message": message})
        return self._event("response.failed", response=body)
