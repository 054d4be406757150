"""Bytes alive at each node of a program, kept up to date while blocks of nodes move.

:func:`spmd_compiler.dump.memory_trace` walks the whole program; a pass that tries a
placement per candidate (``budget_prefetch``) cannot afford one walk per try at the scale
of a 70B step (80 layers, 50,000 nodes). :class:`LiveBytes` makes that walk once
(:func:`spmd_compiler.dump.memory.storages`: each storage's allocating node, bytes and
readers, which moving nodes does not change) and then answers "what is the peak if this
block of nodes moves before that node" by recounting only the nodes between the two
places, and applies the move the same way. The numbers are the memory trace's, exactly:
``live[i]`` is ``memory_trace(gm).live[i]`` for the program in its current order.

Moving a block ``B`` earlier, before node ``at``, changes what is alive only between
``at`` and ``B``'s old place: a storage ``B`` allocates is allocated earlier, one ``B``
reads may be read for the last time earlier (never before ``at``); everything else keeps
its allocation and its last reader.
"""

from __future__ import annotations

import torch.fx as fx

from ..dump.memory import storages

__all__ = ["LiveBytes"]


class LiveBytes:
    """The static memory trace of ``gm`` in its current order, for moves of node blocks.

    Attributes: ``order`` (the nodes in program order), ``index`` (node -> position in
    ``order``), ``live`` (bytes alive at each position), ``peak`` (their maximum).
    Nodes must move only through :meth:`move` (the graph itself is moved by the caller).
    """

    def __init__(self, gm: fx.GraphModule, *, backend: str | None = None) -> None:
        found, _ = storages(gm, backend=backend)
        self.order: list[fx.Node] = list(gm.graph.nodes)
        self.index: dict[fx.Node, int] = {n: i for i, n in enumerate(self.order)}
        self._storages = found
        self._alloc: dict[fx.Node, int] = {}  # bytes allocated at a node
        self._frees: dict[fx.Node, int] = {}  # bytes whose last reader a node is (freed after it)
        self._last: list[fx.Node] = []  # per storage: its last reader (or its allocation)
        self._touches: dict[fx.Node, list[int]] = {}  # node -> storages it allocates or reads
        index = self.index
        for sid, s in enumerate(found):
            self._alloc[s.alloc] = self._alloc.get(s.alloc, 0) + s.bytes
            last = max(s.readers, key=index.__getitem__, default=s.alloc)
            if index[last] < index[s.alloc]:
                last = s.alloc
            self._last.append(last)
            self._frees[last] = self._frees.get(last, 0) + s.bytes
            self._touches.setdefault(s.alloc, []).append(sid)
            for r in s.readers:
                self._touches.setdefault(r, []).append(sid)
        self.live: list[int] = []
        running = 0
        for n in self.order:
            running += self._alloc.get(n, 0)
            self.live.append(running)
            running -= self._frees.get(n, 0)
        self.peak = max(self.live, default=0)

    def _moved(self, block: list[fx.Node], at: int) -> tuple[list[fx.Node], list[int], dict[int, fx.Node], dict[fx.Node, int]]:
        """``block`` (contiguous, in order) moved before ``order[at]``: the new order of the
        positions ``at`` to the block's old end, their live bytes, the storages whose last
        reader changes and the change of bytes freed per node."""
        hi = self.index[block[0]]
        end = hi + len(block)
        if not (0 < at <= hi) or self.order[hi:end] != block:
            raise ValueError(f"LiveBytes: expected a contiguous block at {hi} moving earlier, got {[b.name for b in block]} to {at}")
        seg = block + self.order[at:hi]
        new_pos = {n: at + j for j, n in enumerate(seg)}

        def pos(n: fx.Node) -> int:
            p = new_pos.get(n)
            return self.index[n] if p is None else p

        new_last: dict[int, fx.Node] = {}
        frees: dict[fx.Node, int] = {}
        for sid in dict.fromkeys(sid for b in block for sid in self._touches.get(b, ())):
            s = self._storages[sid]
            last = max(s.readers, key=pos, default=s.alloc)
            if pos(last) < pos(s.alloc):
                last = s.alloc
            old = self._last[sid]
            if last is not old:
                new_last[sid] = last
                frees[old] = frees.get(old, 0) - s.bytes
                frees[last] = frees.get(last, 0) + s.bytes
        before = self.order[at - 1]
        running = self.live[at - 1] - self._frees.get(before, 0)
        live = []
        for n in seg:
            running += self._alloc.get(n, 0)
            live.append(running)
            running -= self._frees.get(n, 0) + frees.get(n, 0)
        if end < len(self.order):  # the rest is unchanged: the running count meets it
            assert running + self._alloc.get(self.order[end], 0) == self.live[end], "LiveBytes: inconsistent count"
        return seg, live, new_last, frees

    def peak_if_moved(self, block: list[fx.Node], at: int) -> int:
        """The most bytes alive at any node from ``at`` to the block's old end if ``block``
        moved before ``order[at]`` (the other nodes' counts do not change)."""
        return max(self._moved(block, at)[1])

    def move(self, block: list[fx.Node], at: int) -> None:
        """Record that ``block`` moves before ``order[at]``."""
        seg, live, new_last, frees = self._moved(block, at)
        end = at + len(seg)
        self.order[at:end] = seg
        self.live[at:end] = live
        for j, n in enumerate(seg):
            self.index[n] = at + j
        for sid, last in new_last.items():
            self._last[sid] = last
        for n, d in frees.items():
            self._frees[n] = self._frees.get(n, 0) + d
        self.peak = max(self.live)
