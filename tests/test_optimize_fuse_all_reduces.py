"""fuse_all_reduces (spmd_compiler/optimize/fuse_all_reduces.py): independent standalone
all_reduces of one group in one launch. clip_grad_norm_ under Megatron TP reduces each
sharded gradient's norm on its own: 7 launches for a 1-layer torchtitan Llama become 1,
float64 equal to one device; dependent all_reduces, a result read before another's input
exists, an input written in place and different groups stay apart; a DP MLP is unchanged."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import Replicate

import spmd_compiler as sc
from spmd_compiler.driver.fold import find_fold
from spmd_compiler.optimize.fuse_all_reduces import fuse_all_reduces_pass
from spmd_compiler.optimize.graph_utils import WAIT, new_node
from spmd_compiler.testing import assert_distributed, assert_training_matches, fake_mesh
from spmd_compiler.testing.models import MLP, mse_train_step
from spmd_compiler.testing.simulate import run_lockstep

sys.path.insert(0, str(Path(__file__).parent / "zoo"))
from titan_llama import Transformer, batches, tp_params, train_step  # noqa: E402

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
OFF = ("fuse_all_reduces",)


def _all_reduces(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target is c10d.all_reduce.default]


# ---- hand-built per-rank programs, run on 2 simulated ranks ------------------------------


class _Builder:
    def __init__(self) -> None:
        self.g = fx.Graph()
        self.mode = FakeTensorMode()
        self.g.placeholder("coord0").meta["val"] = 0

    def input(self, name: str, shape: tuple[int, ...]) -> fx.Node:
        p = self.g.placeholder(name)
        with self.mode:
            p.meta["val"] = torch.empty(shape, dtype=torch.float64)
        return p

    def op(self, target, *args) -> fx.Node:
        return new_node(self.g, target, args)

    def all_reduce(self, x: fx.Node, group: str = "g", op: str = "sum") -> tuple[fx.Node, fx.Node]:
        nbytes = x.meta["val"].numel() * 8
        comm = {"kind": "all_reduce", "axis": 0, "axis_name": "dp", "group_size": 2, "dtype": torch.float64, "bytes": nbytes,
                "wire_bytes": nbytes, "reason": f"reduce {x.name}", "value": x.name, "origin": x.name, "op": "all_reduce"}
        coll = new_node(self.g, c10d.all_reduce.default, (x, op, group), None, {"spmd_comm": comm, "spmd_phase": "optimizer"})
        return coll, new_node(self.g, WAIT, (coll,), None, {"spmd_wait": True, "spmd_phase": "optimizer"})

    def done(self, *outs: fx.Node) -> fx.GraphModule:
        self.g.output(list(outs))
        return fx.GraphModule(torch.nn.Module(), self.g)


def _run(gm: fx.GraphModule, groups=("g",)) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    shapes = [n.meta["val"].shape for n in list(gm.graph.nodes)[1:] if n.op == "placeholder"]
    inputs = {(r,): [torch.randn(s, dtype=torch.float64, generator=gen) for s in shapes] for r in range(2)}
    out = run_lockstep({(r,): gm for r in range(2)}, inputs, (2,), group_axes={g: 0 for g in groups})
    return [out[(r,)] for r in range(2)]


def _check_fusion(build, expected: int, groups=("g",)) -> fx.GraphModule:
    """Build the program twice, fuse one, compare the launches and every rank's outputs."""
    want = _run(build(), groups)
    gm = fuse_all_reduces_pass(build())
    gm.graph.lint()
    gm.recompile()
    assert len(_all_reduces(gm)) == expected, gm.graph
    for got_r, want_r in zip(_run(gm, groups), want):
        for a, b in zip(got_r, want_r):
            assert torch.equal(a, b)
    return gm


def _independent():
    b = _Builder()
    x, y, z = b.input("x", (3,)), b.input("y", (2, 2)), b.input("z", (4,))
    _, wx = b.all_reduce(b.op(aten.mul.Tensor, x, 2.0))
    _, wy = b.all_reduce(b.op(aten.add.Tensor, y, 1.0))
    _, wz = b.all_reduce(b.op(aten.sin.default, z), op="max")  # another reduce op: a group of its own
    return b.done(b.op(aten.sum.default, wx), b.op(aten.mul.Tensor, wy, 3.0), wz)


def test_independent_all_reduces_fuse_and_keep_values():
    gm = _check_fusion(_independent, 2)
    fused, other = _all_reduces(gm)
    assert fused.meta["spmd_comm"]["op"] == "fused_all_reduce" and fused.args[1:] == ("sum", "g")
    assert fused.args[0].meta["val"].shape == (7,)  # 3 + 2*2 elements
    assert "2 independent all_reduces" in fused.meta["spmd_comm"]["reason"] and len(fused.meta["spmd_comm"]["bucket"]) == 2
    assert fused.meta["spmd_phase"] == "optimizer" and other.args[1] == "max"
    point = find_fold(gm, world_size=2)  # the first collective still carries the per-step check
    assert point is not None and point.collective == fused.name and point.shape == (7,)


def test_dependent_all_reduces_stay_apart():
    """The second reduces a value computed from the first's result."""
    def build():
        b = _Builder()
        x, y = b.input("x", (3,)), b.input("y", (3,))
        _, wx = b.all_reduce(b.op(aten.mul.Tensor, x, 2.0))
        _, wy = b.all_reduce(b.op(aten.mul.Tensor, wx, y))
        return b.done(wy)
    _check_fusion(build, 2)


def test_result_read_before_the_other_input_exists_stays_apart():
    """Fusing would delay the first reader (cos of the first result) past the second's
    input, which does not depend on it."""
    def build():
        b = _Builder()
        x, y = b.input("x", (3,)), b.input("y", (3,))
        _, wx = b.all_reduce(b.op(aten.mul.Tensor, x, 2.0))
        early = b.op(aten.cos.default, wx)
        _, wy = b.all_reduce(b.op(aten.sin.default, y))
        return b.done(early, wy)
    _check_fusion(build, 2)


def test_input_written_in_place_or_other_group_stays_apart():
    def written():
        b = _Builder()
        x, y = b.input("x", (3,)), b.input("y", (3,))
        xs = b.op(aten.mul.Tensor, x, 2.0)
        _, wx = b.all_reduce(xs)
        ys = b.op(aten.sin.default, y)
        b.op(aten.add_.Tensor, xs, 1.0)  # after the issue: a later issue would read it
        _, wy = b.all_reduce(ys)
        return b.done(b.op(aten.add.Tensor, wx, wy))

    def groups():
        b = _Builder()
        x, y = b.input("x", (3,)), b.input("y", (3,))
        _, wx = b.all_reduce(b.op(aten.mul.Tensor, x, 2.0), group="g")
        _, wy = b.all_reduce(b.op(aten.sin.default, y), group="h")
        return b.done(b.op(aten.add.Tensor, wx, wy))
    _check_fusion(written, 2)
    _check_fusion(groups, 2, groups=("g", "h"))


# ---- compiled train steps -----------------------------------------------------------------


def _titan_tp(passes_disabled=()):
    torch.manual_seed(0)
    model = Transformer(n_layers=1, rope_dtype=torch.float64).double()
    plan = sc.Plan(params=tp_params(1), default_input=[Replicate()])
    res = assert_training_matches(train_step, model, lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1), batches(2),
                                  fake_mesh((2,), ("tp",)), plan, atol=1e-10, rtol=1e-8, passes_disabled=passes_disabled)
    return res, res.sim.expansions[next(iter(res.sim.expansions))]


def test_titan_under_tp_sends_independent_backward_reductions_together():
    """The titan Llama under Megatron TP, with sum_partials_before_reducing off (it sums
    these terms before one reduction, tests/test_optimize_partial_sums.py): in backward,
    each RMSNorm's input gets two independent Partial(sum) reductions, sent in one launch (4 -> 2).
    The optimizer's clip_grad_norm_ norms are already one all_reduce (expand/rules/norms.py
    stacks them as Partial(norm)), next to the RMSNorm gradients' bucket: 2 either way.
    Float64 equal to one device at 1e-10 either way."""
    before, e0 = _titan_tp(OFF + ("sum_partials_before_reducing",))
    after, e1 = _titan_tp(("sum_partials_before_reducing",))
    d0, d1 = assert_distributed(before), assert_distributed(after)
    counts = [tuple(d.count(f"{phase}/all_reduce/tp") for phase in ("forward", "backward", "optimizer")) for d in (d0, d1)]
    # forward: the attention's and the feed-forward's all_reduce, one reading the other (2)
    assert counts == [(2, 4, 2), (2, 2, 2)], (d0.describe(), d1.describe())
    backward = [n for n in _all_reduces(e1.gm) if n.meta.get("spmd_phase") == "backward"]
    assert [n.meta["spmd_comm"]["op"] for n in backward] == ["fused_all_reduce"] * 2
    for fused in backward:
        members = fused.meta["spmd_comm"]["bucket"]
        assert len(members) == 2 and all(m["transition"].startswith("P(sum)->R") for m in members), members
        assert "2 independent all_reduces in one launch" in fused.meta["spmd_comm"]["reason"]
    assert not any(n.meta["spmd_comm"]["op"] == "fused_all_reduce" for n in _all_reduces(e0.gm))


def test_dp_mlp_launches_unchanged():
    """DP: the gradients are one bucket and the loss rides in it; nothing is left to fuse."""
    counts = []
    for off in (OFF, ()):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        data = [(torch.randn(8, 16, dtype=torch.float64, generator=g), torch.randn(8, 16, dtype=torch.float64, generator=g))
                for _ in range(2)]
        res = assert_training_matches(mse_train_step, MLP().double(), lambda p: torch.optim.SGD(p, lr=0.1), data,
                                      fake_mesh((4,), ("dp",)), atol=1e-12, passes_disabled=off)
        gm = res.sim.expansions[next(iter(res.sim.expansions))].gm
        assert not any(n.meta["spmd_comm"].get("op") == "fused_all_reduce" for n in _all_reduces(gm))
        counts.append(assert_distributed(res).collectives)
    assert counts[0] == counts[1], counts


# ---- real gloo: a fused collective as the program's first, carrying the step check ----------


def two_sums(model, optimizer, x):
    """Two batch reductions returned (Partial -> Replicate at the output), independent."""
    h = model(x)
    return h.sum(), x.t() @ h


def _gloo_two_sums(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = MLP().double()
    ref = copy.deepcopy(model)
    step = sc.compile(two_sums, mesh=(world,))
    errs = []
    for i in range(3):
        x = torch.randn(8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
        got = step(model, None, x.chunk(world)[rank])
        want = two_sums(ref, None, x)
        errs.append(max((g.full_tensor() if hasattr(g, "full_tensor") else g).sub(w).abs().max().item() for g, w in zip(got, want)))
    fused = [n.name for n in _all_reduces(step.last.gm) if n.meta["spmd_comm"]["op"] == "fused_all_reduce"]
    point = find_fold(step.last.gm, world_size=world)
    return {"err": max(errs), "launches": len(_all_reduces(step.last.gm)), "fused": fused,
            "fold": point.collective if point is not None else None, "checks": dict(step.checks)}


@pytest.mark.gloo
def test_gloo_fused_first_collective_carries_the_step_check():
    from gloo_launch import run_processes

    for res in run_processes(_gloo_two_sums, 2):
        assert res["err"] < 1e-12 and res["launches"] == 1 and len(res["fused"]) == 1, res
        assert res["fold"] == res["fused"][0] and res["checks"].get("folded", 0) >= 2, res
