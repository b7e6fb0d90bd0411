"""The serving engine: requests and their sequences, the KV manager over the
block pool, the scheduler with preemption, the model runner, the sampler, one
step (LLMEngine) and the background loop (EngineLoop). Nothing here knows HTTP."""
