"""Constrained decoding: grammars (JSON, JSON schema, regex, GBNF/Lark) turned
into per-sequence token masks for the batched sampler, through llguidance."""
