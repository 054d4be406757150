"""sum_partials_before_reducing (spmd_compiler/optimize/partial_sums.py): Partial terms
added together are summed first and reduced once. A composite RMSNorm under Megatron TP
(torchtitan's Llama) receives two Partial gradients next to the residual's: 2 backward
all_reduces of an activation per norm become 1 (the Megatron minimum), float64 equal to
one device; hand-built programs on 2 simulated ranks give the same values, chains fold,
and another group, a broadcast, a dtype change, a second reader or a written input stay."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import Replicate

import spmd_compiler as sc
from spmd_compiler.optimize.graph_utils import WAIT, new_node
from spmd_compiler.optimize.partial_sums import sum_partials_before_reducing_pass
from spmd_compiler.testing import assert_distributed, assert_training_matches, fake_mesh
from spmd_compiler.testing.simulate import run_lockstep

sys.path.insert(0, str(Path(__file__).parent / "zoo"))
from titan_llama import Transformer, batches, tp_params, train_step  # noqa: E402

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
OFF = ("sum_partials_before_reducing",)


def _all_reduces(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target is c10d.all_reduce.default]


class _Builder:
    def __init__(self) -> None:
        self.g = fx.Graph()
        self.mode = FakeTensorMode()
        self.g.placeholder("coord0").meta["val"] = 0

    def input(self, name: str, shape: tuple[int, ...], dtype=torch.float64) -> fx.Node:
        p = self.g.placeholder(name)
        with self.mode:
            p.meta["val"] = torch.empty(shape, dtype=dtype)
        return p

    def op(self, target, *args) -> fx.Node:
        return new_node(self.g, target, args)

    def reduced(self, x: fx.Node, group: str = "g", op: str = "sum") -> fx.Node:
        nbytes = x.meta["val"].numel() * x.meta["val"].element_size()
        comm = {"kind": "all_reduce", "axis": 0, "axis_name": "tp", "group_size": 2, "dtype": x.meta["val"].dtype,
                "bytes": nbytes, "wire_bytes": nbytes, "reason": f"reduce {x.name}", "value": x.name, "origin": x.name,
                "op": "all_reduce"}
        coll = new_node(self.g, c10d.all_reduce.default, (x, op, group), None, {"spmd_comm": comm, "spmd_phase": "backward"})
        return new_node(self.g, WAIT, (coll,), None, {"spmd_wait": True, "spmd_phase": "backward"})

    def done(self, *outs: fx.Node) -> fx.GraphModule:
        self.g.output(list(outs))
        return fx.GraphModule(torch.nn.Module(), self.g)


def _run(gm: fx.GraphModule, groups=("g",)) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    vals = [n.meta["val"] for n in list(gm.graph.nodes)[1:] if n.op == "placeholder"]
    inputs = {(r,): [torch.randn(v.shape, generator=gen).to(v.dtype) for v in vals] for r in range(2)}
    out = run_lockstep({(r,): gm for r in range(2)}, inputs, (2,), group_axes={g: 0 for g in groups})
    return [out[(r,)] for r in range(2)]


def _check(build, expected: int, groups=("g",)) -> fx.GraphModule:
    """Build the program twice, rewrite one, compare the all_reduces and every rank's outputs."""
    want = _run(build(), groups)
    gm = sum_partials_before_reducing_pass(build())
    gm.graph.lint()
    gm.recompile()
    assert len(_all_reduces(gm)) == expected, gm.graph
    for got_r, want_r in zip(_run(gm, groups), want):
        for a, b in zip(got_r, want_r):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    return gm


def _norm_like(n_terms: int, **kw):
    def build():
        b = _Builder()
        r = b.input("r", (4, 3))
        acc = b.op(aten.mul.Tensor, r, 2.0)  # the residual's gradient: replicated
        for i in range(n_terms):
            x = b.input(f"x{i}", (4, 3))
            acc = b.op(aten.add.Tensor, acc, b.reduced(b.op(aten.sin.default, x), **kw))
        return b.done(b.op(aten.cos.default, acc))
    return build


def test_two_partial_terms_into_a_replicate_reduce_once():
    gm = _check(_norm_like(2), 1)
    (ar,) = _all_reduces(gm)
    assert ar.args[0].target is aten.add.Tensor  # the terms' sum is what is reduced
    assert ar.meta["spmd_comm"]["reason"].startswith("2 Partial terms summed, reduced once: ")
    assert ar.meta["spmd_comm"]["bytes"] == 4 * 3 * 8  # one activation, not two


def test_a_chain_of_terms_folds_into_one_reduction():
    gm = _check(_norm_like(4), 1)
    assert _all_reduces(gm)[0].meta["spmd_comm"]["partial_terms"] == 4


def test_two_reduced_terms_without_a_replicate():
    def build():
        b = _Builder()
        x, y = b.input("x", (5,)), b.input("y", (5,))
        return b.done(b.op(aten.add.Tensor, b.reduced(b.op(aten.sin.default, x)), b.reduced(b.op(aten.cos.default, y))))
    _check(build, 1)


def test_avg_reductions_fold_too_but_not_max():
    _check(_norm_like(2, op="avg"), 1)
    _check(_norm_like(2, op="max"), 2)


def test_what_it_leaves_alone():
    def groups():
        b = _Builder()
        r, x, y = b.input("r", (3,)), b.input("x", (3,)), b.input("y", (3,))
        acc = b.op(aten.add.Tensor, b.op(aten.add.Tensor, r, b.reduced(x, group="g")), b.reduced(y, group="h"))
        return b.done(acc)

    def second_reader():  # the partly accumulated value is read elsewhere: its reduction must exist
        b = _Builder()
        r, x, y = b.input("r", (3,)), b.input("x", (3,)), b.input("y", (3,))
        mid = b.op(aten.add.Tensor, r, b.reduced(b.op(aten.sin.default, x)))
        return b.done(b.op(aten.add.Tensor, mid, b.reduced(b.op(aten.sin.default, y))), b.op(aten.cos.default, mid))

    def broadcast():  # a (3,) term into a (2, 3) sum: the terms are not the same shape
        b = _Builder()
        r, x, y = b.input("r", (2, 3)), b.input("x", (3,)), b.input("y", (2, 3))
        mid = b.op(aten.add.Tensor, r, b.reduced(b.op(aten.sin.default, x)))
        return b.done(b.op(aten.add.Tensor, mid, b.reduced(b.op(aten.sin.default, y))))

    def dtypes():  # bfloat16 terms added into a float64 accumulator: summing them first rounds differently
        b = _Builder()
        r, x, y = b.input("r", (3,)), b.input("x", (3,), torch.bfloat16), b.input("y", (3,), torch.bfloat16)
        mid = b.op(aten.add.Tensor, r, b.reduced(b.op(aten.sin.default, x)))
        return b.done(b.op(aten.add.Tensor, mid, b.reduced(b.op(aten.sin.default, y))))

    def written():  # the first term's input is written in place after its reduction was issued
        b = _Builder()
        r, x, y = b.input("r", (3,)), b.input("x", (3,)), b.input("y", (3,))
        xs = b.op(aten.sin.default, x)
        mid = b.op(aten.add.Tensor, r, b.reduced(xs))
        b.op(aten.add_.Tensor, xs, 1.0)
        return b.done(b.op(aten.add.Tensor, mid, b.reduced(b.op(aten.sin.default, y))))

    _check(groups, 2, groups=("g", "h"))
    for build in (second_reader, broadcast, dtypes, written):
        _check(build, 2)


def _uneven(global_rows_q: int):
    """Per-rank sizes (an uneven batch split over dp, tp the reduced axis): the terms'
    local shapes agree on this rank; the global shapes decide."""
    from torch.distributed.tensor import Partial, Shard

    from spmd_compiler import _private_torch as pt
    from spmd_compiler.expand.splice import RANK_SIZES

    mesh = fake_mesh((2, 2), ("dp", "tp"))

    def spec(rows, partial):
        return pt.make_spec(mesh, [Shard(0), Partial() if partial else Replicate()], (rows, 3), (3, 1), torch.float64)

    def build():
        b = _Builder()
        r, x, y = b.input("r", (2, 3)), b.input("x", (2, 3)), b.input("y", (2, 3))
        px, py = b.op(aten.sin.default, x), b.op(aten.cos.default, y)
        px.meta["spmd_spec"], py.meta["spmd_spec"] = spec(4, True), spec(global_rows_q, True)
        wx, wy = b.reduced(px), b.reduced(py)
        for w in (wx, wy):
            w.args[0].meta[RANK_SIZES] = True
        mid = b.op(aten.add.Tensor, r, wx)
        out = b.op(aten.add.Tensor, mid, wy)
        mid.meta["spmd_spec"] = out.meta["spmd_spec"] = spec(4, False)
        return b.done(out)
    return build


def test_per_rank_sizes_decide_on_the_global_shapes():
    _check(_uneven(4), 1)  # the same global shape and split: every rank folds
    _check(_uneven(3), 2)  # another global shape (equal here only by this rank's sizes): left alone


def _titan_tp(passes_disabled=()):
    torch.manual_seed(0)
    model = Transformer(n_layers=2, rope_dtype=torch.float64).double()
    plan = sc.Plan(params=tp_params(1), default_input=[Replicate()])
    res = assert_training_matches(train_step, model, lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1), batches(2),
                                  fake_mesh((2,), ("tp",)), plan, atol=1e-10, rtol=1e-8, passes_disabled=passes_disabled)
    return res, res.sim.expansions[next(iter(res.sim.expansions))]


def test_titan_rmsnorm_under_tp_reduces_its_input_gradient_once():
    """torchtitan's Llama (composite nn.RMSNorm) under Megatron TP, 2 layers: backward
    all_reduces one activation per norm (2 per layer: Megatron's count) where autograd's
    accumulation order made two; bytes per step drop by the difference; float64 equal to one
    device at 1e-10 both ways (assert_training_matches)."""
    before, e0 = _titan_tp(OFF)
    after, e1 = _titan_tp()
    act = 4 * 16 * 32 * 8  # one [batch, seq, dim] float64 activation per rank (tests/zoo/titan_llama.py's sizes)

    def backward_bytes(e):
        return sum(n.meta["spmd_comm"]["bytes"] for n in _all_reduces(e.gm) if n.meta.get("spmd_phase") == "backward")
    norms = 2 * 2  # two norms per layer
    assert backward_bytes(e0) == 2 * norms * act and backward_bytes(e1) == norms * act, (backward_bytes(e0), backward_bytes(e1))
    d0, d1 = assert_distributed(before), assert_distributed(after)
    assert d1.count("forward/all_reduce/tp") == d0.count("forward/all_reduce/tp") == 4  # 2 per layer, unchanged
    summed = [n for n in _all_reduces(e1.gm) if "Partial terms summed" in n.meta["spmd_comm"]["reason"]]
    assert len(summed) == norms, [n.meta["spmd_comm"]["reason"] for n in _all_reduces(e1.gm)]
