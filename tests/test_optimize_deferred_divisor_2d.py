"""defer_mean_divisor (spmd_compiler/optimize/deferred_divisor.py) under dp x tp: the
scaled values of the backward cross the tensor-parallel activation all_reduces (LINEAR's
functional collective rules), so the [loss sum, count] pair rides in the first dp gradient
bucket: per process group, launches = buckets on dp, tp's activation all_reduces alone.
float64 GPT in the lockstep simulator, 2 x 2 mesh, equal to one device at 1e-12 with
ignored targets and counts differing per dp rank; the per-step check still rides on the
first collective of each axis group (driver/fold.py, FoldChain), now dp's first bucket."""

from __future__ import annotations

import logging

import torch

from spmd_compiler.driver.fold import FoldChain, find_fold
from spmd_compiler.optimize.deferred_divisor import LINEAR
from spmd_compiler.optimize.graph_utils import is_collective
from spmd_compiler.testing import assert_training_matches, fake_mesh
from spmd_compiler.testing.models import GPT, gpt_2d_plan
from test_optimize_deferred_divisor import PASS, _batch, _passes, ce_step

c10d = torch.ops._c10d_functional
LAYERS = 1


def _run(steps: int = 3):
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=LAYERS).double()
    batches = [_batch(i, 4) for i in range(steps)]  # 2 rows per dp rank; dp rank 0 ignores more targets
    res = assert_training_matches(ce_step, model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), batches,
                                  fake_mesh((2, 2), ("dp", "tp")), gpt_2d_plan(), passes=_passes(), atol=1e-12, rtol=0)
    gm = res.sim.expansions[(0, 0)].gm
    return res, gm


def _by_axis(gm) -> dict[str, list]:
    out: dict[str, list] = {}
    for n in gm.graph.nodes:
        if is_collective(n):
            out.setdefault(n.meta["spmd_comm"]["axis_name"], []).append(n)
    return out


def _ops(colls) -> list:
    return [n.meta["spmd_comm"].get("op") for n in colls]


def test_2d_gpt_launches_equal_buckets_and_matches_one_device():
    res, gm = _run()
    assert res.max_param_error <= 1e-12, res.max_param_error
    by_axis = _by_axis(gm)
    dp, tp = by_axis["dp"], by_axis["tp"]
    assert _ops(dp) == ["bucket", "bucket"], _ops(dp)  # dp: 2 launches = 2 buckets, no standalone pair
    riders = [m for m in dp[0].meta["spmd_comm"]["bucket"] if m.get("rider")]
    assert len(riders) == 1 and "pair" in str(riders[0]), riders
    # tp: the activation all_reduces only (2 per layer forward, 2 backward), each its own launch
    assert len(tp) == 4 * LAYERS and all(n.target is c10d.all_reduce.default and n.meta["spmd_comm"].get("op") != "bucket" for n in tp)
    assert {n.meta["spmd_phase"] for n in tp} == {"forward", "backward"}
    divisions = [n for n in gm.graph.nodes if (n.meta.get("spmd_origin") or {}).get("op") == PASS and n.target is torch.ops.aten.div.Tensor]
    assert len(divisions) == sum(len(c.meta["spmd_comm"]["bucket"]) for c in dp) - 1  # every gradient, not the pair
    # the step check rides on tp's first all_reduce, then dp's first bucket (the pair's)
    axes = ((dp[0].args[-1], 2), (tp[0].args[-1], 2))
    chain = find_fold(gm, world_size=4, axes=axes)
    assert isinstance(chain, FoldChain), chain
    assert [p.collective for p in chain.points] == [tp[0].name, dp[0].name], chain


def test_2d_without_collective_rules_the_pair_stays_apart(caplog, monkeypatch):
    """The same step with the functional collectives taken out of LINEAR: the backward's tp
    all_reduce of a scaled value makes the pass refuse, and dp launches 3 for 2 buckets
    (what the rules fix); the numerics match one device either way."""
    for op in (c10d.all_reduce.default, c10d.wait_tensor.default):
        monkeypatch.delitem(LINEAR, op)
    with caplog.at_level(logging.DEBUG, logger="spmd_compiler.optimize.deferred_divisor"):
        res, gm = _run(steps=2)
    by_axis = _by_axis(gm)
    assert _ops(by_axis["dp"]) == ["mean_pair", "bucket", "bucket"], _ops(by_axis["dp"])
    assert len(by_axis["tp"]) == 4 * LAYERS
    reasons = [r.getMessage() for r in caplog.records if "left as it is" in r.getMessage()]
    assert reasons and all("all_reduce" in m and "not known to be linear" in m for m in reasons), reasons


def test_collective_rules_take_a_sum_or_a_gather_of_the_scaled_value():
    """The collective rules accept a sum of the scaled value, not a max or a mix."""
    import torch.fx as fx

    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    nodes = {
        "sum": g.call_function(c10d.all_reduce.default, (x, "sum", "0")),
        "max": g.call_function(c10d.all_reduce.default, (x, "max", "0")),
        "rs_sum": g.call_function(c10d.reduce_scatter_tensor.default, (x, "sum", 2, "0")),
        "rs_max": g.call_function(c10d.reduce_scatter_tensor.default, (x, "max", 2, "0")),
        "gather": g.call_function(c10d.all_gather_into_tensor.default, (x, 2, "0")),
        "gather_y": g.call_function(c10d.all_gather_into_tensor.default, (y, 2, "0")),
        "wait": g.call_function(c10d.wait_tensor.default, (x,)),
    }
    scaled = lambda a: a is x  # noqa: E731
    got = {k: LINEAR[n.target](n, scaled) for k, n in nodes.items()}
    assert got == {"sum": True, "max": False, "rs_sum": True, "rs_max": False, "gather": True, "gather_y": False, "wait": True}, got
