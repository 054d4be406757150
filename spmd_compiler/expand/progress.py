"""A progress indicator for long expansions, visible only at INFO level.

On a terminal (stderr is a tty) it redraws one line (``expanding 4200/15000 nodes
(28%)``); elsewhere it logs a line every 25%. Expansions that finish within two seconds
show nothing; below INFO level it is silent.
"""

from __future__ import annotations

import logging
import sys
import time

__all__ = ["Progress"]


class Progress:
    def __init__(self, what: str, total: int, logger: logging.Logger, *, delay: float = 2.0) -> None:
        self.what, self.total, self.log = what, max(1, total), logger
        self.start = time.monotonic()
        self.delay = delay
        self.enabled = logger.isEnabledFor(logging.INFO)
        self.tty = self.enabled and sys.stderr.isatty()
        self.next_log = 0.25
        self.shown = False
        self.last_draw = 0.0

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.start < self.delay:
            return
        frac = done / self.total
        if self.tty:
            if now - self.last_draw > 0.1:
                sys.stderr.write(f"\r{self.what} {done}/{self.total} nodes ({frac:.0%}), {now - self.start:.0f}s")
                sys.stderr.flush()
                self.last_draw, self.shown = now, True
        elif frac >= self.next_log:
            self.log.info("%s: %d/%d nodes (%.0f%%) after %.1fs", self.what, done, self.total, 100 * frac, now - self.start)
            while self.next_log <= frac:
                self.next_log += 0.25

    def done(self) -> None:
        if self.shown:
            sys.stderr.write("\r" + " " * 60 + "\r")
            sys.stderr.flush()
