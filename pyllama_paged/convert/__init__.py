"""Converters that write other formats' weights as GGUF files this package runs."""
