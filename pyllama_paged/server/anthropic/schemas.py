"""Anthropic Messages API request bodies (POST /v1/messages). Fields Anthropic
documents but we cannot honour are named so that asking for them is a 400 rather
than silently ignored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ...constrain.grammar import Constraint, compile_constraint
from ...tokenizer.tokenizer import Tokenizer
from ..generation import APIError


class _Strict(BaseModel):
    # strict: the types the reference says (true is not the integer 1); unknown fields ignored,
    # as Anthropic adds optional ones (cache_control, citations) that change nothing here
    model_config = ConfigDict(extra="ignore", strict=True)


class Block(BaseModel):
    """A content block of any type; which fields a type needs is checked when it is read
    (anthropic_messages), so that the error names the block and what it lacks."""
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None
    id: str | None = None            # tool_use
    name: str | None = None          # tool_use
    input: dict[str, Any] | None = None       # tool_use
    tool_use_id: str | None = None   # tool_result
    content: str | list[dict[str, Any]] | None = None   # tool_result
    is_error: bool | None = None     # tool_result


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolDef(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None   # "custom"; Anthropic's server tools (web search, ...) are refused


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    effort: str | None = None   # how long to think: this model does not think, so nothing to set
    format: OutputFormat | None = None   # structured output: the answer held to the schema


class MessagesRequest(_Strict):
    model: str
    max_tokens: int = Field(ge=1)   # required, as Anthropic requires it
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool | None = False
    metadata: dict[str, Any] | None = None   # user_id: for Anthropic's abuse checks, nothing to do here
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    service_tier: str | None = None          # one tier here: accepted, nothing to choose
    output_config: OutputConfig | None = None
    # {"type": "enabled", "budget_tokens": N} (past N thinking tokens the think block is
    # closed), "disabled" or "adaptive"; display "omitted" leaves the thinking's text out
    thinking: dict[str, Any] | None = None
    # what we cannot honour: named so that asking for it is a 400
    mcp_servers: list[dict[str, Any]] | None = None
    container: str | dict[str, Any] | None = None

    def thinking_switch(self) -> bool | None:
        """thinking as the template's switch: enabled on, adaptive the template's default,
        disabled or absent off (Claude thinks only when asked)."""
        kind = (self.thinking or {}).get("type", "disabled")
        return None if kind == "adaptive" else kind == "enabled"

    def thinking_budget(self) -> int | None:
        """thinking.budget_tokens of enabled thinking (None: not given)."""
        thinking = self.thinking or {}
        return thinking.get("budget_tokens") if thinking.get("type") == "enabled" else None

    def shown_thinking(self, thinking: str) -> str | None:
        """The thinking as its block shows it: None for no block (none written, or thinking
        not asked for), "" with display "omitted"."""
        # a template without a switch thinks anyway: a client that did not ask reads text first
        if not thinking or self.thinking_switch() is False:
            return None
        return "" if (self.thinking or {}).get("display") == "omitted" else thinking

    def refuse_unsupported(self, model_thinks: bool = False) -> None:
        """A 400 for fields we would otherwise silently ignore (model_thinks: its template thinks)."""
        kind = (self.thinking or {}).get("type", "disabled")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise APIError(400, f"thinking.type must be enabled, disabled or adaptive, not {kind!r}", "thinking")
        # adaptive leaves it to the model, which may not think
        budget = (self.thinking or {}).get("budget_tokens")
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
            raise APIError(400, f"thinking.budget_tokens must be an integer >= 0, not {budget!r}", "thinking")
        if kind == "enabled" and not model_thinks:
            raise APIError(400, "thinking: this model does not think (extended thinking is not supported)",
                           "thinking")
        if self.schema() is not None and self.tool_choice and self.tool_choice.type in ("any", "tool"):
            raise APIError(400, "output_config.format cannot be combined with a tool_choice that forces a "
                           "tool call", "output_config")
        for name in ("mcp_servers", "container"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported by this server", name)
        for i, tool in enumerate(self.tools or ()):
            if tool.type not in (None, "custom"):
                raise APIError(400, f"tools[{i}]: server tool '{tool.type}' is not supported; give a "
                               "custom tool with name, description and input_schema", "tools")

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema output_config.format holds the answer to, if any."""
        fmt = self.output_config.format if self.output_config else None
        return fmt.schema_ if fmt else None

    def constraint(self, tokenizer: Tokenizer) -> Constraint | None:
        """The structured output asked for, if any; ConstraintError (a 400) when it cannot be."""
        schema = self.schema()
        return compile_constraint(tokenizer, "json_schema", schema) if schema is not None else None

    def kept_calls(self, calls: list) -> list:
        """The tool calls the answer may make: the first alone with disable_parallel_tool_use
        (a forced call is one already; with auto the model may write several)."""
        if self.tool_choice and self.tool_choice.disable_parallel_tool_use:
            return calls[:1]
        return calls

    def sampling(self) -> dict[str, Any]:
        """The sampling fields, as SamplingParams names them."""
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "stop": self.stop_sequences}


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages request without max_tokens (nothing is generated)."""

    max_tokens: int = Field(default=1, ge=1)
