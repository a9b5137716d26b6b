"""A one-line progress bar on stderr (redrawn at most a few times a second; no dependency)."""

from __future__ import annotations

import sys
import time

__all__ = ["Progress"]


class Progress:
    """``update(done)`` redraws ``label [####----] done/total elapsed eta``.

    The ETA comes from the rate of the steps after the first one drawn (the first step of a compiled
    model carries its compile, which would make a rate from the start absurd), and never exceeds the
    time left before ``deadline`` (a ``clock()`` value at which the work stops whatever remains).
    Until a rate is known it shows ``eta ?``."""

    def __init__(self, total: int, label: str = "", *, stream=None, every: float = 0.25, enabled: bool = True,
                 deadline: float | None = None, clock=time.perf_counter):
        self.total, self.label, self.enabled = max(total, 1), label, enabled
        self.stream = stream or sys.stderr
        self.clock, self.deadline = clock, deadline
        # a log file gets a line every 10 s instead of a redrawn bar
        self.every = every if getattr(self.stream, "isatty", lambda: False)() else max(every, 10.0)
        self.start = self.last = self.clock()
        self.done = 0
        self.shown = -1  # the count last drawn
        self.mark: tuple[int, float] | None = None  # (count, time) of the first update: rates start there

    def eta(self, done: int, now: float) -> float | None:
        """Seconds left, or None while no rate is known."""
        if done >= self.total:
            return 0.0
        if self.mark is None or done <= self.mark[0] or now <= self.mark[1]:
            return None
        left = (self.total - done) * (now - self.mark[1]) / (done - self.mark[0])
        if self.deadline is not None:
            left = min(left, max(self.deadline - now, 0.0))
        return left

    def update(self, done: int, note: str = "") -> None:
        self.done = done
        now = self.clock()
        if self.mark is None and done > 0:
            self.mark = (done, now)
        if not self.enabled or (now - self.last < self.every and done < self.total):
            return
        self.last, self.shown = now, done
        frac = min(done / self.total, 1.0)
        eta = self.eta(done, now)
        bar = "#" * int(24 * frac) + "-" * (24 - int(24 * frac))
        shown_eta = "   ?" if eta is None else f"{eta:4.0f}"
        line = f"\r{self.label} [{bar}] {done}/{self.total} {now - self.start:5.0f}s eta {shown_eta}s {note}"
        interactive = getattr(self.stream, "isatty", lambda: False)()
        self.stream.write(line if interactive else line[1:] + "\n")
        self.stream.flush()

    def close(self, note: str = "") -> None:
        if self.shown != self.done:
            self.last = float("-inf")
            self.update(self.done, note)
        if self.enabled and getattr(self.stream, "isatty", lambda: False)():
            self.stream.write("\n")
