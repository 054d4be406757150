"""Noticing a program cache that thrashes.

``compile(cache_size=8)`` keeps the programs of the 8 call signatures used last. A
workload that cycles through more signatures than that (ten batch sizes in turn: an
uneven last batch per epoch, bucketed sequence lengths) drops a program and compiles it
again on almost every call: ten sizes cycled with the default cache compiled 20 times in
20 calls, each compile seconds of work and more memory, and nothing said so.
:class:`CacheWatch` remembers the signatures dropped from the cache; the second time a
dropped one is compiled again it logs one WARNING naming the numbers and the fixes
(``dynamic=True``: one program for every batch size; a larger ``cache_size``).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

__all__ = ["CacheWatch"]

log = logging.getLogger(__name__)

# dropped signatures remembered, per cache slot (a cycle longer than this is not seen)
_MEMORY = 8


class CacheWatch:
    """Counts compiles of signatures the cache dropped before; warns once (see module doc)."""

    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.dropped: deque[Any] = deque(maxlen=_MEMORY * cache_size)
        self.recompiles = 0  # compiles of a signature the cache had dropped
        self.warned = False

    def drop(self, key: Any) -> None:
        self.dropped.append(key)

    def compiled(self, key: Any, *, compiles: int, calls: int, seconds: float) -> None:
        """A program was compiled for ``key`` (the ``compiles``-th, at call ``calls``)."""
        if key not in self.dropped:
            return
        self.dropped.remove(key)
        self.recompiles += 1
        if self.recompiles >= 2 and not self.warned:
            self.warned = True
            log.warning(
                "the compiled step's program cache thrashes: %d programs dropped from it (cache_size=%d, the least "
                "recently used goes) were compiled again; %d compiles in %d calls so far, the last took %.2fs. The "
                "calls cycle through more signatures (batch sizes or shapes, optimizer state, modes) than the cache "
                "holds. fix: compile(..., dynamic=True) for batch sizes that vary (one program for every size), or a "
                "larger compile(..., cache_size=N) for more than %d signatures in turn",
                self.recompiles, self.cache_size, compiles, calls, seconds, self.cache_size,
            )
