"""One request to generate, whichever API it came by, and the part of its path every API
shares. OpenAI's chat completions, the Responses API, Anthropic's Messages and Ollama's
/api/chat (on the server) and Llama.create_chat_completion each turn their request into a
ChatCall, OpenAI's completions and Ollama's /api/generate into a PromptCall (prepare_prompts:
each prompt templated or as given, tokenized); then, once for all chats: the messages normalized, the tools planned (a forced
call compiled into a grammar), the template rendered (the oldest turns dropped to fit, for
Ollama's truncate), the prompt tokenized, the sampling parameters made, and the answer's
text split into content and tool calls, per delta while it streams (AnswerSplitter) or
whole (split_answer). Each API renders the resulting pieces into its own body."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from ..constrain.grammar import Constraint
from ..constrain.thinking_budget import ThinkingBudget
from ..engine import SamplingParams, TokenEvent
from ..errors import PagedError
from ..tokenizer.chat_template import ChatTemplate
from ..tokenizer.tokenizer import Tokenizer
from ..tools.calls import ToolCall, ToolCallStream, parse_tool_calls
from ..tools.harmony import HarmonyReader, HarmonyTokens, harmony_tokens
from ..tools.messages import ImageSink, MessageError, normalize_messages
from ..vision.prompt_images import VisionPrompt
from ..tools.prompt import plan_tools, render_chat
from ..tools.reasoning import (THINK_CLOSE, THINK_OPEN, ReasoningSplitter, budget_tokens, prompt_opens_thinking,
                               speaks_harmony, split_reasoning, template_thinks, thinking_variables)
from .sampling_options import PYTHON, Surface, sampling_params
from .text_stream import TextDelta


@dataclass
class Call:
    """What every request to generate carries, whichever API it came by: a structured output,
    how to sample (the API's own fields over its Surface), the thinking switch, and what only
    a server reads (the model asked for, the request's fields as sent for its limits, the
    API's own refusals, Ollama's num_ctx and keep_alive)."""

    structured: Callable[[Tokenizer], Constraint | None] | None = None   # the structured output, compiled
    surface: Surface = PYTHON
    sampling: dict[str, Any] = field(default_factory=dict)           # the API's sampling fields (None: unset)
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # for fields still unset (max_tokens' default)
    thinking: bool | None = None   # the request's switch for a model that thinks (None: its template's default)
    reasoning_effort: str | None = None   # low, medium or high, for gpt-oss (None: its template's default)
    # thinking tokens at most before a think block's close is forced (None: the effort's, or none;
    # a server fills in its --reasoning-budget; negative: no budget)
    thinking_budget: int | None = None
    truncate: bool = False   # past the context: a chat's oldest turns dropped, a prompt's first tokens cut
    # read by the server only
    model: str | None = None
    limit_fields: dict[str, Any] = field(default_factory=dict)   # stop, messages, tools, logit_bias, grammars as sent
    refuse_unsupported: Callable[[Any], None] | None = None      # the API's refusals, given the served model
    n_ctx: int | None = None      # Ollama's num_ctx: prompt and answer within fewer tokens than the model's
    keep_alive: Any = None        # Ollama's keep_alive, as sent
    lora: list[tuple[int, float]] | None = None   # llama-server's per-request adapters: (id, scale)

    def params(self, constraint: Constraint | None, budget: ThinkingBudget | None = None) -> SamplingParams:
        """The call's SamplingParams, decoding under constraint with a thinking budget;
        PagedError names a bad field."""
        return sampling_params(self.surface, {**self.sampling, "constraint": constraint, "thinking_budget": budget},
                               **self.sampling_defaults)


@dataclass
class ChatCall(Call):
    """One chat request in the shape every API's is turned into: messages and tools in
    OpenAI's chat shape, beside what every call carries."""

    messages: list[dict] = field(default_factory=list)
    tools: list[dict] | None = None
    tool_choice: Any = None
    messages_param: str | None = "messages"   # the request field an unreadable message is reported under


@dataclass
class PromptCall(Call):
    """One text completion request (OpenAI's /v1/completions, Ollama's /api/generate): each
    prompt its own generation, as text (its special tokens read) or token ids; templated: a
    text prompt goes through the model's chat template as a user turn after system (Ollama's
    generate without raw); context: the tokens of an earlier exchange it continues."""

    prompts: list[str | list[int]] = field(default_factory=list)
    templated: bool = False
    system: str | None = None
    context: list[int] = field(default_factory=list)
    structured_param: str | None = None   # the request field a bad structured output is reported under
    images: list[str] = field(default_factory=list)   # base64 images (Ollama's), before each text prompt


@dataclass
class PreparedChat:
    """A chat call ready to generate."""

    prompt_ids: list[int]
    constraint: Constraint | None   # the call's structured output, or a forced tool call's grammar
    tool_names: set[str]            # the tools whose calls to look for in the answer
    thinks: bool = False            # the template writes a think block: the answer's thinking is split out
    opens_thinking: bool = False    # the prompt ends inside an open think block
    harmony: HarmonyTokens | None = None   # the reply is harmony (gpt-oss): its channels are read instead
    thinking_budget: ThinkingBudget | None = None   # the think block's close forced past this many tokens
    images: list = field(default_factory=list)   # (first position, EncodedImage) per image in the prompt


def prepare_call(call: ChatCall, template: ChatTemplate, tokenizer: Tokenizer,
                 n_ctx: int | None = None, vision: VisionPrompt | None = None) -> PreparedChat:
    """The call's prompt, constraint and tool names; with call.truncate, the fewest oldest
    turns left out for the prompt to stay under n_ctx tokens. PagedError (MessageError,
    ConstraintError, ImageError) for what the request got wrong. vision: the model reads
    images (None: an image is refused), each encoded into its place in the prompt."""
    sink = ImageSink(vision.marker) if vision is not None else None
    messages = normalize_messages(call.messages, sink)
    constraint = call.structured(tokenizer) if call.structured is not None else None
    tools, constraint, names = plan_tools(template, tokenizer, call.tools, call.tool_choice, constraint)
    thinks = template_thinks(template.source)
    harmony = harmony_tokens(tokenizer) if speaks_harmony(template.source) else None
    variables = thinking_variables(template.source, call.thinking, call.reasoning_effort)
    ids, text = _prompt_ids(template, tokenizer, messages, tools, n_ctx if call.truncate else None, variables)
    ids, images = vision.expand(ids, sink.images) if vision is not None else (ids, [])
    opens = thinks and harmony is None and prompt_opens_thinking(text)
    return PreparedChat(ids, constraint, names, thinks, opens, harmony,
                        thinking_budget(call, tokenizer, thinks and harmony is None, opens), images)


def _prompt_images(call: PromptCall, vision: VisionPrompt | None) -> tuple[ImageSink | None, str]:
    """The call's images taken (MessageError without vision), and the markers that go before
    each text prompt."""
    if not call.images:
        return None, ""
    if vision is None:
        raise MessageError("images are not supported by this model")
    sink = ImageSink(vision.marker)
    return sink, "".join(sink.take(v, f"images[{j}]") for j, v in enumerate(call.images))


def prepare_prompts(call: PromptCall, template: ChatTemplate, tokenizer: Tokenizer,
                    n_vocab: int, vision: VisionPrompt | None = None) -> list[PreparedChat]:
    """Each prompt of the call ready to generate (its constraint compiled later, by whoever
    starts it): text rendered (templated) and tokenized after the call's context, token ids
    checked against the model's n_vocab, the call's images before each text prompt.
    PagedError for what the request got wrong."""
    sink, markers = _prompt_images(call, vision)
    thinks = call.templated and template_thinks(template.source)
    harmony = harmony_tokens(tokenizer) if thinks and speaks_harmony(template.source) else None
    variables = thinking_variables(template.source, call.thinking, call.reasoning_effort)
    prepared = []
    for prompt in call.prompts:
        if isinstance(prompt, str):
            text = prompt = markers + prompt
            if call.templated:
                turns = ([{"role": "system", "content": call.system}] if call.system else []) + \
                        [{"role": "user", "content": prompt}]
                text = template.render(turns, variables=variables)
            ids = list(call.context) + tokenizer.encode(text, add_special=not call.context, parse_special=True)
            opens = thinks and harmony is None and prompt_opens_thinking(text)
        elif any(not 0 <= t < n_vocab for t in prompt):
            raise PagedError("prompt token id outside the vocabulary")
        else:
            ids, opens = list(prompt), False
        ids, images = vision.expand(ids, sink.images) if sink is not None else (ids, [])
        prepared.append(PreparedChat(ids, None, set(), thinks, opens, harmony,
                                     thinking_budget(call, tokenizer, thinks and harmony is None, opens), images))
    return prepared


def thinking_budget(call: Call, tokenizer: Tokenizer, think_tags: bool, opens: bool) -> ThinkingBudget | None:
    """The call's thinking budget on a model that writes think blocks (think_tags), as the
    model's own tokens of <think> and </think>; None without a budget. gpt-oss (harmony)
    takes its reasoning effort through its template instead."""
    tokens = budget_tokens(call.thinking_budget, call.reasoning_effort)
    if not think_tags or tokens is None:
        return None
    tags = [tuple(tokenizer.encode(tag, add_special=False, parse_special=True)) for tag in (THINK_OPEN, THINK_CLOSE)]
    return ThinkingBudget(tokens, tags[0], tags[1], opens)


def _prompt_ids(template: ChatTemplate, tokenizer: Tokenizer, messages: list[dict], tools: list[dict],
                fit_under: int | None, variables: dict | None = None) -> tuple[list[int], str]:
    """The rendered chat's tokens and the whole chat's text (every render ends alike); with
    fit_under, as Ollama truncates: the oldest turns (never a system prompt or the last
    message) dropped until fewer than fit_under remain."""
    droppable = [i for i, m in enumerate(messages[:-1]) if m["role"] != "system"]
    rendered: list[str] = []

    def ids_without(k: int) -> list[int]:
        """The chat's tokens with its k oldest droppable turns left out."""
        gone = set(droppable[:k])
        text = render_chat(template, tokenizer, [m for i, m in enumerate(messages) if i not in gone], tools,
                           variables)
        rendered.append(text)
        return tokenizer.encode(text, add_special=True, parse_special=True)

    ids = ids_without(0)
    if fit_under is None or len(ids) < fit_under or not droppable:
        return ids, rendered[0]
    return _fewest_dropped(ids_without, droppable, fit_under), rendered[0]


def _fewest_dropped(ids_without: Callable[[int], list[int]], droppable: list[int], fit_under: int) -> list[int]:
    """The tokens with the fewest oldest turns dropped that fit under fit_under."""
    # The fewest turns to drop, by bisection: the prompt shrinks as turns go, so this is
    # what dropping one at a time finds, in a logarithmic number of renders (one at a
    # time re-rendered the whole chat per turn: quadratic, minutes for a long chat)
    fewest, best = len(droppable), ids_without(len(droppable))
    if len(best) >= fit_under:   # even the system prompt and last message alone: the caller cuts tokens
        return best
    low = 1   # dropping fewer than low does not fit; dropping `fewest` does
    while low < fewest:
        mid = (low + fewest) // 2
        candidate = ids_without(mid)
        if len(candidate) < fit_under:
            fewest, best = mid, candidate
        else:
            low = mid + 1
    return best


@dataclass
class AnswerPiece:
    """What one text delta adds to a sample's answer."""

    index: int                         # the sample
    text: str                          # content that can be shown now
    event: TokenEvent | None = None    # the token behind the delta (its log-probabilities), if any
    finish_reason: str | None = None   # on the sample's last piece: how it ended
    stop: str | None = None            # the stop string that ended it, if one did
    calls: list[ToolCall] = field(default_factory=list)   # on the last piece: the tool calls it made
    thinking: str = ""                 # thinking that can be shown now (a model that thinks)


class AnswerSplitter:
    """Each sample's streamed text as content and tool calls: text that cannot open a call
    passes at once; text that may be one is held until it can be told (tools/calls.py), and
    calls are parsed when the sample ends (which can take a while on a long answer: see
    ends_with_parse) or when text that is no call follows whole ones: the sample's answer
    ends there (finish_reason "stop", the text after its calls dropped; see cut and
    all_ended). A harmony reply is read by its channels instead (tools/harmony.py: from the
    deltas' token ids), its call given at the end."""

    def __init__(self, tool_names: set[str], thinks: bool = False, opens_thinking: bool = False,
                 harmony: HarmonyTokens | None = None):
        self.tool_names = tool_names
        self.thinks, self.opens_thinking, self.harmony = thinks, opens_thinking, harmony
        self._streams: dict[int, ToolCallStream] = {}
        self._reasoning: dict[int, ReasoningSplitter] = {}
        self._harmony: dict[int, HarmonyReader] = {}
        self._ended: set[int] = set()      # samples whose last piece was made
        self._cut: dict[int, int] = {}     # samples ended after their calls: characters dropped

    def cut(self, index: int) -> int | None:
        """How many characters of sample index's text were dropped after its calls when its
        answer ended with them (None: it was not cut; its later deltas add nothing)."""
        return self._cut.get(index)

    def all_ended(self, n: int) -> bool:
        """Whether each of n samples has had its last piece (its finish, or its calls' end)."""
        return len(self._ended) >= n

    def ends_with_parse(self, delta: TextDelta) -> bool:
        """Whether feeding this delta parses held text for tool calls."""
        return bool(self.tool_names and delta.finish_reason)

    def feed(self, delta: TextDelta) -> AnswerPiece:
        """The piece a text delta makes; the last one of a sample carries its calls."""
        if delta.index in self._ended:   # after its calls' end: what the model wrote on is dropped
            return AnswerPiece(delta.index, "")
        if delta.finish_reason:
            self._ended.add(delta.index)
        if self.harmony is not None:
            return self._feed_harmony(delta)
        text, calls, thinking = delta.text, [], ""
        if self.thinks:   # tool calls are read from the answer after the thinking, never inside it
            splitter = self._reasoning.setdefault(delta.index, ReasoningSplitter(self.opens_thinking))
            part = splitter.feed(text)
            if delta.finish_reason:
                last = splitter.finish()
                part.thinking, part.content = part.thinking + last.thinking, part.content + last.content
            thinking, text = part.thinking, part.content
        finish, stop = delta.finish_reason, delta.stop
        if self.tool_names:
            stream = self._streams.setdefault(delta.index, ToolCallStream(self.tool_names))
            text = stream.feed(text)
            if stream.done:   # whole calls, then text that is none: the answer ends here
                self._cut[delta.index] = stream.dropped
                if not finish:
                    finish, stop = "stop", None
                    self._ended.add(delta.index)
            if finish:
                rest, calls = stream.finish()
                text += rest
        return AnswerPiece(delta.index, text, delta.event, finish, stop, calls, thinking)

    def _feed_harmony(self, delta: TextDelta) -> AnswerPiece:
        reader = self._harmony.setdefault(delta.index, HarmonyReader(self.harmony, self.tool_names))
        token = delta.event.token_id if delta.event is not None else None
        part, calls = reader.feed(delta.text, token, bool(delta.finish_reason)), []
        if delta.finish_reason:
            last, calls = reader.finish()
            part.thinking, part.content = part.thinking + last.thinking, part.content + last.content
        return AnswerPiece(delta.index, part.content, delta.event, delta.finish_reason, delta.stop, calls,
                           part.thinking)


def _read_harmony(deltas: list[TextDelta], harmony: HarmonyTokens, tool_names: set[str]) -> AnswerPiece:
    """A sample's whole harmony reply (its deltas, which end with its finish) as one piece."""
    splitter = AnswerSplitter(tool_names, harmony=harmony)
    pieces = [splitter.feed(d) for d in deltas]
    return AnswerPiece(0, "".join(p.text for p in pieces), thinking="".join(p.thinking for p in pieces),
                       calls=[c for p in pieces for c in p.calls])


def without_dropped(deltas: list[TextDelta], splitter: AnswerSplitter) -> list[TextDelta]:
    """The deltas less what each cut sample wrote after its calls (the text its splitter dropped)."""
    out, left = list(deltas), {}
    for k in range(len(out) - 1, -1, -1):   # from each sample's end
        d = out[k]
        drop = left.setdefault(d.index, splitter.cut(d.index) or 0)
        if drop and d.text:
            keep = max(0, len(d.text) - drop)
            left[d.index] = drop - (len(d.text) - keep)
            out[k] = replace(d, text=d.text[:keep])
    return out


def split_answer(text: str, tool_names: set[str]) -> tuple[str, list[ToolCall]]:
    """(content, tool calls) of a whole answer."""
    return parse_tool_calls(text, tool_names) if tool_names else (text, [])


def split_as_streamed(text: str, tool_names: set[str]) -> tuple[str, list[ToolCall]]:
    """(content, tool calls) of a whole answer as streaming splits it: text let through
    before a call stays content as it was sent."""
    piece = AnswerSplitter(tool_names).feed(TextDelta(0, text, "stop"))
    return piece.text, piece.calls


@dataclass
class Answer:
    """A sample's whole answer."""

    index: int
    text: str                 # as generated
    content: str              # the text less its thinking and its tool calls
    calls: list[ToolCall]
    finish_reason: str
    stop: str | None          # the stop string that ended it, if one did
    events: list[TokenEvent]  # its tokens (their log-probabilities)
    thinking: str = ""        # its think block's text (a model that thinks)


def collect_answers(deltas: list[TextDelta], n: int, tool_names: set[str],
                    split: Callable[[str, set[str]], tuple[str, list[ToolCall]]] = split_answer,
                    thinks: bool = False, opens_thinking: bool = False,
                    harmony: HarmonyTokens | None = None) -> list[Answer]:
    """Each of n samples' answer from all of a request's deltas, its thinking (a model that
    thinks) and then its tool calls split out (by its channels, for a harmony reply)."""
    answers = []
    for j in range(n):
        own = [d for d in deltas if d.index == j]
        text = "".join(d.text for d in own)
        end = next((d for d in reversed(own) if d.finish_reason), None)
        if harmony is not None:
            piece = _read_harmony(own, harmony, tool_names)
            thinking, content, calls = piece.thinking, piece.text, piece.calls
        else:
            thinking, answer = split_reasoning(text, opens_thinking) if thinks else ("", text)
            content, calls = split(answer, tool_names)
        answers.append(Answer(j, text, content, calls, end.finish_reason if end else "length",
                              end.stop if end else None, [d.event for d in own if d.event is not None], thinking))
    return answers
