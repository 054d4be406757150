"""Every rank passing the global batch where the plan shards it (spmd_compiler/driver/
copied_batch.py): the error read from the exchanged digests, exactly; a real gloo run
where both dp ranks pass the whole batch raises the same ValueError on every rank before
anything changed, while the same step with real shards trains as one device."""

from __future__ import annotations

import copy

import pytest
import torch

import spmd_compiler as sc
from gloo_launch import run_processes
from spmd_compiler.driver.batch_digest import leaf_digest
from spmd_compiler.driver.copied_batch import distinct_slices, global_batch_error
from spmd_compiler.testing.models import MLP
from spmd_compiler.testing.models import mse_train_step as mse_step


def _item(t: torch.Tensor, dim: int = 0, path: str = "batch[0]") -> tuple:
    return (path, tuple(t.shape), dim, leaf_digest(t), distinct_slices(t, dim))


def test_distinct_slices_sees_bits_along_the_dim():
    x = torch.randn(4, 3)
    assert distinct_slices(x, 0) and distinct_slices(x, 1)
    assert not distinct_slices(torch.ones(4, 3), 0)  # an all-ones mask: its shards are equal by themselves
    assert not distinct_slices(torch.arange(5).expand(3, 5), 0)  # position ids broadcast over the batch
    assert distinct_slices(torch.arange(5).expand(3, 5), 1)
    assert not distinct_slices(torch.randn(1, 8), 0)  # one row: nothing to compare
    assert distinct_slices(torch.tensor([[0.0], [-0.0]]), 0)  # bit for bit


def test_equal_copies_on_a_shard_axis_name_the_path_axis_shape_and_fix():
    x = torch.randn(8, 16)
    sent = [((r,), {0: [_item(x)]}) for r in range(2)]
    e = global_batch_error(sent, _Mesh((2,), ("dp",)))
    assert isinstance(e, ValueError)
    text = str(e)
    for part in ("'dp'", "batch[0]", "(8, 16)", "Shard(0)", "fix:", "x.chunk(2, dim=0)[mesh['dp'].get_local_rank()]",
                 "DistributedSampler", "Replicate()", "check_ranks=False", "batch of 16"):
        assert part in text, (part, text)


def test_real_shards_masks_and_partial_groups_are_not_reported():
    x = torch.randn(8, 16)
    mesh = _Mesh((2,), ("dp",))
    assert global_batch_error([((r,), {0: [_item(x[4 * r: 4 * r + 4])]}) for r in range(2)], mesh) is None
    ones = torch.ones(4, 16)
    assert global_batch_error([((r,), {0: [_item(ones)]}) for r in range(2)], mesh) is None
    assert global_batch_error([((0,), {0: [_item(x)]}), None], mesh) is None  # rank 1 sent nothing
    assert global_batch_error([None, None], mesh) is None


def test_dp_x_tp_every_dp_group_is_judged_on_its_own():
    """dp x tp = 2 x 2, the batch Shard(0) on dp: dp group (tp=1) passed copies, (tp=0) real shards."""
    x = torch.randn(8, 16)
    mesh = _Mesh((2, 2), ("dp", "tp"))
    real = [((d, 0), {0: [_item(x[4 * d: 4 * d + 4])]}) for d in range(2)]
    assert global_batch_error(real, mesh) is None
    copies = real + [((d, 1), {0: [_item(x)]}) for d in range(2)]
    text = str(global_batch_error(copies, mesh))
    assert "'dp'" in text and "(0, 1), (1, 1)" in text, text
    seq = [((0, t), {1: [_item(x, 1)]}) for t in range(2)]  # a sequence dim sharded on tp (Shard(1))
    text = str(global_batch_error(seq, mesh))
    assert "'tp'" in text and "Shard(1)" in text and "x.chunk(2, dim=1)" in text, text


class _Mesh:
    def __init__(self, shape: tuple, names: tuple) -> None:
        self.shape, self.mesh_dim_names = shape, names


# ---------------------------------------------------------------- a real gloo run


def _rows(i: int):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(8, 16, dtype=torch.float64, generator=g), torch.randn(8, 16, dtype=torch.float64, generator=g)


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type and text are what the test reads
        return f"{type(e).__name__}: {e}"
    return "no error"


def _params(model) -> list[torch.Tensor]:
    return [p.full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]


def _dp(rank: int, world: int) -> dict:
    """dp = 2, the batch Shard(0) (the default plan): the first call passes the global
    batch on both ranks (refused), then real shards train as one device on the global
    batch; a later call with the global batch again (a new shape: a resync) is refused
    too; with check_ranks=False it runs (the documented way out)."""
    torch.manual_seed(0)
    model = MLP().double()
    ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    step = sc.compile(mse_step, mesh={"dp": 2})
    out = {"errors": []}
    before = _params(model)
    out["errors"].append(_error(lambda: step(model, opt, *_rows(0))))
    out["unchanged"] = all(torch.equal(a, b) for a, b in zip(before, _params(model)))
    diff = 0.0
    for i in range(3):
        x, y = _rows(i)
        loss = step(model, opt, x[4 * rank: 4 * rank + 4], y[4 * rank: 4 * rank + 4])
        diff = max(diff, abs(loss.item() - mse_step(ref, ref_opt, x, y).item()))
    diff = max(diff, *(abs(a - b).max().item() for a, b in zip(_params(model), ref.parameters())))
    out["diff"] = diff
    out["errors"].append(_error(lambda: step(model, opt, *_rows(5))))
    unchecked = sc.compile(mse_step, mesh={"dp": 2}, check_ranks=False)
    torch.manual_seed(0)
    other = MLP().double()
    out["unchecked"] = _error(lambda: unchecked(other, torch.optim.SGD(other.parameters(), lr=0.1), *_rows(0)))
    return out


@pytest.mark.gloo
def test_global_batch_on_every_dp_rank_raises_on_every_rank():
    results = run_processes(_dp, 2, timeout=240)
    for r in results:
        assert r["unchanged"], r
        assert r["diff"] < 1e-10, r  # real shards: as one device on the global batch, after the refusal
        assert len(r["errors"]) == 2, r
        for text in r["errors"]:
            assert text.startswith("ValueError: every rank of mesh axis 'dp'") and "batch[0], batch[1]" in text, text
            assert "(8, 16)" in text and "x.chunk(2, dim=0)" in text and "check_ranks=False" in text, text
        assert r["unchecked"] == "no error", r
    assert results[0]["errors"] == results[1]["errors"]
