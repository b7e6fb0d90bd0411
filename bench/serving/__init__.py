"""Serving benchmarks: the HTTP server under traces and load, beside its peers."""
