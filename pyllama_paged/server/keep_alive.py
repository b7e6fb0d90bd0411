"""Ollama's keep_alive, which its generation and embedding routes take: how long the
model stays loaded after the request ("5m", 300, 0 to unload now, -1 for ever)."""

from __future__ import annotations

import math
import re
from typing import Any

from .generation import APIError

_DURATION = re.compile(r"^(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)?$")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1, "m": 60, "h": 3600, None: 1}
MAX_KEEP_ALIVE = 100 * 365 * 86400   # seconds; longer is what -1 (forever) says


def keep_alive_seconds(value: Any) -> float | None:
    """Seconds from Ollama's keep_alive ("5m", "1h30m" is not Ollama's; 300; "0"; -1 forever);
    None when not given. A 400 for anything else."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value).strip())
        if not match:
            raise APIError(400, f"keep_alive {value!r} is not a duration such as \"5m\", \"30s\", 0 or -1",
                           "keep_alive")
        seconds = float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    # NaN never expires and never compares; a huge value overflows every date it is added to
    if not math.isfinite(seconds) or seconds > MAX_KEEP_ALIVE:
        raise APIError(400, f"keep_alive {value!r} is not a usable duration: at most {MAX_KEEP_ALIVE} seconds "
                       "(100 years), or -1 to keep the model loaded", "keep_alive")
    return seconds
