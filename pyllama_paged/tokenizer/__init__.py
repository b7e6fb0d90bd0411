"""Text to token ids and back from a GGUF vocabulary (SentencePiece and
byte-level BPE, agreeing with llama.cpp), and chat templates."""
