"""The Python API: llama-cpp-python's `Llama` over the paged engine, and what it shares
with the server (API fields to sampling parameters, token events to text, embedding inputs)."""
