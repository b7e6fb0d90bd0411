"""Where a sequence's KV lives: the block pool, the KV manager, the step's batch buffers, layer
groups, prefix-cache events and tiers."""
