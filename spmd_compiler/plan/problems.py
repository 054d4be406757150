"""Every bad entry of a plan, in one error.

Resolving a plan checks each entry on its own (a name that matches nothing, placements
that are not placements or not one per mesh axis, a ``Shard`` dim the tensor lacks, a
mesh axis that does not exist). A plan written with several mistakes would otherwise
report them one compile at a time. :class:`Problems` collects them: each check runs in
``with problems.entry(key):``, which records a ``ValueError``/``TypeError`` and lets the
resolution go on with a fallback, and :meth:`Problems.raise_all` raises one error at the
end. The first problem's message stays the error's first line, unchanged, and its type
the error's type (a plan with one bad entry raises exactly what it raised before); the
others follow, one per line, each with its own expected / got / fix.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Problems"]

log = logging.getLogger(__name__)


class Problems:
    """The bad entries of one plan resolution, in the order they were found."""

    def __init__(self) -> None:
        self.errors: list[Exception] = []
        self._keys: set[str] = set()

    @contextmanager
    def entry(self, key: str | None = None) -> Iterator[None]:
        """Record a ValueError/TypeError raised in the block (the rest of the block is
        skipped: set its fallback before). ``key``: one problem per key (a pattern that
        fails on every tensor it matches is one bad entry); default, the message."""
        try:
            yield
        except (ValueError, TypeError) as e:
            self.add(e, key)

    def add(self, error: Exception, key: str | None = None) -> None:
        key = str(error) if key is None else key
        if key not in self._keys:
            self._keys.add(key)
            self.errors.append(error)

    def raise_all(self) -> None:
        """Raise the problems found (nothing when there are none): one as it came, several
        as one error of the first one's type listing them all."""
        if not self.errors:
            return
        first = self.errors[0]
        if len(self.errors) == 1:
            raise first
        rest = "\n".join(f"  - {e}" for e in self.errors[1:])
        text = (f"{first}\nthe plan has {len(self.errors) - 1} more bad "
                f"entr{'y' if len(self.errors) == 2 else 'ies'} (all {len(self.errors)} listed; fix each):\n{rest}")
        log.debug("plan resolution found %d bad entries", len(self.errors))
        try:
            error = type(first)(text)
        except Exception:  # an error type with another constructor: a plain one of its family
            error = (TypeError if isinstance(first, TypeError) else ValueError)(text)
        raise error from first
