"""Test-wide setup: make tests/ importable (for cuda_harness, which builds from the
repository's native/cuda sources) while the package under test is always the installed one.
What tests and benchmarks share lives in pyllama_paged.testing."""

import sys
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))
