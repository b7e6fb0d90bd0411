"""HTTP server: Ollama- and OpenAI-compatible APIs on the paged engine."""
