"""expand/guards.py ``_guard_rounding_cast``: a cast of a ``Partial(sum)`` value to a
narrower dtype (float64 to float32 or bfloat16, a float to an integer) reduces first.

DTensor keeps ``Partial`` through ``_to_copy``, as if a cast were linear: each rank
rounded its own term and the ranks summed the rounded terms, which is not the rounded
sum one device computes (issue #32 item 2: torchtitan's MoE combine multiplies the
experts' outputs in float32, ``routed_output.to(torch.float32)``, and with the experts'
hidden dim split over tp that output is a ``Partial`` float64 value: the loss differed
from one device by 1e-11 and the expert weights by 4e-9 where everything else agreed to
1e-15). The data here are integers scaled so every float64 sum is exact: one device and
the ranks agree bit for bit, and only a term-by-term rounding can differ."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from spmd_compiler.testing import assert_spmd_matches, fake_mesh


def _exact(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 2**15, shape, generator=g, dtype=torch.int64).double()  # exact float64 products and sums


def _reasons(run):
    return [n.meta["spmd_comm"]["reason"] for s in run.steps.values() for n in s.collectives()]


def _reduced_dtypes(run):
    step = next(iter(run.steps.values()))
    return [n.args[0].meta["val"].dtype for n in step.collectives() if "all_reduce" in str(n.target)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_partial_cast_to_a_narrower_dtype_reduces_first(dtype):
    """Row-parallel matmul (contraction split: ``Partial``) then a narrowing cast: one
    all_reduce in float64 before the cast, bit-equal to one device (to an integer, DTensor
    reduces first by itself)."""
    x, w = _exact((6, 8), 0) * 1.5, _exact((8, 5), 1)  # products of ~31 bits: float32 must round them

    def f(x, w):
        return (x @ w).to(dtype) * 2

    run = assert_spmd_matches(f, [x, w], fake_mesh((2,), ("tp",)), [[Shard(1)], [Shard(0)]], atol=0, rtol=0)
    assert dtype == torch.int64 or any("cast that rounds" in r for r in _reasons(run)), _reasons(run)
    assert _reduced_dtypes(run) == [torch.float64]


def test_partial_cast_to_a_wider_dtype_stays_partial():
    """An upcast holds every term exactly: the Partial passes through the cast and is
    reduced where it is read, in the wide dtype."""
    x, w = _exact((6, 8), 0).float(), _exact((8, 5), 1).float() / 2**10

    def f(x, w):
        return (x @ w).double() * 2

    run = assert_spmd_matches(f, [x, w], fake_mesh((2,), ("tp",)), [[Shard(1)], [Shard(0)]], atol=1e-6, rtol=1e-6)
    assert not any("cast that rounds" in r for r in _reasons(run)), _reasons(run)
    assert _reduced_dtypes(run) == [torch.float64]


def test_masked_partial_cast_stays_partial():
    """An embedding with its vocabulary split (``MaskPartial``: one rank's term is the
    row, the others' zero) rounds exactly term by term: no reduce before the cast."""
    table = _exact((8, 4), 2) * 1.5

    def f(ids, table):
        return torch.nn.functional.embedding(ids, table).float()

    ids = torch.tensor([[0, 7, 3], [5, 1, 6]])
    run = assert_spmd_matches(f, [ids, table], fake_mesh((2,), ("tp",)), [[Replicate()], [Shard(0)]], atol=0, rtol=0)
    assert not any("cast that rounds" in r for r in _reasons(run)), _reasons(run)
