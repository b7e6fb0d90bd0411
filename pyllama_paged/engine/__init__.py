"""The serving engine's front door: everything outside the engine imports from here.

Inside, the districts import only downward: params.py and outputs.py (what a request
asks, what a step returns) < kv/ (where a sequence's KV lives) < worker/ (what runs a
step) < spec_decode/ | sched/ | pooling/ (drafts, what runs next, embeddings) < this
folder's files (one step, its config, the loop, the builder). Nothing here knows HTTP."""

from .params import (MAX_BEAM_WIDTH, MAX_LOGPROBS, MAX_SCORE_ROWS, POOLINGS, TOKEN_STATES, EmbedParams,
                     LoraRequest, SamplingParams, ScoreParams, default_pooling)
from .outputs import RequestOutput, TokenEvent
from .kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventListener
from .kv.groups import KVGroups
from .kv.state_pool import state_bytes_per_sequence
from .kv.prefix_tiers import PrefixTierConfig
from .worker.devices import gpu_device, list_devices
from .worker.model import Model, default_model_path, load_model
from .worker.lora import LoraAdapter, split_scale
from .worker.model_runner import KV_TYPES, dense_kv_bytes_per_token
from .worker.sampler import BatchSampler, Sampler
from .worker.thread_policy import MAX_THREADS
from .spec_decode.draft import PromptLookupDrafter, SpeculativeConfig
from .sched.scheduler import SchedulerConfig
from .pooling.encoder import EncoderEngine
from .config import EngineConfig
from .llm_engine import LLMEngine
from .builder import build_engine
from .loop import EngineLoop, RequestStream
from .shared_steps import SharedSteps

__all__ = [
    # what a request asks, and their bounds
    "SamplingParams", "EmbedParams", "ScoreParams", "LoraRequest", "MAX_LOGPROBS", "MAX_BEAM_WIDTH", "MAX_SCORE_ROWS",
    "POOLINGS", "TOKEN_STATES", "default_pooling",
    # what a step returns; the prefix cache's events
    "RequestOutput", "TokenEvent", "KVEvent", "KVEventListener", "BlockStored", "BlockRemoved", "AllBlocksCleared",
    # the engine, its config, and how it is built
    "LLMEngine", "EncoderEngine", "EngineConfig", "SchedulerConfig", "SpeculativeConfig", "PrefixTierConfig",
    "KV_TYPES", "MAX_THREADS", "load_model", "build_engine",
    # callers of one engine: the background loop and its request streams, shared steps
    "EngineLoop", "RequestStream", "SharedSteps",
    # the model: weights, devices, KV bytes per token, a sampler for the Python API's sample()
    "Model", "default_model_path", "list_devices", "gpu_device", "KVGroups", "dense_kv_bytes_per_token",
    "BatchSampler", "Sampler", "PromptLookupDrafter", "LoraAdapter", "split_scale",
    # a hybrid model's (Qwen3.5/3.6) recurrent state bytes per sequence
    "state_bytes_per_sequence",
]
