"""Llama: llama-cpp-python's Python API over the paged engine. Its arguments,
defaults and return shapes are theirs (see llama_compat.py for the mapping);
every generation goes through the same scheduler (LLMEngine) as the server."""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any, Iterator, Sequence

import numpy as np

from .._native import GGML_LOG_DEBUG, lib
from ..constrain.formats import from_python
from ..engine import (EngineConfig, LoraRequest, PrefixTierConfig, RequestOutput, SamplingParams, SchedulerConfig,
                      SharedSteps, SpeculativeConfig, build_engine, list_devices, load_model)
from ..errors import PagedError, RequestError
from ..calls.chat_call import ChatCall, prepare_call
from ..vision.prompt_images import open_vision
from .llama_chat import chat_chunks, collect_chat, legacy_functions
from .llama_chat_format import is_vision_handler, vision_refusal
from .llama_compat import (CHAT_FORMATS, LLAMA_DEFAULT_SEED, CompatWarnings, LlamaState, LlamaTokenizer,
                           StopWatch, kv_cache_type_of, seed_of)
from .llama_completion import collect_completion, completion_chunks
from .llama_eval import TokenSampler, logits_after
from .llama_pretrained import find_pretrained
from .llama_speculative import speculative_of
from ..calls.sampling_options import PYTHON, sampling_params
from ..calls.text_stream import TextAssembler
from ..tokenizer.chat_template import ChatTemplate
from ..tokenizer.tokenizer import Tokenizer
from ..calls.embeddings import embed_for_llama, openai_list
from ..calls.rerank import rerank_for_llama


class Llama:
    """A local GGUF model with a paged KV cache (llama-cpp-python compatible API)."""

    def __init__(self, model_path: str | None = None, *, n_ctx: int = 512, n_batch: int = 512,
                 n_threads: int | None = None, n_threads_batch: int | None = None,
                 seed: int = LLAMA_DEFAULT_SEED, type_k: int | None = None, type_v: int | None = None,
                 chat_format: str | None = None, chat_handler=None, embedding: bool = False,
                 pooling_type: int = -1, logits_all: bool = False, last_n_tokens_size: int = 64,
                 lora_path: str | None = None, lora_scale: float = 1.0, verbose: bool = False,
                 paged: bool = True, block_size: int = 32, kv_cache_type: str = "f16", n_seq_max: int = 1,
                 repack_weights: bool = True, pack_panels: bool = True, n_gpu_layers: int = 0,
                 main_gpu: int = 0, speculative: Any = None, prefix_cache_ram: int = 0,
                 prefix_cache_dir: str | None = None, draft_model: Any = None, mmproj: str | None = None,
                 clip_model_path: str | None = None, **llama_cpp_args: Any):
        """Load a GGUF (model_path None: the embedded default model). llama-cpp-python's other
        arguments are accepted; those that change nothing here warn once (llama_compat).
        pack_panels=False keeps GGML's kernels for the weights our panel GEMMs would take.
        n_gpu_layers: layers on GGML's main_gpu-th GPU (-1: all and the output head).
        speculative: speculative decoding by prompt lookup, e.g. {"method": "prompt_lookup",
        "num_draft_tokens": 4, "max_ngram": 3}, or by a small draft model sharing this model's
        tokenizer, {"method": "draft_model", "draft_model": path, "num_draft_tokens": 4}; True
        or a SpeculativeConfig (None: off); a request opts out with SamplingParams(speculative=False).
        draft_model: llama-cpp-python's LlamaPromptLookupDecoding, the same prompt lookup.
        prefix_cache_ram: bytes of host RAM that keep computed prompt blocks after the KV pool
        evicts them (0: none); prefix_cache_dir: a directory keeping them across runs (None: none).
        lora_path: a LoRA adapter GGUF (llama.cpp's convert_lora_to_gguf.py) every call runs, at
        lora_scale; the base weights stay as they are (llama.cpp merges nothing either).
        mmproj (or clip_model_path, llama-cpp-python's name): a vision projector GGUF; chats may
        then carry image_url parts (data URLs)."""
        self.llm_engine = self._model = self._steps = self._vision = None   # close() is safe after a failed init
        self._warnings = CompatWarnings()
        self._warnings.constructor_args(llama_cpp_args)
        lora = None if lora_path is None else LoraRequest("default", lora_scale)   # checks the scale first
        if n_threads_batch is not None and n_threads is not None and n_threads_batch != n_threads:
            self._warnings.warn("n_threads_batch", "n_threads_batch is not separate here: n_threads runs "
                                                   "prompts and generation alike")
        self.verbose = verbose
        self._seed = seed_of(seed)
        if verbose:
            lib.pp_set_ggml_log_level(GGML_LOG_DEBUG)
        self.embedding, self.pooling_type_arg, self.logits_all = embedding, pooling_type, logits_all
        self.last_n_tokens_size = last_n_tokens_size
        if chat_handler is not None and is_vision_handler(chat_handler):
            raise vision_refusal(f"chat_handler={type(chat_handler).__name__}")
        self.chat_format, self.chat_handler = chat_format, chat_handler
        kv_cache_type = kv_cache_type_of(type_k, type_v, kv_cache_type)
        # refused before the model loads
        speculative = SpeculativeConfig.parse(speculative_of(draft_model, speculative))
        if n_gpu_layers and not any(d.is_gpu for d in list_devices()):
            # llama.cpp runs such a call on the CPU: code written for a GPU machine keeps working
            self._warnings.warn("n_gpu_layers", f"n_gpu_layers={n_gpu_layers} asks for a GPU, but this GGML "
                                                "lists none: running on the CPU (see the README's GPU builds)")
            n_gpu_layers = 0
        # threads given: exactly that many; else each step on the cores free at the time (EngineConfig)
        config = EngineConfig(model_path=model_path, paged=paged, n_ctx=n_ctx, n_seq_max=n_seq_max,
                              n_threads=n_threads or n_threads_batch, block_size=block_size,
                              kv_cache_type=kv_cache_type, repack_weights=repack_weights, pack_panels=pack_panels,
                              n_gpu_layers=n_gpu_layers, main_gpu=main_gpu, speculative=speculative,
                              prefix_tiers=PrefixTierConfig(ram_bytes=prefix_cache_ram, disk_dir=prefix_cache_dir))
        self._model = load_model(config)
        self.model_path = self._model.path
        self._tokenizer = Tokenizer.from_metadata(self._model.metadata)
        self._n_ctx = config.context_for(self._model.config.n_ctx_train)   # <= 0: the training context
        self.n_batch = min(n_batch, self._n_ctx)
        self.paged = paged
        self._tokens: list[int] = []   # what the model has evaluated: the last prompt and its answer
        # (the evaluated tokens, the logits row after them), kept by eval; a generation that
        # replaces self._tokens makes it stale (the list is another object then)
        self._last_logits: tuple[list[int], np.ndarray] | None = None
        self._token_sampler: TokenSampler | None = None
        config = dataclasses.replace(config, n_ctx=self._n_ctx, n_batch=self.n_batch,
                                     scheduler=SchedulerConfig(max_num_batched_tokens=self.n_batch))
        self.n_threads = config.n_threads
        self.llm_engine = build_engine(config, self._model, self._tokenizer.eot_ids)
        self._attach(lora, lora_path, mmproj or clip_model_path)
        self._steps = SharedSteps(self.llm_engine)
        # bert: embeddings only, no KV cache and no chat
        self.chat_template = None if self._model.config.is_encoder else self._chat_template(chat_format)

    def _attach(self, lora: LoraRequest | None, lora_path: str | None, projector: str | None) -> None:
        """The engine's default LoRA adapter (lora_path at lora's scale) and the vision projector,
        where given; a failure frees what __init__ loaded."""
        try:
            if lora is not None:
                self.llm_engine.add_lora(lora.name, lora_path)
                self.llm_engine.default_lora = lora
            if projector:
                self._vision = open_vision(projector, self._model.config.n_embd, self._tokenizer,
                                           self.n_threads or 1)
        except BaseException:
            self._free()
            raise

    def _chat_template(self, chat_format: str | None) -> ChatTemplate:
        if chat_format is None or chat_format == "chat_template.default":
            return ChatTemplate.for_model(self._model.metadata, self._model.config.arch)
        if chat_format in CHAT_FORMATS:
            return ChatTemplate(CHAT_FORMATS[chat_format])
        self._warnings.warn("chat_format", f"chat_format {chat_format!r} is not built in (known: "
                                           f"{', '.join(sorted(CHAT_FORMATS))}); the GGUF's chat template is used")
        return ChatTemplate.for_model(self._model.metadata, self._model.config.arch)

    @classmethod
    def from_pretrained(cls, repo_id: str, filename: str | None = None, additional_files=None,
                        local_dir=None, local_dir_use_symlinks="auto", cache_dir=None, progress=None,
                        **kwargs) -> "Llama":
        """A Llama for a file of a Hugging Face repository: found on this machine (a local
        directory, the Hugging Face cache, an installed model package) or downloaded from the
        Hub (HF_ENDPOINT) and checked against its sha256. progress(status, completed, total)
        sees the download's bytes (default: a bar on stderr, unless verbose=False)."""
        if additional_files and "-00001-of-" not in (filename or ""):
            # llama-cpp-python's use of them: a split GGUF's other parts, which come with its first here
            raise RequestError("additional_files is for the other parts of a split GGUF, fetched with its first "
                               "part here: give filename='*-00001-of-0000N.gguf'")
        closing = None
        if progress is None and kwargs.get("verbose", True):
            from ..models.progress import TerminalProgress

            progress = closing = TerminalProgress()
        try:
            path = find_pretrained(repo_id, filename, local_dir, cache_dir, progress)
        finally:
            if closing is not None:
                closing.close()
        return cls(model_path=path, **kwargs)

    # ---- model facts --------------------------------------------------------
    def n_ctx(self) -> int:
        """The context window, in tokens."""
        return self._n_ctx

    def n_vocab(self) -> int:
        """The vocabulary size."""
        return self._model.config.n_vocab

    def n_embd(self) -> int:
        """The embedding (hidden) size."""
        return self._model.config.n_embd

    def token_bos(self) -> int:
        """The beginning-of-sequence token id (-1 if none)."""
        return -1 if self._tokenizer.bos_id is None else self._tokenizer.bos_id

    def token_eos(self) -> int:
        """The end-of-sequence token id (-1 if none)."""
        return -1 if self._tokenizer.eos_id is None else self._tokenizer.eos_id

    def token_nl(self) -> int:
        """The newline token id (-1 if none)."""
        ids = self._tokenizer.encode("\n", add_special=False)
        return ids[0] if len(ids) == 1 else -1

    def tokenizer(self) -> LlamaTokenizer:
        """llama-cpp-python's tokenizer object for this model."""
        return LlamaTokenizer(self)

    @property
    def metadata(self) -> dict:
        return {k: v for k, v in self._model.metadata.items() if not k.startswith("tokenizer.ggml.")}

    def tokenize(self, text: bytes | str, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of UTF-8 text (a str is accepted too)."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tokenizer.encode(text, add_special=add_bos, parse_special=special)

    def detokenize(self, tokens: Sequence[int], prev_tokens: Sequence[int] | None = None,
                   special: bool = False) -> bytes:
        """UTF-8 bytes of token ids (prev_tokens is accepted; the bytes do not depend on it)."""
        return self._tokenizer.decode_bytes(tokens, skip_special=not special)

    def stats(self) -> dict:
        """KV pool and scheduler figures (pages used/free/shared/cached, hit rate, ...)."""
        return self._shared_steps().call(lambda engine: engine.stats())

    # ---- state ---------------------------------------------------------------
    @property
    def n_tokens(self) -> int:
        return len(self._tokens)

    @n_tokens.setter
    def n_tokens(self, n: int) -> None:
        """Keep the first n evaluated tokens (llama-cpp-python's loops rewind this way)."""
        if not 0 <= n <= len(self._tokens):
            raise RequestError(f"n_tokens {n} is outside 0..{len(self._tokens)} (the evaluated tokens)")
        self._tokens = self._tokens[:n]

    @property
    def input_ids(self) -> np.ndarray:
        """The evaluated tokens (the last prompt and what was generated after it)."""
        return np.array(self._tokens, dtype=np.intc)

    def reset(self) -> None:
        """Forget the evaluated tokens (their pages stay in the prefix cache until reused)."""
        self._tokens = []
        self._last_logits = None

    def set_seed(self, seed: int) -> None:
        """The seed of later generations that name none (and of sample()'s draws from now on)."""
        self._seed = seed_of(seed)
        self._drop_token_sampler()

    def _drop_token_sampler(self) -> None:
        if self._token_sampler is not None:
            self._token_sampler.close()
            self._token_sampler = None

    def set_cache(self, cache) -> None:
        """Accepted: the paged pool's prefix cache already keeps recent prompts' KV."""
        self.cache = cache

    def save_state(self) -> LlamaState:
        """The evaluated tokens (see LlamaState for why no KV bytes are copied)."""
        return LlamaState(self.input_ids, np.zeros((0, self.n_vocab()), dtype=np.float32), self.n_tokens,
                          b"", 0, self._seed)

    def load_state(self, state: LlamaState) -> None:
        """Make state's tokens the evaluated ones again (generate(reset=False) continues them)."""
        ids = [int(t) for t in np.asarray(state.input_ids)[:state.n_tokens]]
        if any(t < 0 or t >= self.n_vocab() for t in ids):
            raise RequestError("the state holds token ids outside this model's vocabulary")
        self._tokens = ids
        self._last_logits = None
        self._seed = state.seed
        self._drop_token_sampler()

    def close(self) -> None:
        """Free the runner and the model (between steps: other threads' calls then fail cleanly)."""
        steps = getattr(self, "_steps", None)
        if steps is not None:
            steps.close(self._free)
        else:   # a failed __init__
            self._free()

    @property
    def runner(self):
        """The engine's model runner (for tests and tools that drive the model directly)."""
        return None if self.llm_engine is None else self.llm_engine.runner

    def _free(self) -> None:
        if getattr(self, "_token_sampler", None) is not None:
            self._drop_token_sampler()
        if getattr(self, "llm_engine", None) is not None:
            self.llm_engine.close()
            self.llm_engine = None
        if getattr(self, "_vision", None) is not None:
            self._vision.close()
            self._vision = None
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
        (and the token count too with return_count). As theirs, a model that does not pool
        (a decoder whose GGUF names no pooling, or Llama(pooling_type=0)) gives each input
        one vector per token instead; pooling= or Llama(pooling_type=1..3) pools."""
        vectors, count = embed_for_llama(self, input, normalize, truncate, pooling, dimensions, per_token=True)
        return (vectors, count) if return_count else vectors

    def create_embedding(self, input: str | Sequence[str], model: str | None = None,
                         pooling: str | None = None, dimensions: int | None = None) -> dict:
        """OpenAI-shaped embedding list (llama-cpp-python's create_embedding)."""
        batch = [input] if isinstance(input, str) else list(input)
        vectors, count = embed_for_llama(self, batch, True, True, pooling, dimensions)
        return openai_list(vectors, model or self.model_path, count)

    def rerank(self, query: str, documents: Sequence, top_n: int | None = None, return_documents: bool = False,
               truncate: bool = False) -> dict:
        """Documents (strings or {"text": ...}) ranked against query, as /v1/rerank answers (see
        calls/rerank.py); the model must be a reranker, or a decoder loaded with pooling_type=4."""
        return rerank_for_llama(self, query, documents, top_n, return_documents, truncate)

    # ---- generation: every path goes through the scheduler -----------------
    def _sampling_fields(self, logits_processor, stopping_criteria, fields: dict) -> tuple[dict, Any]:
        """llama-cpp-python's keyword arguments as sampling fields, and the StopWatch that
        stopping criteria read (or None)."""
        watch = StopWatch(logits_processor) if stopping_criteria is not None else None
        return {"penalty_last_n": self.last_n_tokens_size, **fields, "logits_processor": watch or logits_processor}, \
            watch

    def _params(self, logits_processor=None, stopping_criteria=None, **fields) -> tuple[SamplingParams, Any]:
        """SamplingParams from llama-cpp-python's keyword arguments (the model's seed when
        none is given), and the StopWatch that stopping criteria read (or None)."""
        fields, watch = self._sampling_fields(logits_processor, stopping_criteria, fields)
        return sampling_params(PYTHON, fields, seed=self._seed), watch

    def generate(self, tokens: Sequence[int], top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                 typical_p: float = 1.0, temp: float = 0.80, repeat_penalty: float = 1.0, reset: bool = True,
                 frequency_penalty: float = 0.0, presence_penalty: float = 0.0, tfs_z: float = 1.0,
                 mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                 penalize_nl: bool = True, logits_processor=None, stopping_criteria=None, grammar=None,
                 *, seed: int | None = None) -> Iterator[int]:
        """Yield token ids after tokens, as llama-cpp-python does: past end-of-text tokens too,
        until the context is full or the caller stops iterating (which frees the pages).
        reset=False continues after the evaluated tokens. An older form,
        generate(ids, SamplingParams), generates as those parameters say."""
        if isinstance(top_k, SamplingParams):
            params, watch = top_k, None
        else:
            self._warnings.sampling_args(typical_p=typical_p, tfs_z=tfs_z, mirostat_mode=mirostat_mode)
            params, watch = self._params(
                logits_processor, stopping_criteria, top_k=top_k, top_p=top_p, min_p=min_p, temperature=temp,
                repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                seed=seed, ignore_eos=True, max_tokens=0, constraint=from_python(self._tokenizer, None, grammar))
        prompt = (list(self._tokens) if not reset else []) + list(tokens)
        criteria = (watch, stopping_criteria) if watch is not None else None
        for _, _, _, _, event in self.stream_texts([prompt], params, criteria):
            if event is not None:
                yield event.token_id

    # ---- llama-cpp-python's low-level loop: eval appends, sample draws -------
    def eval(self, tokens: Sequence[int]) -> None:
        """Append tokens to the evaluated ones and compute the logits after them (through
        the scheduler; the prefix cache spares recomputing what was evaluated before)."""
        ids = self._tokens + [int(t) for t in tokens]
        self._last_logits = (ids, logits_after(self._shared_steps(), ids))
        self._tokens = ids

    @property
    def eval_logits(self):
        """The logits after the evaluated tokens, as llama-cpp-python's deque of one row."""
        return deque([self._logits_now().tolist()] if self._tokens else [], maxlen=1)

    def _logits_now(self) -> np.ndarray:
        """The logits row after the evaluated tokens, computed if eval did not (a generation
        since may have changed them)."""
        if not self._tokens:
            raise RequestError("nothing is evaluated: call eval(tokens) first")
        held = self._last_logits
        if held is None or held[0] is not self._tokens:
            self._last_logits = held = (self._tokens, logits_after(self._shared_steps(), self._tokens))
        return held[1]

    def sample(self, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
               temp: float = 0.80, repeat_penalty: float = 1.0, frequency_penalty: float = 0.0,
               presence_penalty: float = 0.0, tfs_z: float = 1.0, mirostat_mode: int = 0,
               mirostat_eta: float = 0.1, mirostat_tau: float = 5.0, penalize_nl: bool = True,
               logits_processor=None, grammar=None, idx: int | None = None) -> int:
        """The next token id after the evaluated ones, drawn as llama-cpp-python's sample
        draws it (penalties over the last last_n_tokens_size tokens, then top_k, top_p,
        min_p and temp; temp 0 is greedy); it is not appended: eval([token]) does that.
        A grammar advances with each token drawn under the same grammar object."""
        self._warnings.sampling_args(typical_p=typical_p, tfs_z=tfs_z, mirostat_mode=mirostat_mode,
                                     penalize_nl=penalize_nl)
        if idx is not None and idx not in (-1, self.n_tokens - 1):
            raise RequestError(f"sample(idx={idx}): only the logits after the last evaluated token are kept "
                               f"(idx {self.n_tokens - 1})")
        logits = self._logits_now()
        params = sampling_params(PYTHON, {"top_k": top_k, "top_p": top_p, "min_p": min_p, "temperature": temp,
                                          "repeat_penalty": repeat_penalty, "frequency_penalty": frequency_penalty,
                                          "presence_penalty": presence_penalty, "max_tokens": 1,
                                          "penalty_last_n": self.last_n_tokens_size,
                                          "logits_processor": logits_processor}, seed=self._seed)
        if self._token_sampler is None:
            self._token_sampler = TokenSampler(self.n_vocab(), self._seed)
        return self._token_sampler.sample(logits, list(self._tokens), params, grammar,
                                          lambda g: from_python(self._tokenizer, None, g))

    def create_completion(self, prompt: str | Sequence[int], suffix: str | None = None, max_tokens: int | None = 16,
                          temperature: float = 0.8, top_p: float = 0.95, min_p: float = 0.05,
                          typical_p: float = 1.0, logprobs: int | None = None, echo: bool = False,
                          stop: str | Sequence[str] | None = None, frequency_penalty: float = 0.0,
                          presence_penalty: float = 0.0, repeat_penalty: float = 1.0, top_k: int = 40,
                          stream: bool = False, seed: int | None = None, tfs_z: float = 1.0,
                          mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                          model: str | None = None, stopping_criteria=None, logits_processor=None,
                          grammar=None, logit_bias: dict | None = None, *, ignore_eos: bool = False,
                          response_format: dict | None = None, speculative: bool = True):
        """OpenAI-shaped text completion (a dict, or an iterator of chunks if stream);
        speculative=False opts this call out of the model's speculative decoding."""
        if suffix is not None:
            raise RequestError("suffix (fill-in-the-middle) is not supported by this model")
        self._warnings.sampling_args(typical_p=typical_p, tfs_z=tfs_z, mirostat_mode=mirostat_mode)
        params, watch = self._params(
            logits_processor, stopping_criteria, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, min_p=min_p, repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty, stop=stop, seed=seed, logprobs=logprobs, ignore_eos=ignore_eos,
            logit_bias=self._logit_bias(logit_bias), speculative=speculative,
            constraint=from_python(self._tokenizer, response_format, grammar))
        prompt_ids = list(prompt) if not isinstance(prompt, str) else self.tokenize(prompt, special=True)
        criteria = (watch, stopping_criteria) if watch is not None else None
        chunks = completion_chunks(self, prompt, prompt_ids, params, echo, model or self.model_path, criteria)
        return chunks if stream else collect_completion(chunks)

    def __call__(self, prompt, suffix=None, max_tokens=16, *args, **kwargs):
        """create_completion."""
        return self.create_completion(prompt, suffix, max_tokens, *args, **kwargs)

    @staticmethod
    def _logit_bias(bias: dict | None) -> dict[int, float] | None:
        """llama-cpp-python's {token id (int or str): bias} as ints to floats."""
        if not bias:
            return None
        try:
            return {int(k): float(v) for k, v in bias.items()}
        except (TypeError, ValueError):
            raise RequestError("logit_bias must map token ids to numbers") from None

    # ---- scheduled generation: many prompts, n samples, beams, chat ---------
    def stream_texts(self, prompts_ids: Sequence[Sequence[int]], params: SamplingParams, criteria=None,
                     images: Sequence[list] | None = None):
        """Run prompts together through the scheduler; yield (prompt index, sample index,
        text delta, finish reason or None, token event or None) as text becomes available.
        criteria: (StopWatch, stopping criteria) for one prompt with one sample. images[i]:
        prompt i's, placed by prepare_call. Safe from many threads at once: their requests
        share the engine's steps."""
        steps = self._shared_steps()
        if criteria is not None and (len(prompts_ids) > 1 or params.n > 1 or params.beam_width > 1):
            raise RequestError("stopping_criteria applies to one prompt with one sample")
        requests = []
        try:
            for i, ids in enumerate(prompts_ids):
                requests.append(steps.add_request(list(ids), params, images[i] if images else ()))
                if requests[-1].error:
                    raise RequestError(f"prompt {i}: {requests[-1].error}")
        except BaseException:
            for r in requests:
                steps.abort(r.request_id)
            raise
        tokens = list(prompts_ids[0])
        self._tokens = tokens
        index = {r.request_id: i for i, r in enumerate(requests)}
        assemblers = [TextAssembler(self._tokenizer, params.stop) for _ in requests]
        width = params.beam_width if params.beam_width > 1 else params.n
        try:
            while outputs := steps.next_outputs(index):
                for out in outputs:
                    i = index[out.request_id]
                    if out.error:
                        raise PagedError(out.error)
                    if criteria is not None and out.events and self._stopped(criteria):
                        steps.abort(out.request_id)   # the token drawn is dropped, as llama-cpp-python does
                        out = RequestOutput(out.request_id, finished=True, finish_reasons=["stop"])
                    assembler = assemblers[i]
                    if i == 0:
                        tokens += [e.token_id for e in out.events if e.seq_index == 0]
                    for d in assembler.feed(out):
                        yield i, d.index, d.text, d.finish_reason, d.event
                    if out.finished:
                        del index[out.request_id]
                    elif params.stop and assembler.all_stopped(width):
                        steps.abort(out.request_id)   # every sample hit a stop string
                        del index[out.request_id]
                if not index:
                    break
        finally:
            for r in requests:
                steps.abort(r.request_id)

    def _shared_steps(self) -> SharedSteps:
        if self.llm_engine is None:
            raise PagedError("this Llama is closed")
        return self._steps

    @staticmethod
    def _stopped(criteria) -> bool:
        watch, stopping_criteria = criteria
        row = watch.next_row()
        return row is not None and bool(stopping_criteria(*row))

    def create_chat_completion(self, messages: list[dict], functions: list | None = None, function_call=None,
                               tools: list | None = None, tool_choice=None, temperature: float = 0.2,
                               top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05, typical_p: float = 1.0,
                               stream: bool = False, stop: str | Sequence[str] | None = None,
                               seed: int | None = None, response_format: dict | None = None,
                               max_tokens: int | None = None, presence_penalty: float = 0.0,
                               frequency_penalty: float = 0.0, repeat_penalty: float = 1.0, tfs_z: float = 1.0,
                               mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                               model: str | None = None, logits_processor=None, grammar=None,
                               logit_bias: dict | None = None, logprobs: bool | None = None,
                               top_logprobs: int | None = None, *, n: int = 1, ignore_eos: bool = False,
                               stopping_criteria=None, speculative: bool = True, think: bool | None = None,
                               reasoning_budget: int | None = None):
        """OpenAI-shaped chat completion over the model's chat template (or chat_handler's
        answer when one was given); tool calls come back in message.tool_calls, a thinking
        model's thinking in message.reasoning_content. speculative=False opts this call out
        of the model's speculative decoding; think switches a thinking template's thinking
        on or off (its enable_thinking; None: the template's default); reasoning_budget:
        thinking tokens at most before the think block is closed (None or -1: no budget)."""
        if self.chat_handler is not None:
            return self.chat_handler(
                llama=self, messages=messages, functions=functions, function_call=function_call, tools=tools,
                tool_choice=tool_choice, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                typical_p=typical_p, logprobs=logprobs, top_logprobs=top_logprobs, stream=stream, stop=stop,
                seed=seed, response_format=response_format, max_tokens=max_tokens,
                presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                repeat_penalty=repeat_penalty, tfs_z=tfs_z, mirostat_mode=mirostat_mode,
                mirostat_tau=mirostat_tau, mirostat_eta=mirostat_eta, model=model,
                logits_processor=logits_processor, grammar=grammar, logit_bias=logit_bias)
        self._warnings.sampling_args(typical_p=typical_p, tfs_z=tfs_z, mirostat_mode=mirostat_mode)
        tools, tool_choice = legacy_functions(functions, function_call, tools, tool_choice)
        fields, watch = self._sampling_fields(logits_processor, stopping_criteria, dict(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
            repeat_penalty=repeat_penalty, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
            stop=stop, seed=seed, n=n, ignore_eos=ignore_eos, logit_bias=self._logit_bias(logit_bias),
            speculative=speculative, logprobs=(top_logprobs or 0) if logprobs else None))
        call = ChatCall(messages=messages, tools=tools, tool_choice=tool_choice,
                        structured=lambda tokenizer: from_python(tokenizer, response_format, grammar),
                        surface=PYTHON, sampling=fields, sampling_defaults={"seed": self._seed}, thinking=think,
                        thinking_budget=reasoning_budget)
        prepared = prepare_call(call, self.chat_template, self._tokenizer, vision=self._vision)
        params = call.params(prepared.constraint, prepared.thinking_budget)
        criteria = (watch, stopping_criteria) if watch is not None else None
        chunks = chat_chunks(self, prepared.prompt_ids, params, prepared.tool_names, model or self.model_path,
                             criteria, prepared.thinks, prepared.opens_thinking, prepared.harmony, prepared.images)
        return chunks if stream else collect_chat(chunks, n)

    def create_chat_completion_openai_v1(self, *args, **kwargs):
        """create_chat_completion's answer as the openai package's types (needs openai)."""
        try:
            from openai.types.chat import ChatCompletion, ChatCompletionChunk
        except ImportError:
            raise ImportError("create_chat_completion_openai_v1 needs the openai package") from None
        answer = self.create_chat_completion(*args, **kwargs)
        if kwargs.get("stream"):
            return (ChatCompletionChunk(**chunk) for chunk in answer)
        return ChatCompletion(**answer)

    def generate_batch(self, prompts: Sequence[str | Sequence[int]], max_tokens: int = 64,
                       temperature: float = 0.8, top_p: float = 0.95, top_k: int = 40,
                       min_p: float = 0.05, stop=None, seed: int | None = None, n: int = 1,
                       beam_width: int = 1, length_penalty: float = 1.0,
                       early_stopping: bool = True, response_format: dict | None = None,
                       grammar=None) -> list[list[str]]:
        """Many prompts at once through the scheduler; returns each prompt's n (or beam_width) texts."""
        params, _ = self._params(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                                 min_p=min_p, stop=stop, seed=seed, n=n, beam_width=beam_width,
                                 length_penalty=length_penalty, early_stopping=early_stopping,
                                 constraint=from_python(self._tokenizer, response_format, grammar))
        ids = [self.tokenize(p, special=True) if isinstance(p, str) else list(p) for p in prompts]
        width = beam_width if beam_width > 1 else n
        out = [[""] * width for _ in prompts]
        for i, j, text, _, _ in self.stream_texts(ids, params):
            out[i][j] += text
        return out
