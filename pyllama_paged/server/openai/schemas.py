"""OpenAI request bodies. Every field the API reference lets be null may be
null (a client's None means "the default"); what we cannot honour is a 400."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ...constrain.formats import from_openai
from ...constrain.grammar import Constraint, ConstraintError, compile_constraint
from ...engine import MAX_LOGPROBS
from ...tokenizer.tokenizer import Tokenizer
from ...calls.chat_call import ChatCall, PromptCall
from ...tools.reasoning import template_thinks
from ...calls.sampling_options import OPENAI
from ..generation import APIError
from ..tool_schema import ToolFunction


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool | None = False


class _Loose(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class JsonSchemaFormat(_Loose):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Loose):
    type: str
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")   # llama-cpp-python's json_object schema

    def spec(self) -> dict[str, Any]:
        """The plain dict constrain.formats reads."""
        return self.model_dump(by_alias=True, exclude_none=True)


class LoraEntry(BaseModel):
    """One entry of llama-server's per-request "lora" field: an adapter by its --lora position
    (GET /lora-adapters lists them), and its scale (0: not applied)."""

    model_config = ConfigDict(extra="ignore", strict=True)
    id: int = Field(ge=0)
    scale: float = 1.0


class Sampling(BaseModel):
    # strict: the types the schema says (true is not the integer 1, "5" is not a number)
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # llama.cpp server's extensions, which OpenAI-style clients pass through extra_body
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repeat_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool | None = None   # llama-server's and vLLM's: generate to max_tokens
    speculative: bool | None = None  # ours: false opts this request out of speculative decoding
    # structured output: OpenAI's response_format, and llama.cpp server's grammar / json_schema
    response_format: ResponseFormat | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    lora: list[LoraEntry] | None = None   # llama-server's: [{"id", "scale"}] over the --lora adapters

    def lora_entries(self) -> list[tuple[int, float]] | None:
        """The lora field as (id, scale) pairs (None: not given)."""
        return None if self.lora is None else [(e.id, e.scale) for e in self.lora]

    def constraint(self, tokenizer: Tokenizer) -> Constraint | None:
        """The structured output asked for, if any; ConstraintError (a 400) when it cannot be."""
        fmt = self.response_format.spec() if self.response_format else None
        asked = [name for name, given in (("response_format", fmt and fmt["type"] != "text"),
                                          ("grammar", self.grammar is not None),
                                          ("json_schema", self.json_schema is not None)) if given]
        if len(asked) > 1:
            raise ConstraintError(f"give one of {' and '.join(asked)}, not both")
        if self.grammar is not None:
            return compile_constraint(tokenizer, "gbnf", self.grammar)
        if self.json_schema is not None:
            return compile_constraint(tokenizer, "json_schema", self.json_schema)
        return from_openai(tokenizer, fmt)

    def grammars(self) -> dict[str, Any]:
        """The structured-output fields as given, for the size and depth limits."""
        return {"grammar": self.grammar, "json_schema": self.json_schema,
                "response_format": self.response_format.spec() if self.response_format else None}

    def refuse_unsupported(self, n_vocab: int) -> None:
        """A 400 for fields we would otherwise silently ignore, or that the model cannot take."""
        for key, bias in (self.logit_bias or {}).items():
            # ASCII digits only: str.isdigit() takes "²" (which int() refuses) and int() takes
            # other scripts' digits, neither of which is a token id a client means
            if not (key.isascii() and key.isdigit()) or int(key) >= n_vocab:
                raise APIError(400, f"logit_bias key {key!r} is not a token id of this model (0 to {n_vocab - 1})",
                               "logit_bias")
            if not -100 <= bias <= 100:
                raise APIError(400, f"logit_bias value {bias} for token {key} is outside [-100, 100]", "logit_bias")

    def sampling(self, logprobs: int | None = None) -> dict[str, Any]:
        """The sampling fields, as SamplingParams names them."""
        fields = self.model_dump(include={"max_tokens", "temperature", "top_p", "n", "stop", "seed",
                                          "presence_penalty", "frequency_penalty", "top_k", "min_p",
                                          "repeat_penalty", "ignore_eos", "speculative"})
        # a key that is not a token id is refused (refuse_unsupported) before these are used
        bias = {int(k): v for k, v in self.logit_bias.items() if k.isascii() and k.isdigit()} \
            if self.logit_bias else None
        return {**fields, "logprobs": logprobs, "logit_bias": bias}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(Sampling):
    max_tokens: int | None = Field(None, ge=0)   # 0 with echo: score the prompt, generate nothing
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a text, or a list of token ids."""
        prompt = self.prompt
        return [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)

    def refuse_completion(self, n_vocab: int, max_prompts: int) -> None:
        """A 400 for what /v1/completions cannot do (before any work)."""
        self.refuse_unsupported(n_vocab)
        if self.suffix:
            raise APIError(400, "suffix (fill-in-the-middle) is not supported by this model", "suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise APIError(400, "best_of is not supported (use n)", "best_of")
        if not self.prompts():
            raise APIError(400, "prompt is empty", "prompt")
        if len(self.prompts()) > max_prompts:
            raise APIError(400, f"{len(self.prompts())} prompts; the limit is {max_prompts}", "prompt")
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens 0 generates nothing: it is only allowed with echo, to score the "
                           "prompt", "max_tokens")

    def prompt_call(self, max_prompts: int) -> PromptCall:
        """The request as the server's prompt path takes it: an unset max_tokens is OpenAI's 16."""
        return PromptCall(
            prompts=self.prompts(), structured=self.constraint, surface=OPENAI, sampling=self.sampling(self.logprobs),
            sampling_defaults={"max_tokens": 16}, model=self.model, lora=self.lora_entries(),
            limit_fields={"stop": self.stop, "logit_bias": self.logit_bias, "grammars": self.grammars()},
            refuse_unsupported=lambda served: self.refuse_completion(served.config.n_vocab, max_prompts))


class FunctionCall(_Loose):
    name: str
    arguments: str | dict[str, Any] = "{}"   # OpenAI sends JSON text


class ToolCall(_Loose):
    id: str | None = None
    type: Literal["function"] | None = "function"
    function: FunctionCall


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)   # image_url etc.: refused by name later
    type: str
    text: str | None = None


class ChatMessage(_Loose):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class FunctionDef(ToolFunction):
    strict: bool | None = None


class Tool(_Loose):
    type: Literal["function"] = "function"
    function: FunctionDef


class ThinkingBudgetFields(BaseModel):
    """llama-server's thinking budget on OpenAI's requests: thinking tokens at most before the
    think block is closed (-1: none; unset: the reasoning effort's, else the server's)."""

    reasoning_budget_tokens: int | None = Field(None, ge=-1)
    thinking_budget_tokens: int | None = Field(None, ge=-1)   # the same, by llama-server's other name

    def thinking_budget(self) -> int | None:
        """The budget asked for, by either name (None: not asked)."""
        asked = self.reasoning_budget_tokens
        return asked if asked is not None else self.thinking_budget_tokens


class ChatRequest(Sampling, ThinkingBudgetFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)   # OpenAI's 20, as the engine bounds it
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # what we cannot honour: named so that asking for it is a 400, not silently ignored
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None
    # vLLM's: variables for the chat template (enable_thinking switches a reasoning model's thinking)
    chat_template_kwargs: dict[str, Any] | None = None

    def thinking(self) -> bool | None:
        """The request's thinking switch: chat_template_kwargs' enable_thinking, else
        reasoning_effort ("none" off, an effort on); None leaves the template's default."""
        kwargs = self.chat_template_kwargs or {}
        if kwargs.get("enable_thinking") is not None:
            return bool(kwargs["enable_thinking"])
        if self.reasoning_effort is None:
            return None
        return self.reasoning_effort != "none"

    def refuse_unsupported(self, n_vocab: int, thinks: bool = False) -> None:
        """A 400 for fields we would otherwise silently ignore (thinks: the model can reason)."""
        super().refuse_unsupported(n_vocab)
        unknown = set(self.chat_template_kwargs or {}) - {"enable_thinking"}
        if unknown:
            raise APIError(400, f"chat_template_kwargs: only enable_thinking is read, not {sorted(unknown)}",
                           "chat_template_kwargs")
        if self.functions is not None or self.function_call is not None:
            raise APIError(400, "functions and function_call are deprecated and not supported: use tools and "
                           "tool_choice", "functions" if self.functions is not None else "function_call")
        if self.audio is not None or (self.modalities and set(self.modalities) - {"text"}):
            raise APIError(400, "audio output is not supported by this model", "modalities")
        for name in ("prediction", "web_search_options"):
            if getattr(self, name) is not None:
                raise APIError(400, f"{name} is not supported", name)
        if self.reasoning_effort not in (None, "none", "minimal") and not thinks:
            raise APIError(400, "reasoning_effort: this model does not reason (think)", "reasoning_effort")

    def chat_call(self) -> ChatCall:
        """The request as the server's chat path takes it (an unset max_tokens: the server's cap)."""
        sampling = self.sampling((self.top_logprobs or 0) if self.logprobs else None)
        if self.max_completion_tokens and not self.max_tokens:
            sampling["max_tokens"] = self.max_completion_tokens
        return ChatCall(
            messages=[m.model_dump(exclude_none=True) for m in self.messages],
            tools=[t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None,
            tool_choice=self.tool_choice, structured=self.constraint, surface=OPENAI, sampling=sampling,
            model=self.model, thinking=self.thinking(), lora=self.lora_entries(),
            reasoning_effort=self.reasoning_effort, thinking_budget=self.thinking_budget(),
            limit_fields={"stop": self.stop, "logit_bias": self.logit_bias, "messages": self.messages,
                          "tools": self.tools, "grammars": self.grammars()},
            refuse_unsupported=lambda served: self.refuse_unsupported(served.config.n_vocab,
                                                                      template_thinks(served.template.source)))
