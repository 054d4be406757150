"""expand/rules/partial_inputs.py: fill_ with a 0-dim tensor value (``t[..., 0] = k``,
T5's ``_shift_right``) fills each rank's shard in place, no gather of the filled tensor."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from spmd_compiler.testing import assert_distributed, assert_spmd_matches

FILL = torch.ops.aten.fill_.Tensor


def shift_right(ids):
    shifted = ids.roll(1, -1)
    shifted[..., 0] = 7  # traces to fill_.Tensor with a lifted 0-dim constant
    return shifted * 2


def fill_with_sum(x):
    y = x.clone()
    y[:, 0] = x.sum()  # the value is a Partial(sum) scalar on the sharded rows: all_reduced
    return y


@pytest.mark.parametrize(("rows", "symbolic"), [(4, "none"), (5, "none"), (5, "batch")])  # even, uneven, batch size an input
def test_fill_tensor_of_a_batch_sharded_slice_stays_local(mesh4, rows, symbolic):
    ids = torch.randint(0, 30, (rows, 6))
    run = assert_spmd_matches(shift_right, [ids], mesh4, [[Shard(0)]], symbolic=symbolic)
    step = next(iter(run.steps.values()))
    assert FILL in {n.target for n in step.gm.graph.nodes}
    assert_distributed(run, sharded=["batch[0]"], collectives={"all_gather": 0, "all_reduce": 0})  # was: the batch gathered by the fallback


def test_fill_tensor_with_a_partial_value_reduces_only_the_value(mesh4):
    x = torch.randn(6, 3, dtype=torch.float64)
    run = assert_spmd_matches(fill_with_sum, [x], mesh4, [[Shard(0)]], symbolic="none")
    assert_distributed(run, sharded=["batch[0]"], collectives={"all_reduce/dp": 1, "all_gather": 0})
