"""Test-wide setup: make tests/ importable (for the shared reference helpers)
while the package under test is always the installed one."""

import sys
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))
