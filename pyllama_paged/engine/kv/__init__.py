"""Where a sequence's KV lives: the block pool, the KV manager, layer groups, prefix-cache events and tiers."""
