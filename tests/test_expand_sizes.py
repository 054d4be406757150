"""DSymInt: sizes read from a sharded batch give local sizes in the expanded graph."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler.testing import SimulatedTraining, assert_distributed, assert_training_matches, fake_mesh

aten = torch.ops.aten


class SizeModel(nn.Module):
    """Uses x.size(0) in a view, an arange, a full, an expand, and slices (slice_backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 4))
        self.scale = nn.Parameter(torch.randn(1, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.view(x.size(0), -1) @ self.w
        pos = torch.arange(x.size(0)).to(h.dtype).unsqueeze(1)
        bias = torch.full((x.size(0), 4), 0.5, dtype=h.dtype)
        e = self.scale.expand(x.size(0), 4)
        h = h + pos * 0.01 + bias + e
        return h[:, 1:3]


def size_step(model, optimizer, x):
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _nodes(gm, target):
    return [n for n in gm.graph.nodes if n.target is target]


def test_local_sizes_in_expanded_graph(mesh4):
    model = SizeModel().double()
    batches = [(torch.randn(8, 2, 3, dtype=torch.float64),) for _ in range(2)]
    res = assert_training_matches(size_step, model, lambda p: torch.optim.SGD(p, lr=0.1), batches, mesh4)
    assert_distributed(res, sharded=["batch[0]"], collectives={"optimizer/all_reduce/dp": 1})  # both gradients, in one bucket
    gm = res.sim.expansions[(0,)].gm
    # view(x.size(0), -1): local batch of 8 / 4 = 2
    assert [list(n.args[1]) for n in _nodes(gm, aten.view.default) if n.args[0].name == "in_batch_0"] == [[2, 6]]
    # torch.full((x.size(0), 4)) and expand(x.size(0), 4) built locally
    assert [list(n.args[0]) for n in _nodes(gm, aten.full.default)] == [[2, 4]]
    assert [2, 4] in [list(n.args[1]) for n in _nodes(gm, aten.expand.default)]
    # arange(x.size(0)): this rank's 2 positions, offset by the run-time coordinate
    (arange,) = _nodes(gm, aten.arange.start_step)
    start, stop = arange.args[0], arange.args[1]
    assert start.op == "call_function" and "coord_dp" in {a.name for a in start.all_input_nodes}
    assert stop.args[1] == 2  # stop = start + local length
    # slice_backward of the slices gets local input sizes and no gather
    assert all(list(n.args[1])[0] == 2 for n in _nodes(gm, aten.slice_backward.default))
    assert not [n for n in res.sim.expansions[(0,)].collectives() if n.meta["spmd_comm"]["kind"] == "all_gather"]


def test_dsymint_validates_itself():
    import pytest

    with pytest.raises(ValueError, match="local value 2 differs from global value 8"):
        sc.DSymInt(8, 2)
    s = sc.DSymInt(8, 2, axes=(0,))
    from spmd_compiler.expand.values import sym_apply
    import operator

    assert sym_apply(operator.mul, s, 3) == sc.DSymInt(24, 6, axes=(0,))
    assert sym_apply(operator.add, s, 1) == sc.DSymInt(9, 9)


def test_arange_of_an_uneven_batch(mesh4):
    # 10 rows over 4 ranks (3, 3, 3, 1): each rank's positions start at coord * 3
    model = SizeModel().double()
    batches = [(torch.randn(10, 2, 3, dtype=torch.float64),) for _ in range(2)]
    assert_training_matches(size_step, model, lambda p: torch.optim.SGD(p, lr=0.1), batches, mesh4)


def test_dsymint_compares_on_global_values():
    import pytest

    s = sc.DSymInt(8, 2, axes=(0,))
    assert s >= 8 and s > 7 and s <= 8 and s < 9 and 7 < s and s == 8 and s != 2
    assert sc.DSymInt(7, 7) < s and s >= sc.DSymInt(8, 8)
    assert s != sc.DSymInt(8, 8)  # another rank's view of the size: not the same DSymInt
    assert hash(s) == hash(8) and {s: "x"}[8] == "x"
    with pytest.raises(TypeError, match="compares a DSymInt with a number or a DSymInt"):
        s < "8"


class Shift(nn.Module):
    """Next-token style: ``h[:, : t - 1]`` with ``t = x.shape[1]`` (slice_backward's end is a size)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.lin(x)
        return h[:, : t - 1] * h[:, 1:]


def _shift_batches():
    return [(torch.randn(4, 6, 4, dtype=torch.float64),) for _ in range(2)]


@pytest.mark.parametrize("dim", [0, 1])  # the batch split by rows, or along the sliced dim (t itself sharded)
@pytest.mark.parametrize("symbolic", ["batch", "all"])
def test_slice_end_computed_from_a_size(symbolic, dim):
    # was: TypeError: '>=' not supported between instances of 'DSymInt' and 'int' (symbolic="all")
    mesh = fake_mesh((2,), ("dp",))
    res = assert_training_matches(size_step, Shift().double(), lambda p: torch.optim.SGD(p, lr=0.1), _shift_batches(), mesh,
                                  sc.Plan(default_input=[sc.Shard(dim)]), symbolic=symbolic)
    assert_distributed(res, sharded=["batch[0]"], collectives={"all_gather": 0} if dim == 0 else None)


def _symbolic_dims(traced):
    return [
        [isinstance(s, torch.SymInt) for s in n.meta["val"].shape]
        for n in traced.gm.graph.nodes if n.op == "placeholder" and n.meta["spmd_input"].kind == "batch"
    ]


@pytest.mark.parametrize("symbolic", ["batch", "all"])
def test_harness_and_compile_agree_on_symbolic_sizes(symbolic):
    """The harness must accept exactly the programs compile() accepts: both trace the same
    dims as symbols and build the same per-rank program."""
    import torch.distributed as dist

    torch.manual_seed(0)
    model = Shift().double()
    batch = _shift_batches()[0]
    twin = copy.deepcopy(model)
    sim = SimulatedTraining(size_step, twin, torch.optim.SGD(twin.parameters(), lr=0.1), fake_mesh((2,), ("dp",)), symbolic=symbolic)
    sim.step(*batch)
    try:
        mesh = fake_mesh((2,), ("dp",))
        step = sc.compile(size_step, mesh=mesh, symbolic=symbolic, check_ranks=False)
        step(model, torch.optim.SGD(model.parameters(), lr=0.1), batch[0][:2])
        compiled = step.last
    finally:
        dist.destroy_process_group()
    harness = sim.expansions[(0,)]
    assert _symbolic_dims(compiled.traced) == _symbolic_dims(harness.traced)
    expected = [[True, False, False]] if symbolic == "batch" else [[True, True, True]]  # only the sharded dim under "batch"
    assert _symbolic_dims(harness.traced) == expected
    ops = [[str(n.target) for n in e.gm.graph.nodes] for e in (compiled, harness)]
    assert ops[0] == ops[1]


@pytest.mark.parametrize("symbolic", ["batch", "all"])
def test_assert_spmd_matches_traces_what_compile_traces(symbolic):
    """assert_spmd_matches / run_spmd go through compile()'s program builder too: under
    "batch" only the sharded dim is a symbol, and the slice from a size is taken."""
    from spmd_compiler.testing import assert_spmd_matches

    def shift(x):
        t = x.shape[1]
        return x[:, : t - 1] * x[:, 1:]

    x = torch.randn(4, 6, 3, dtype=torch.float64)
    run = assert_spmd_matches(shift, [x], fake_mesh((2,), ("dp",)), [[sc.Shard(0)]], symbolic=symbolic)
    assert _symbolic_dims(run.traced) == ([[True, False, False]] if symbolic == "batch" else [[True, True, True]])
