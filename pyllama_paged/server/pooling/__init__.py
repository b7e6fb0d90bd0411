"""Embeddings and rerank endpoints (OpenAI, Ollama, Cohere/Jina shapes)."""
