"""Kernel benchmarks: paged attention, the pool, the sampler, token masks."""
