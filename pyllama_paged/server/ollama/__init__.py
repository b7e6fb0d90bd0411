"""Ollama's dialect: chat/generate, model management, pulls."""
