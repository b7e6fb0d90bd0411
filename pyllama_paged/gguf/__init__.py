"""GGUF files: the one reader (metadata, tensor table, memory map) and the model
configuration read from their metadata."""
