"""What the tests and the benchmarks share: correctness oracles (a NumPy reference forward,
tiny GGUF writers), agreement rules, a server runner and harnesses. Not part of the user API."""
