"""A one-line progress bar on stderr (redrawn at most a few times a second; no dependency)."""

from __future__ import annotations

import sys
import time

__all__ = ["Progress"]


class Progress:
    def __init__(self, total: int, label: str = "", *, stream=None, every: float = 0.25, enabled: bool = True):
        self.total, self.label, self.enabled = max(total, 1), label, enabled
        self.stream = stream or sys.stderr
        # a log file gets a line every 10 s instead of a redrawn bar
        self.every = every if getattr(self.stream, "isatty", lambda: False)() else max(every, 10.0)
        self.start = self.last = time.perf_counter()
        self.done = 0
        self.shown = -1  # the count last drawn

    def update(self, done: int, note: str = "") -> None:
        self.done = done
        now = time.perf_counter()
        if not self.enabled or (now - self.last < self.every and done < self.total):
            return
        self.last, self.shown = now, done
        frac = min(done / self.total, 1.0)
        elapsed = now - self.start
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        bar = "#" * int(24 * frac) + "-" * (24 - int(24 * frac))
        line = f"\r{self.label} [{bar}] {done}/{self.total} {elapsed:5.0f}s eta {eta:4.0f}s {note}"
        interactive = getattr(self.stream, "isatty", lambda: False)()
        self.stream.write(line if interactive else line[1:] + "\n")
        self.stream.flush()

    def close(self, note: str = "") -> None:
        if self.shown != self.done:
            self.last = 0.0
            self.update(self.done, note)
        if self.enabled and getattr(self.stream, "isatty", lambda: False)():
            self.stream.write("\n")
