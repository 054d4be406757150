"""Uneven shards: the sizes and offsets of ``torch.chunk``, computed in one place.

A dim of ``size`` split ``n`` ways by ``Shard`` gives shard ``i`` the elements
``[local_offset, local_offset + local_size)`` where ``chunk = ceil(size / n)``: the first
shards are full, the last ones smaller or empty (7 over 4: 2, 2, 2, 1; 2 over 4: 1, 1,
0, 0), as ``torch.chunk`` and DTensor's ``Shard`` split. ``_StridedShard(d, sf)`` splits
the dim into ``sf`` blocks that way, then each block ``n`` ways, and gives shard ``i``
its piece of every block.

Everything here is plain integer arithmetic on known sizes; the run-time offset of a
rank whose coordinate is a graph input is :meth:`SubgraphBuilder.shard_offset`, which
uses :func:`chunk_size`.
"""

from __future__ import annotations

__all__ = ["chunk_size", "local_size", "local_offset", "chunk_sizes", "strided_layout", "strided_local_size"]


def chunk_size(size: int, n: int) -> int:
    """The size of a full shard: ``ceil(size / n)`` (0 for an empty dim)."""
    if n < 1:
        raise ValueError(f"cannot split a dim {n} ways; expected n >= 1")
    return -(-size // n) if size else 0


def local_offset(size: int, n: int, i: int) -> int:
    """Where shard ``i`` of ``n`` starts in a dim of ``size`` (``size`` for empty shards)."""
    return min(i * chunk_size(size, n), size)


def local_size(size: int, n: int, i: int) -> int:
    """The size of shard ``i`` of ``n`` of a dim of ``size``: ``max(0, min(chunk, size - i * chunk))``."""
    chunk = chunk_size(size, n)
    return max(0, min(chunk, size - i * chunk))


def chunk_sizes(size: int, n: int) -> list[int]:
    """The size of every shard: ``torch.chunk``'s pieces padded with zeros to ``n`` entries."""
    return [local_size(size, n, i) for i in range(n)]


def strided_layout(size: int, split_factor: int, n: int) -> list[list[tuple[int, int]]]:
    """``_StridedShard``: ``layout[k][i] = (global start, length)`` of shard ``i``'s piece
    of block ``k``."""
    out, start = [], 0
    for block in chunk_sizes(size, split_factor):
        out.append([(start + local_offset(block, n, i), local_size(block, n, i)) for i in range(n)])
        start += block
    return out


def strided_local_size(size: int, split_factor: int, n: int, i: int) -> int:
    """Shard ``i``'s share of a dim of ``size`` under ``_StridedShard(split_factor)``."""
    return sum(local_size(block, n, i) for block in chunk_sizes(size, split_factor))
