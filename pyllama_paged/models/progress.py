"""A pull's progress drawn on a terminal (stderr by default): one bar per status that
counts bytes, redrawn in place; on a stream that is not a terminal, one line per status
(a log must not fill with carriage returns)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_WIDTH = 28


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KB' (decimal units, as Ollama prints them)."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


class TerminalProgress:
    """A progress callback (status, completed, total) that draws on stream."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.is_tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.status: str | None = None
        self.started = time.monotonic()
        self._open_line = False

    def __call__(self, status: str, completed: int, total: int) -> None:
        if status != self.status:
            self._end_line()
            self.status, self.started = status, time.monotonic()
            if not self.is_tty or not total:
                self.stream.write(f"{status}\n")
                self.stream.flush()
                return
        if not self.is_tty or not total:
            return
        share = min(1.0, completed / total) if total else 0.0
        filled = int(share * BAR_WIDTH)
        elapsed = time.monotonic() - self.started
        rate = f" {human_bytes(completed / elapsed)}/s" if elapsed > 0.5 else ""
        self.stream.write(f"\r{status} {share:4.0%} ▕{'█' * filled}{' ' * (BAR_WIDTH - filled)}▏ "
                          f"{human_bytes(completed)}/{human_bytes(total)}{rate}\x1b[K")
        self.stream.flush()
        self._open_line = True

    def _end_line(self) -> None:
        if self._open_line:
            self.stream.write("\n")
            self._open_line = False

    def close(self) -> None:
        """End the bar's line (after a failure mid-download too)."""
        self._end_line()
        self.stream.flush()
