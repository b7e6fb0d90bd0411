"""The server's one generation path. Every API's chat request (OpenAI's chat completions,
the Responses API, Anthropic's Messages, Ollama's /api/chat) comes here as a ChatCall
(run_chat), every text completion (OpenAI's completions, Ollama's /api/generate) as a
PromptCall (run_prompt), and goes the same way: the per-request limits, an unset max_tokens
given its default within the server's cap, the model looked up (a 404), the generative
check, the API's own refusals; then the shared core (calls/chat_call.py: messages, tools,
template, tokens) off the event loop, the sampling parameters and a Generation per prompt.
Its answer comes back as pieces (text, tool calls, the end) or whole answers, which each
API renders."""

from __future__ import annotations

from concurrent.futures import Executor
from contextlib import aclosing
from dataclasses import dataclass
from typing import AsyncIterator

from ..calls.chat_call import (Answer, AnswerPiece, AnswerSplitter, Call, ChatCall, PreparedChat, PromptCall,
                               collect_answers, prepare_call, prepare_prompts, split_answer, without_dropped)
from ..calls.sampling_options import BASE_MODEL_MAX_TOKENS
from ..tools.reasoning import budget_tokens
from ..calls.text_stream import TextDelta
from ..errors import PagedError
from ..tools.harmony import HarmonyTokens
from ..tools.messages import MessageError
from .generation import APIError, Generation, check_request, field_error, fit_prompt, off_loop, \
    require_generative, start_generation
from .keep_alive import keep_alive_seconds
from .lookup import find_model
from .registry import ServedModel


@dataclass
class ChatRun:
    """A started generation whose answer is read as pieces or whole answers (a chat's, or
    /api/generate's with no tools)."""

    served: ServedModel
    gen: Generation
    tool_names: set[str]   # the tools whose calls the answer is read for
    prep: Executor         # the server's pool for slow text work
    thinks: bool = False   # the model writes a think block: its thinking comes apart from the answer
    opens_thinking: bool = False   # the prompt opened that block
    harmony: HarmonyTokens | None = None   # the reply is harmony (gpt-oss): read by its channels

    @property
    def model_name(self) -> str:
        """The model an answer says it came from: the LoRA adapter it ran, else the model."""
        return answering_model(self.served, self.gen.params.lora)

    @property
    def width(self) -> int:
        """How many samples (or beams) the answer has."""
        params = self.gen.params
        return params.beam_width if params.beam_width > 1 else params.n

    def splitter(self) -> AnswerSplitter:
        """A splitter of this run's answer into content, thinking and tool calls."""
        return AnswerSplitter(self.tool_names, self.thinks, self.opens_thinking, self.harmony)

    async def read(self, splitter: AnswerSplitter) -> AsyncIterator[tuple[TextDelta, AnswerPiece]]:
        """Each text delta with the piece it makes (a sample's last one, whose held text is
        parsed for tool calls, made off the event loop), up to every sample's end. A sample
        whose whole tool calls are followed by text that is no call ends with them; once all
        have ended the generation is aborted (its pages freed), not run on."""
        async with aclosing(self.gen.deltas()) as deltas:
            async for d in deltas:
                if splitter.cut(d.index) is not None:
                    continue
                piece = await off_loop(self.prep, splitter.feed, d) if splitter.ends_with_parse(d) else \
                    splitter.feed(d)
                if piece.finish_reason and not d.finish_reason:   # ended by its calls
                    self.gen.finish_reasons[d.index] = piece.finish_reason
                yield d, piece
                if splitter.all_ended(self.width):
                    return

    async def pieces(self) -> AsyncIterator[AnswerPiece]:
        """The answer as it streams, a piece per text delta."""
        async for _, piece in self.read(self.splitter()):
            yield piece

    async def answers(self, request, split=split_answer) -> list[Answer]:
        """Each sample's whole answer (a client hanging up meanwhile aborts it: 499);
        split: how its tool calls are split out (split_answer, or split_as_streamed)."""
        splitter = self.splitter()

        async def ended_by_calls():
            """The deltas, with a sample's end where its calls ended it."""
            async for d, piece in self.read(splitter):
                yield d
                if piece.finish_reason and not d.finish_reason:
                    yield TextDelta(d.index, "", piece.finish_reason)

        deltas = without_dropped(await self.gen.collect(request, ended_by_calls()), splitter)
        return await off_loop(self.prep, collect_answers, deltas, self.width, self.tool_names, split, self.thinks,
                              self.opens_thinking, self.harmony)


def answering_model(served: ServedModel, lora) -> str:
    """The model name an answer carries: its LoRA adapter's (vLLM's), else the served model's."""
    return served.name if lora is None else lora.name


async def check_call(state, call: Call) -> ServedModel:
    """The checks before any work: the request's limits, its model (a 404), that the model
    generates text, and the API's refusals of what it cannot honour. An unset max_tokens
    gets the call's default (OpenAI completions' 16) within the server's cap, or the cap; on
    a model without a chat template (a base model) at most what `run` generates. An unset
    thinking budget is the reasoning effort's, else the server's --reasoning-budget."""
    check_request(state.limits, **call.limit_fields)
    served = await find_model(state.registry, call.model)
    cap = state.limits.max_tokens
    if not served.has_chat_template:
        cap = min(cap, BASE_MODEL_MAX_TOKENS)
    call.sampling_defaults["max_tokens"] = min(call.sampling_defaults.get("max_tokens") or cap, cap)
    require_generative(served)
    if call.refuse_unsupported is not None:
        call.refuse_unsupported(served)
    try:
        call.sampling["lora"] = state.registry.lora_for(call.model, served, call.lora)
    except ValueError as e:
        raise APIError(400, str(e), "lora") from None
    budget = budget_tokens(call.thinking_budget, call.reasoning_effort, state.limits.reasoning_budget)
    call.thinking_budget = -1 if budget is None else budget   # -1: none (the server's is not applied again)
    return served


async def prepare_chat_call(state, served: ServedModel, call: ChatCall) -> PreparedChat:
    """The call's prompt, constraint and tool names, made off the event loop (templates,
    tokenizing and a first grammar take a while); what the request got wrong is a 400."""
    n_ctx = min(call.n_ctx or served.n_ctx, served.n_ctx)
    try:
        return await off_loop(state.prep, prepare_call, call, served.template, served.tokenizer, n_ctx, served.vision)
    except PagedError as e:
        raise APIError(400, str(e), call.messages_param if isinstance(e, MessageError) else None) from None


async def start_chat(state, served: ServedModel, call: ChatCall) -> ChatRun:
    """The checked call's generation started: a queue place taken, nothing held before it."""
    prepared = await prepare_chat_call(state, served, call)
    ids = prepared.prompt_ids
    if call.truncate and not prepared.images:   # still too long without every droppable turn: its tokens are cut
        ids = fit_prompt(served, ids, state.limits, True, call.n_ctx)
    try:
        params = call.params(prepared.constraint, prepared.thinking_budget)
    except PagedError as e:
        raise field_error(e) from None
    gen = start_generation(served, ids, params, state.limits, state.metrics, call.n_ctx,
                           keep_alive_seconds(call.keep_alive), prepared.images)
    return ChatRun(served, gen, prepared.tool_names, state.prep, prepared.thinks, prepared.opens_thinking,
                   prepared.harmony)


async def run_chat(state, call: ChatCall) -> ChatRun:
    """A chat call checked, prepared and started: the whole path before the answer."""
    return await start_chat(state, await check_call(state, call), call)


async def prepare_prompt(state, call: PromptCall) -> tuple[ServedModel, list[PreparedChat]]:
    """A prompt call checked, and each prompt's tokens made off the event loop, within the
    context (cut from the front with call.truncate, a 400 otherwise)."""
    served = await check_call(state, call)
    try:
        prepared = await off_loop(state.prep, prepare_prompts, call, served.template, served.tokenizer,
                                  served.config.n_vocab, served.vision)
    except PagedError as e:
        raise APIError(400, str(e), "prompt") from None
    for p in prepared:
        # a prompt with images is never cut (its images' positions would move): too long is a 400
        p.prompt_ids = fit_prompt(served, p.prompt_ids, state.limits, call.truncate and not p.images, call.n_ctx)
        if not p.prompt_ids:
            raise APIError(400, "prompt is empty", "prompt")
    return served, prepared


async def start_prompts(state, served: ServedModel, call: PromptCall, prepared: list[PreparedChat]) -> list[ChatRun]:
    """A generation started for each prepared prompt, a queue place each (one refused gives
    the earlier ones theirs back)."""
    try:   # off the event loop: a first grammar prepares the vocabulary (about a second)
        constraint = await off_loop(state.prep, call.structured, served.tokenizer) if call.structured else None
    except PagedError as e:
        raise APIError(400, str(e), call.structured_param) from None
    runs: list[ChatRun] = []
    try:
        for p in prepared:
            try:
                # each its own: a generation may shorten its max_tokens
                params = call.params(constraint, p.thinking_budget)
            except PagedError as e:
                raise field_error(e) from None
            gen = start_generation(served, p.prompt_ids, params, state.limits, state.metrics, call.n_ctx,
                                   keep_alive_seconds(call.keep_alive), p.images)
            runs.append(ChatRun(served, gen, set(), state.prep, p.thinks, p.opens_thinking, p.harmony))
    except BaseException:   # a later prompt refused (queue full): the earlier ones give their places back
        for run in runs:
            run.gen.leave()
        raise
    return runs


async def run_prompt(state, call: PromptCall) -> list[ChatRun]:
    """A prompt call checked, prepared and started, a run per prompt: the whole path before
    the answers."""
    served, prepared = await prepare_prompt(state, call)
    return await start_prompts(state, served, call, prepared)
