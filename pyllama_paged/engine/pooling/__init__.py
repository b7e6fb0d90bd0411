"""Encoders and pooled outputs: embeddings, the encoder engine, the rerank head."""
