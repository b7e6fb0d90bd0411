"""Llama: the llama-cpp-python-shaped Python API over the paged engine."""

from __future__ import annotations

import os
import time
import uuid
from typing import Iterator, Sequence

from ._native import GGML_LOG_DEBUG, lib
from .constrain.formats import from_python
from .tools.calls import ToolCallStream
from .tools.messages import normalize_messages
from .tools.prompt import prepare_chat
from .tokenizer.chat_template import ChatTemplate
from .embeddings import embed_for_llama, openai_list
from .engine.encoder import encoder_engine
from .engine.model_runner import ModelRunner
from .errors import PagedError
from .engine.llm_engine import LLMEngine
from .engine.model import Model
from .engine.sampler import SamplingParams
from .sampling_options import PYTHON, sampling_params
from .engine.scheduler import SchedulerConfig
from .text_stream import TextAssembler
from .tokenizer.tokenizer import Tokenizer


def _default_threads() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


class Llama:
    """A local GGUF model with a paged KV cache (llama-cpp-python compatible API)."""

    def __init__(self, model_path: str | None = None, *, paged: bool = True, n_ctx: int = 4096,
                 n_threads: int | None = None, n_batch: int = 512, block_size: int = 32,
                 kv_cache_type: str = "f16", seed: int | None = None, verbose: bool = False,
                 n_seq_max: int = 1, repack_weights: bool = True):
        self.verbose = verbose
        self.seed = seed
        if verbose:
            lib.pp_set_ggml_log_level(GGML_LOG_DEBUG)
        self._model = Model(model_path, repack_weights=repack_weights)
        self.model_path = self._model.path
        self.tokenizer = Tokenizer.from_metadata(self._model.metadata)
        self.n_threads = n_threads or _default_threads()
        self.n_ctx_value = min(n_ctx, self._model.config.n_ctx_train) if n_ctx > 0 else \
            self._model.config.n_ctx_train
        self.paged = paged
        if self._model.config.is_encoder:   # bert: embeddings only, no KV cache
            self.runner, self.llm_engine = encoder_engine(self._model, self.n_threads)
            self.chat_template = None
            return
        self.runner = ModelRunner(self._model, paged=paged, n_ctx=self.n_ctx_value, n_seq_max=n_seq_max,
                             n_threads=self.n_threads, n_batch=n_batch, block_size=block_size,
                             kv_cache_type=kv_cache_type)
        self.chat_template = ChatTemplate.for_model(self._model.metadata, self._model.config.arch)
        self.llm_engine = LLMEngine(self.runner, self.tokenizer.eot_ids,
                                    SchedulerConfig(max_num_batched_tokens=n_batch))

    # ---- basics -------------------------------------------------------------
    def n_ctx(self) -> int:
        return self.n_ctx_value

    def n_vocab(self) -> int:
        return self._model.config.n_vocab

    @property
    def metadata(self) -> dict:
        return {k: v for k, v in self._model.metadata.items() if not k.startswith("tokenizer.ggml.")}

    def tokenize(self, text: bytes | str, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of text (bytes are decoded as UTF-8)."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self.tokenizer.encode(text, add_special=add_bos, parse_special=special)

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> bytes:
        """UTF-8 bytes of token ids."""
        return self.tokenizer.decode_bytes(tokens, skip_special=not special)

    def stats(self) -> dict:
        """KV pool and scheduler figures (pages used/free/shared/cached, hit rate, ...)."""
        return self.llm_engine.stats()

    def close(self) -> None:
        """Free the runner and the model."""
        if getattr(self, "runner", None) is not None:
            self.runner.close()
            self.runner = None
        if getattr(self, "_model", None) is not None:
            self._model.close()
            self._model = None

    def __enter__(self) -> "Llama":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- embeddings (pooled through the same scheduler; see embeddings.py) ---
    def embed(self, input: str | Sequence[str], normalize: bool = True, truncate: bool = True,
              return_count: bool = False, pooling: str | None = None, dimensions: int | None = None):
        """llama-cpp-python's embed: a list of floats for a str, a list of them for a list
        (and the token count too with return_count)."""
        vectors, count = embed_for_llama(self, input, normalize, truncate, pooling, dimensions)
        return (vectors, count) if return_count else vectors

    def create_embedding(self, input: str | Sequence[str], model: str | None = None,
                         pooling: str | None = None, dimensions: int | None = None) -> dict:
        """OpenAI-shaped embedding list (llama-cpp-python's create_embedding)."""
        batch = [input] if isinstance(input, str) else list(input)
        vectors, count = embed_for_llama(self, batch, True, True, pooling, dimensions)
        return openai_list(vectors, model or self.model_path, count)

    # ---- generation: every path goes through the scheduler -----------------
    def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Iterator[int]:
        """Yield each generated token id (an end-of-text token included) until it ends."""
        for _, _, _, _, event in self.stream_texts([list(prompt_ids)], params):
            if event is not None:
                yield event.token_id

    def create_completion(self, prompt: str | Sequence[int], max_tokens: int | None = 16,
                          temperature: float = 0.8, top_p: float = 0.95, top_k: int = 40,
                          min_p: float = 0.05, repeat_penalty: float = 1.0,
                          presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                          stop: str | Sequence[str] | None = None, stream: bool = False,
                          seed: int | None = None, logprobs: int | None = None, echo: bool = False,
                          ignore_eos: bool = False, response_format: dict | None = None, grammar=None):
        """OpenAI-shaped text completion (a dict, or an iterator of chunks if stream)."""
        params = self._params(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                              min_p=min_p, repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
                              frequency_penalty=frequency_penalty, stop=stop, seed=seed, logprobs=logprobs,
                              ignore_eos=ignore_eos,
                              constraint=from_python(self.tokenizer, response_format, grammar))
        prompt_ids = list(prompt) if not isinstance(prompt, str) else self.tokenize(prompt, special=True)
        chunks = self._completion_chunks(prompt, prompt_ids, params, echo)
        if stream:
            return chunks
        return self._collect(chunks)

    __call__ = create_completion

    def _completion_chunks(self, prompt, prompt_ids, params: SamplingParams, echo: bool):
        cid = f"cmpl-{uuid.uuid4()}"
        created = int(time.time())
        completion_tokens = 0

        def chunk(text, finish_reason=None, lp=None):
            return {"id": cid, "object": "text_completion", "created": created,
                    "model": self.model_path,
                    "choices": [{"text": text, "index": 0, "logprobs": lp,
                                 "finish_reason": finish_reason}]}

        def piece(token_id):
            return self.tokenizer.token_to_piece(token_id).decode("utf-8", "replace")

        if echo:
            yield chunk(prompt if isinstance(prompt, str) else self.detokenize(prompt_ids).decode(
                "utf-8", "replace"))
        finish = "length"
        for _, _, text, finish_reason, event in self.stream_texts([prompt_ids], params):
            lp = None
            if event is not None:
                completion_tokens += 1
                if event.logprob is not None:
                    lp = {"tokens": [piece(event.token_id)], "text_offset": [0],
                          "token_logprobs": [event.logprob],
                          "top_logprobs": [{piece(t): v for t, v in event.top_logprobs.items()}]}
            if text or lp:
                yield chunk(text, lp=lp)
            finish = finish_reason or finish
        final = chunk("", finish)
        final["usage"] = {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                          "total_tokens": len(prompt_ids) + completion_tokens}
        yield final

    @staticmethod
    def _collect(chunks) -> dict:
        text, lps, last = [], None, None
        for c in chunks:
            choice = c["choices"][0]
            text.append(choice["text"])
            if choice["logprobs"]:
                if lps is None:
                    lps = {"tokens": [], "text_offset": [], "token_logprobs": [], "top_logprobs": []}
                offset = sum(len(t) for t in text[:-1])
                for k in ("tokens", "token_logprobs", "top_logprobs"):
                    lps[k].extend(choice["logprobs"][k])
                lps["text_offset"].append(offset)
            last = c
        result = {k: last[k] for k in ("id", "object", "created", "model")}
        result["choices"] = [{"text": "".join(text), "index": 0, "logprobs": lps,
                              "finish_reason": last["choices"][0]["finish_reason"]}]
        result["usage"] = last["usage"]
        return result

    # ---- scheduled generation: many prompts, n samples, beams, chat ---------
    def _params(self, **fields) -> SamplingParams:
        """SamplingParams from this API's keyword arguments (llama-cpp-python's names and
        defaults); the model's seed applies when none is given."""
        return sampling_params(PYTHON, fields, seed=self.seed)

    def stream_texts(self, prompts_ids: Sequence[Sequence[int]], params: SamplingParams):
        """Run prompts together through the scheduler; yield (prompt index, sample index,
        text delta, finish reason or None, usage tokens) as text becomes available."""
        if self.runner is None:
            raise PagedError("this Llama is closed")
        llm = self.llm_engine
        requests = []
        try:
            for i, ids in enumerate(prompts_ids):
                requests.append(llm.add_request(list(ids), params))
                if requests[-1].error:
                    raise PagedError(f"prompt {i}: {requests[-1].error}")
        except BaseException:
            for r in requests:
                llm.abort(r.request_id)
            raise
        index = {r.request_id: i for i, r in enumerate(requests)}
        assemblers = [TextAssembler(self.tokenizer, params.stop) for _ in requests]
        width = params.beam_width if params.beam_width > 1 else params.n
        try:
            while any(r.request_id in llm.requests for r in requests):
                for out in llm.step():
                    i = index.get(out.request_id)
                    if i is None:
                        continue
                    if out.error:
                        raise PagedError(out.error)
                    assembler = assemblers[i]
                    for d in assembler.feed(out):
                        yield i, d.index, d.text, d.finish_reason, d.event
                    if not out.finished and params.stop and assembler.all_stopped(width):
                        llm.abort(out.request_id)   # every sample hit a stop string
        finally:
            for r in requests:
                llm.abort(r.request_id)

    def create_chat_completion(self, messages: list[dict], max_tokens: int | None = None,
                               temperature: float = 0.8, top_p: float = 0.95, top_k: int = 40,
                               min_p: float = 0.05, repeat_penalty: float = 1.0,
                               presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                               stop: str | Sequence[str] | None = None, stream: bool = False,
                               seed: int | None = None, n: int = 1, ignore_eos: bool = False,
                               response_format: dict | None = None, grammar=None, tools: list | None = None,
                               tool_choice=None):
        """OpenAI-shaped chat completion over the model's chat template; tools and tool_choice
        as OpenAI's (calls come back in message.tool_calls)."""
        constraint = from_python(self.tokenizer, response_format, grammar)
        prompt, constraint, names = prepare_chat(self.chat_template, self.tokenizer, normalize_messages(messages),
                                                 tools, tool_choice, constraint)
        params = self._params(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                              min_p=min_p, repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
                              frequency_penalty=frequency_penalty, stop=stop, seed=seed, n=n,
                              ignore_eos=ignore_eos, constraint=constraint)
        prompt_ids = self.tokenize(prompt, add_bos=True, special=True)
        chunks = self._chat_chunks(prompt_ids, params, names)
        return chunks if stream else self._collect_chat(chunks, n)

    def _chat_chunks(self, prompt_ids, params, names: set[str]):
        cid, created = f"chatcmpl-{uuid.uuid4()}", int(time.time())
        started: set = set()
        counts: dict = {}
        calls: dict = {}   # sample -> ToolCallStream, when tools were offered

        def chunk(j, delta, finish=None):
            return {"id": cid, "object": "chat.completion.chunk", "created": created,
                    "model": self.model_path,
                    "choices": [{"index": j, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        for _, j, text, finish, ev in self.stream_texts([prompt_ids], params):
            if j not in started:
                started.add(j)
                yield chunk(j, {"role": "assistant"})
            counts[j] = counts.get(j, 0) + (1 if ev is not None else 0)
            found = []
            if names:
                stream = calls.setdefault(j, ToolCallStream(names))
                text = stream.feed(text)
                if finish:
                    rest, found = stream.finish()
                    text += rest
            if text:
                yield chunk(j, {"content": text})
            if found:
                yield chunk(j, {"tool_calls": [c.openai(k) for k, c in enumerate(found)]})
            if finish:
                yield chunk(j, {}, "tool_calls" if found else finish)
        yield {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model_path,
               "choices": [], "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": sum(counts.values()),
                                        "total_tokens": len(prompt_ids) + sum(counts.values())}}

    @staticmethod
    def _collect_chat(chunks, n: int) -> dict:
        texts = [""] * n
        finish = [None] * n
        tool_calls: list[list] = [[] for _ in range(n)]
        head = usage = None
        for c in chunks:
            head = head or c
            if "usage" in c:
                usage = c["usage"]
            for ch in c["choices"]:
                texts[ch["index"]] += ch["delta"].get("content", "")
                tool_calls[ch["index"]] += [{k: v for k, v in call.items() if k != "index"}
                                            for call in ch["delta"].get("tool_calls", [])]
                finish[ch["index"]] = ch["finish_reason"] or finish[ch["index"]]

        def message(j):
            if tool_calls[j]:
                return {"role": "assistant", "content": texts[j] or None, "tool_calls": tool_calls[j]}
            return {"role": "assistant", "content": texts[j]}

        return {"id": head["id"], "object": "chat.completion", "created": head["created"],
                "model": head["model"],
                "choices": [{"index": j, "message": message(j), "logprobs": None, "finish_reason": finish[j]}
                            for j in range(n)],
                "usage": usage}

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], max_tokens: int = 64,
                       temperature: float = 0.8, top_p: float = 0.95, top_k: int = 40,
                       min_p: float = 0.05, stop=None, seed: int | None = None, n: int = 1,
                       beam_width: int = 1, length_penalty: float = 1.0,
                       early_stopping: bool = True, response_format: dict | None = None,
                       grammar=None) -> list[list[str]]:
        """Many prompts at once through the scheduler; returns each prompt's n (or beam_width) texts."""
        params = self._params(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                              min_p=min_p, stop=stop, seed=seed, n=n, beam_width=beam_width,
                              length_penalty=length_penalty, early_stopping=early_stopping,
                              constraint=from_python(self.tokenizer, response_format, grammar))
        ids = [self.tokenize(p, special=True) if isinstance(p, str) else list(p) for p in prompts]
        width = beam_width if beam_width > 1 else n
        out = [[""] * width for _ in prompts]
        for i, j, text, _, _ in self.stream_texts(ids, params):
            out[i][j] += text
        return out
