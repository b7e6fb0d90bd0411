"""GGML's log level, set once when the library loads."""

from __future__ import annotations

from .library import lib

GGML_LOG_DEBUG, GGML_LOG_WARN = 1, 3   # ggml_log_level values
# GGML's default logger prints debug lines (one per repacked weight) to stderr.
lib.pp_set_ggml_log_level(GGML_LOG_WARN)
