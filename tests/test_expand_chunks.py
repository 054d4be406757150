"""Uneven chunk sizes and offsets in one place (spmd_compiler/expand/chunks.py)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from spmd_compiler import _private_torch as pt
from spmd_compiler.expand.chunks import chunk_size, chunk_sizes, local_offset, local_size, strided_layout, strided_local_size


@pytest.mark.parametrize("size", [0, 1, 2, 5, 7, 8, 13])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_shards_are_torch_chunks(size, n):
    pieces = [len(c) for c in torch.arange(size).chunk(n)] if size else []
    assert chunk_sizes(size, n) == pieces + [0] * (n - len(pieces))
    assert chunk_size(size, n) == max(chunk_sizes(size, n), default=0)
    for i in range(n):
        assert local_size(size, n, i) == max(0, min(chunk_size(size, n), size - i * chunk_size(size, n)))
        # shards tile the dim in order
        assert local_offset(size, n, i) == sum(chunk_sizes(size, n)[:i])
        # what DTensor's Shard gives this coordinate
        shape, offset = pt.local_shape_and_offset((size,), (n,), (i,), (Shard(0),))
        assert local_size(size, n, i) == shape[0]
        if shape[0]:  # where an empty shard "starts" is a convention
            assert local_offset(size, n, i) == offset[0]


def test_examples_from_the_docstring():
    assert chunk_sizes(7, 4) == [2, 2, 2, 1]
    assert chunk_sizes(2, 4) == [1, 1, 0, 0]
    assert [local_offset(2, 4, i) for i in range(4)] == [0, 1, 2, 2]
    with pytest.raises(ValueError, match="expected n >= 1"):
        chunk_size(4, 0)


@pytest.mark.parametrize("size,sf,n", [(12, 2, 3), (10, 2, 2), (7, 3, 2), (5, 2, 4)])
def test_strided_layout_covers_every_block(size, sf, n):
    layout = strided_layout(size, sf, n)
    assert len(layout) == sf and all(len(row) == n for row in layout)
    covered = sorted(i for row in layout for start, length in row for i in range(start, start + length))
    assert covered == list(range(size))  # every element exactly once
    for i in range(n):
        assert strided_local_size(size, sf, n, i) == sum(row[i][1] for row in layout)
        shape, _ = pt.local_shape_and_offset((size,), (n,), (i,), (pt.StridedShard(0, split_factor=sf),))
        assert strided_local_size(size, sf, n, i) == shape[0]
