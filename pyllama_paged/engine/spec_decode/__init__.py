"""Speculative decoding: drafts (n-gram and draft model), their batch, lengths and verification."""
