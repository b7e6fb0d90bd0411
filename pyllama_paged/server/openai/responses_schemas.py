"""The OpenAI Responses API request body (POST /v1/responses). As on the other
OpenAI routes, every field the reference lets be null may be, and what we cannot
honour is a 400 that says so rather than being silently ignored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ...calls.chat_call import ChatCall
from ...calls.sampling_options import OPENAI
from ...constrain.formats import from_openai
from ...constrain.grammar import Constraint
from ...tokenizer.tokenizer import Tokenizer
from ...tools.reasoning import template_thinks
from ..generation import APIError
from .schemas import JsonSchemaFormat, ThinkingBudgetFields

# the include values that only concern logprobs we do not compute here; every other value
# names output of hosted tools or encrypted reasoning, which this server never produces
_LOGPROBS_INCLUDE = "message.output_text.logprobs"

# OpenAI's bounds on metadata (16 pairs, keys of 64 characters, values of 512); `user` has
# none documented, and a stored response keeps it, so it gets the length of an identifier
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
USER_CHARS = 256


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class ResponseTool(_Loose):
    """A tool as the Responses API declares it: a function's fields at the top level."""
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat(self) -> dict:
        """The Chat Completions shape tools/prompt.py reads."""
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": {k: v for k, v in fn.items() if v is not None}}


class TextFormat(JsonSchemaFormat):
    """text.format: Chat's json_schema fields, flattened beside the type."""
    type: str


class TextConfig(_Loose):
    format: TextFormat | None = None
    verbosity: str | None = None   # a hint about length; a model without the notion may ignore it


class ResponsesRequest(ThinkingBudgetFields):
    # strict: the types the schema says (true is not the integer 1, "5" is not a number)
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool | None = False
    tools: list[ResponseTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    metadata: dict[str, str] | None = None
    user: str | None = Field(None, max_length=USER_CHARS)
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    truncation: Literal["auto", "disabled"] | None = None
    # not OpenAI's here, but the chat route's (llama-server's, vLLM's): clients pass them through extra_body
    seed: int | None = None
    ignore_eos: bool | None = None   # generate to max_output_tokens
    # what we cannot honour: named so that asking for it is a 400, not silently ignored
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if metadata is None:
            return None
        if len(metadata) > METADATA_PAIRS:
            raise ValueError(f"metadata may hold at most {METADATA_PAIRS} pairs, got {len(metadata)}")
        for key, value in metadata.items():
            if len(key) > METADATA_KEY_CHARS:
                raise ValueError(f"metadata keys may be at most {METADATA_KEY_CHARS} characters ({key[:20]!r}...)")
            if len(value) > METADATA_VALUE_CHARS:
                raise ValueError(f"metadata[{key!r}] may be at most {METADATA_VALUE_CHARS} characters, "
                                 f"got {len(value)}")
        return metadata

    def thinking(self) -> bool | None:
        """reasoning.effort as the template's switch: "none" off, an effort on; absent, the
        template's default."""
        effort = (self.reasoning or {}).get("effort")
        return None if effort is None else effort != "none"

    def refuse_unsupported(self, thinks: bool = False) -> None:
        """A 400 for fields we would otherwise silently ignore (thinks: the model can reason)."""
        if self.background:
            raise APIError(400, "background responses are not supported: use stream or wait for the answer",
                           "background")
        for name in ("conversation", "prompt"):
            if getattr(self, name) is not None:
                raise APIError(400, f"{name} is not supported: send the input (and previous_response_id)", name)
        if (self.reasoning or {}).get("effort") not in (None, "none", "minimal") and not thinks:
            raise APIError(400, "reasoning.effort: this model does not reason (think)", "reasoning")
        if self.truncation == "auto":
            raise APIError(400, "truncation 'auto' is not supported: a conversation longer than the context "
                           "is a 400", "truncation")
        if self.top_logprobs or _LOGPROBS_INCLUDE in (self.include or ()):
            raise APIError(400, "logprobs are not supported on /v1/responses (use /v1/chat/completions)",
                           "top_logprobs" if self.top_logprobs else "include")
        for i, tool in enumerate(self.tools or ()):
            if tool.type != "function":
                raise APIError(400, f"tools[{i}]: type '{tool.type}' is not supported: only function tools "
                               "(hosted tools need OpenAI's servers)", "tools")
            if not tool.name:
                raise APIError(400, f"tools[{i}] must have a name", "tools")
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type not in ("text", "json_object", "json_schema"):
            raise APIError(400, f"text.format.type '{fmt.type}' is not one of text, json_object, json_schema",
                           "text.format")
        if fmt is not None and fmt.type == "json_schema" and fmt.schema_ is None:
            raise APIError(400, "text.format of type json_schema needs a schema", "text.format")

    def chat_tools(self) -> list[dict] | None:
        """The tools in the Chat Completions shape, or None."""
        return [t.chat() for t in self.tools] if self.tools else None

    def chat_tool_choice(self) -> str | dict | None:
        """tool_choice in the Chat Completions shape ({"type": "function", "name"} names a function)."""
        choice = self.tool_choice
        if not isinstance(choice, dict):
            return choice
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", "
                           "\"name\": ...}", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}

    def format_spec(self) -> dict[str, Any] | None:
        """text.format as Chat's response_format, the shape constrain.formats reads."""
        fmt = self.text.format if self.text else None
        if fmt is None or fmt.type != "json_schema":
            return {"type": fmt.type} if fmt else None
        return {"type": "json_schema", "json_schema": {"schema": fmt.schema_}}

    def constraint(self, tokenizer: Tokenizer) -> Constraint | None:
        """The structured output asked for, if any; ConstraintError (a 400) when it cannot be."""
        return from_openai(tokenizer, self.format_spec())

    def chat_call(self, messages: list[dict]) -> ChatCall:
        """The request as the server's chat path takes it, its input (and the conversation
        before it) already as chat messages (an unset max_output_tokens: the server's cap)."""
        return ChatCall(
            messages=messages, tools=self.chat_tools(), tool_choice=self.chat_tool_choice(),
            structured=self.constraint, surface=OPENAI,
            sampling={"max_tokens": self.max_output_tokens, "temperature": self.temperature, "top_p": self.top_p,
                      "seed": self.seed, "ignore_eos": self.ignore_eos},
            model=self.model, thinking=self.thinking(),
            reasoning_effort=(self.reasoning or {}).get("effort"), thinking_budget=self.thinking_budget(),
            limit_fields={"messages": self.input if isinstance(self.input, list) else None, "tools": self.tools,
                          "grammars": {"text.format": self.format_spec()}},
            refuse_unsupported=lambda served: self.refuse_unsupported(template_thinks(served.template.source)),
            messages_param="input")

    def echo(self) -> dict[str, Any]:
        """The request's settings as the response object repeats them."""
        fmt = self.text.format.model_dump(by_alias=True, exclude_none=True) if self.text and self.text.format \
            else {"type": "text"}
        return {"instructions": self.instructions, "max_output_tokens": self.max_output_tokens,
                "temperature": 1.0 if self.temperature is None else self.temperature,
                "top_p": 1.0 if self.top_p is None else self.top_p,
                "tools": [t.model_dump(exclude_none=True) for t in self.tools or ()],
                "tool_choice": self.tool_choice or "auto",
                "parallel_tool_calls": True if self.parallel_tool_calls is None else self.parallel_tool_calls,
                "text": {"format": fmt}, "previous_response_id": self.previous_response_id,
                "store": self.store is not False, "metadata": self.metadata or {}, "user": self.user,
                "truncation": "disabled",
                "reasoning": {"effort": (self.reasoning or {}).get("effort"), "summary": None}}
