"""The benchmarks, a package run from the checkout's root: `python -m bench.<shelf>.<script>`
(bench/README.md is the index of their results)."""
