"""Speculative decoding: drafts (n-gram and draft model), their lengths and verification."""
