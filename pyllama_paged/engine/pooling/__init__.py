"""Pooled outputs: decoder embeddings and the encoder engine (BERT)."""
