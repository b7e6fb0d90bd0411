"""Engine benchmarks: LLMEngine and the model runner against llama.cpp's tools."""
