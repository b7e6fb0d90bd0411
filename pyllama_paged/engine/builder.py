"""The one way an engine is built for a loaded model: an EncoderEngine for an
embedding (encoder) model, an LLMEngine from its EngineConfig otherwise."""

from __future__ import annotations

from .config import EngineConfig
from .pooling.encoder import EncoderEngine, encoder_engine
from .llm_engine import LLMEngine
from .worker.model import Model
from .worker.thread_policy import ThreadPolicy


def build_engine(config: EngineConfig, model: Model, eot_ids=None) -> LLMEngine | EncoderEngine:
    """The engine that serves model with config (the model stays the caller's: close it
    after engine.close())."""
    if model.config.is_encoder:   # embeddings only: no KV cache, no scheduler
        return encoder_engine(model, config.n_threads)[1]
    engine = LLMEngine.from_config(config, model=model, eot_ids=eot_ids)
    if config.adapt_threads:
        engine.runner.thread_policy = ThreadPolicy(config.n_threads)
    return engine
