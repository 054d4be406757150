"""assert_distributed (spmd_compiler/testing/checks.py): passes on sharded programs, fails
on a program that distributes nothing, on local shapes that disagree with the plan and on
wrong collective counts."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import spmd_compiler as sc
from spmd_compiler.testing import (
    SimulatedTraining,
    assert_distributed,
    assert_spmd_matches,
    assert_training_matches,
    distribution_of,
    fake_mesh,
    rank_coordinates,
)
from spmd_compiler.testing.models import MLP, megatron_mlp_plan
from spmd_compiler.testing.models import mse_train_step as mse_step


_TRACED: dict = {}


def _expand(mesh, plan=None, rows=8):
    """A fresh expansion of an MLP step traced once per batch size (expansion does not
    modify the traced step)."""
    if rows not in _TRACED:
        model = MLP()
        _TRACED[rows] = sc.trace(mse_step, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(rows, 16), torch.randn(rows, 16))
    return sc.expand(_TRACED[rows], mesh, plan)


REPLICATED = sc.Plan(default_input=[Replicate()])  # parameters default to Replicate too


def test_passes_on_data_parallel_and_names_what_is_distributed(mesh4):
    step = _expand(mesh4)
    dist = assert_distributed(step, collectives={"all_reduce/dp": 5, "optimizer/all_reduce": 4, "all_gather": 0}, sharded=["batch[0]"])
    assert dist.mesh == {"dp": 4} and dist.coordinates == ((0,),)
    assert dist.sharded == ("batch[0]", "batch[1]")
    assert dist.placements["l1.weight"] == "R" and dist.placements["batch[0]"] == "S(0)"
    assert dist.num_collectives == 5 and dist.count("dp") == 5 and dist.count("output") == 1
    assert assert_distributed(step, collectives=5) == dist


def test_passes_on_tensor_parallel_with_replicated_batch(mesh4):
    step = _expand(mesh4, sc.Plan(params=megatron_mlp_plan().params, default_input=[Replicate()]))
    dist = assert_distributed(step, collectives={"forward/all_reduce": 1}, sharded=["l1.weight", "l2.weight"])
    assert "batch[0]" not in dist.sharded


def test_fails_when_nothing_is_distributed(mesh4):
    step = _expand(mesh4, REPLICATED)
    assert step.collectives() == []
    with pytest.raises(AssertionError, match=r"nothing was distributed: .* got neither \(mesh \{'dp': 4\}; inputs l1.weight: R"):
        assert_distributed(step)
    # the same through the numerics API: it matches one device, and proves nothing
    res = assert_training_matches(mse_step, MLP().double(), lambda p: torch.optim.SGD(p, lr=0.1),
                                  [(torch.randn(8, 16, dtype=torch.float64),) * 2], mesh4, REPLICATED)
    with pytest.raises(AssertionError, match="nothing was distributed"):
        assert_distributed(res)
    dist = distribution_of(res)  # what is true of it: every rank holds everything, nothing is communicated
    assert dist.sharded == () and dist.num_collectives == 0 and len(dist.coordinates) == 4


def test_fails_on_wrong_collective_counts(mesh4):
    step = _expand(mesh4)
    with pytest.raises(AssertionError, match=r"'all_reduce/dp': expected 4, found 5; 'all_gather': expected 1, found 0\n.*phase"):
        assert_distributed(step, collectives={"all_reduce/dp": 4, "all_gather": 1})
    with pytest.raises(AssertionError, match="expected at least 6 collective"):
        assert_distributed(step, collectives=6)


def test_fails_on_sharded_names_that_are_not_sharded(mesh4):
    step = _expand(mesh4)
    with pytest.raises(AssertionError, match=r"expected sharded over a mesh axis of size > 1: \['l1.weight \(R\)'\]; sharded inputs are \['batch\[0\]', 'batch\[1\]'\]"):
        assert_distributed(step, sharded=["batch[0]", "l1.weight"])
    with pytest.raises(ValueError, match=r"\['l3.weight'\], which are not inputs .* inputs are \['l1.weight'"):
        assert_distributed(step, sharded=["l3.weight"])
    with pytest.raises(TypeError, match="got a str"):
        assert_distributed(step, sharded="batch[0]")


def test_fails_when_a_local_shape_is_the_global_one(mesh4):
    """A program that records Shard(0) but holds the whole tensor (the one-device program
    relabelled) is caught by its local shapes."""
    step = _expand(mesh4)
    gm = copy.deepcopy(step.gm)
    batch = next(n for n in gm.graph.find_nodes(op="placeholder") if n.name == "in_batch_0")
    batch.meta["val"] = torch.empty(8, 16)
    with pytest.raises(AssertionError, match=r"batch input 'batch\[0\]' on the rank at coordinate \(0,\): local shape \[8, 16\], expected \[2, 16\] \(global \[8, 16\] split by S\(0\)"):
        assert_distributed(gm)
    # and a placeholder whose recorded spec is not the step's input spec
    step.gm = gm
    batch.meta["val"] = torch.empty(2, 16)
    batch.meta["spmd_spec"] = step.input_specs[0]
    with pytest.raises(AssertionError, match=r"placeholder in_batch_0 records R \[32, 16\], the step's input_specs S\(0\) \[8, 16\]"):
        assert_distributed(step)


def test_checks_every_rank_of_uneven_shards(mesh4):
    """10 rows over 4 ranks: 3, 3, 3, 1. Rank 0's program reused for rank 3 is caught."""
    plan = sc.Plan(params={"*": [Shard(0)]})
    steps = {c: _expand(mesh4, plan, rows=10) if c == (0,) else None for c in rank_coordinates((4,))}
    last = sc.expand(steps[(0,)].traced, mesh4, plan, coordinate=(3,))
    steps[(3,)] = last
    del steps[(1,)], steps[(2,)]
    dist = assert_distributed(steps, sharded=["batch[0]", "l1.weight"])
    assert dist.coordinates == ((0,), (3,))
    steps[(3,)] = steps[(0,)]
    with pytest.raises(AssertionError, match=r"coordinate \(3,\): local shape \[3, 16\], expected \[1, 16\]"):
        assert_distributed(steps)


def test_fails_when_ranks_issue_different_collectives(mesh4):
    dp, fsdp = _expand(mesh4), _expand(mesh4, sc.Plan(params={"*": [Shard(0)]}))
    with pytest.raises(AssertionError, match=r"coordinates \(0,\) and \(1,\) have different collectives"):
        assert_distributed({(0,): dp, (1,): sc.expand(fsdp.traced, mesh4, sc.Plan(params={"*": [Shard(0)]}), coordinate=(1,))})


def test_accepts_every_numerics_api(mesh4):
    x = torch.randn(8, 4, dtype=torch.float64)
    run = assert_spmd_matches(lambda a: torch.tanh(a), [x], mesh4, [[Partial()]], atol=1e-12)
    assert assert_distributed(run, collectives={"all_reduce": 1}).coordinates == tuple(rank_coordinates((4,)))

    batches = [(torch.randn(8, 16, dtype=torch.float64),) * 2]
    res = assert_training_matches(mse_step, MLP().double(), lambda p: torch.optim.SGD(p, lr=0.1), batches, mesh4)
    assert assert_distributed(res) == assert_distributed(res.sim)

    sim = SimulatedTraining(mse_step, MLP().double(), torch.optim.SGD(MLP().parameters(), lr=0.1), mesh4)
    with pytest.raises(ValueError, match="no compiled program yet"):
        assert_distributed(sim)

    step = sc.compile(mse_step, mesh=mesh4)
    with pytest.raises(ValueError, match="has not compiled a step yet"):
        assert_distributed(step)
    model = MLP()
    step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 16), torch.randn(2, 16))
    # compile buckets the 4 gradient all_reduces into one, and the loss rides in it
    assert assert_distributed(step, collectives={"optimizer/all_reduce": 1, "output/all_reduce": 0}).sharded == ("batch[0]", "batch[1]")

    with pytest.raises(TypeError, match="expected a program: ExpandedStep, .* got int"):
        assert_distributed(3)


def test_bad_expectations_are_rejected(mesh4):
    step = _expand(mesh4)
    with pytest.raises(ValueError, match=r"collective key 'all_reduce/tp': \['tp'\] is not a collective kind, mesh axis or phase; .*axes \['dp'\]"):
        assert_distributed(step, collectives={"all_reduce/tp": 1})
    with pytest.raises(ValueError, match="expected None, a least count >= 1"):
        assert_distributed(step, collectives=0)
    with pytest.raises(ValueError, match="expected a count >= 0"):
        assert_distributed(step, collectives={"all_reduce": -1})


# ----------------------------------------------------------------------------- symbolic programs (dynamic=True)

def _cumsum_step(model, optimizer, x, y):
    loss = (model(x).cumsum(0) * y).mean()  # the cumsum over the sharded batch gathers it (padded when uneven)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _branch_step(model, optimizer, x, y):
    out = model(x)
    if x.shape[0] > 1:  # a size guard: the program serves batches of 2 rows or more
        out = out * 2
    loss = ((out - y) ** 2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _dynamic_sim(fn, ranks=3):
    torch.manual_seed(0)
    model = MLP(8, 6).double()
    sim = SimulatedTraining(fn, model, torch.optim.SGD(model.parameters(), lr=0.1), fake_mesh((ranks,), ("dp",)), dynamic=True)
    for b in (10, 7):
        sim.step(torch.randn(b, 8, dtype=torch.float64), torch.randn(b, 8, dtype=torch.float64))
    assert sim.compiles == 1, sim.reasons
    return sim


def _each_program(sim):
    return list({id(e.gm): e.gm for e in sim.expansions.values()}.values())


def test_symbolic_program_is_checked_at_even_and_uneven_batch_sizes():
    """A dynamic=True program takes the batch size as an input: it is fed sizes even and
    uneven over 3 ranks (and fewer rows than ranks) and run on fake tensors per rank."""
    sim = _dynamic_sim(mse_step)
    dist = assert_distributed(sim, dynamic=True, collectives={"optimizer/all_reduce/dp": 1}, sharded=["batch[0]", "batch[1]"])
    assert dist.batch_sizes == (1, 2, 3, 4, 7, 12, 15), dist
    assert any(b % 3 for b in dist.batch_sizes) and dist.placements["batch[0]"] == "S(0)"
    assert assert_distributed(sim, batch_sizes=[5, 2]).batch_sizes == (2, 5)
    sim.step(torch.randn(5, 8, dtype=torch.float64), torch.randn(5, 8, dtype=torch.float64))
    assert sim.compiles == 1, sim.reasons  # checking added no guard to the program's sizes
    cumsum = _dynamic_sim(_cumsum_step)
    gathers = assert_distributed(cumsum, dynamic=True, collectives={"forward/all_gather": 1})
    assert gathers.count("all_gather") == 2  # forward gather of the cumsum input, backward of its gradient
    # one row included: the dynamic trace's cumsum backward has no size guard (trace/rewrites.py)
    assert gathers.batch_sizes == (1, 2, 3, 4, 7, 12, 15)
    branch = _dynamic_sim(_branch_step)
    assert assert_distributed(branch, dynamic=True).batch_sizes == (2, 3, 4, 7, 12, 15)  # 1 breaks its size guard: skipped
    with pytest.raises(AssertionError, match=r"does not serve batch size 1: .*expected batch_sizes the program serves"):
        assert_distributed(branch, batch_sizes=[1])
    # dynamic=True insists on a symbolic program; a program for one shape fails it
    with pytest.raises(AssertionError, match="dynamic=True: expected a symbolic program"):
        assert_distributed(_expand(fake_mesh((4,), ("dp",))), dynamic=True)
    with pytest.raises(AssertionError, match="dynamic=False: expected a program compiled for one batch shape"):
        assert_distributed(sim, dynamic=False)
    with pytest.raises(ValueError, match="batch_sizes=.* is for symbolic programs"):
        assert_distributed(_expand(fake_mesh((4,), ("dp",))), batch_sizes=[4])


def test_symbolic_program_with_a_wrong_size_node_fails():
    """The MSE mean divides by the global count 8*B, an integer node of the program: made
    4*B on one rank, the run at the first size names the node, the rank and both values."""
    sim = _dynamic_sim(mse_step)
    gm = sim.expansions[(1,)].gm
    (count,) = [n for n in gm.graph.nodes if n.target is operator.mul and n.args[0] == 8]
    count.args = (4, count.args[1])
    gm.recompile()
    with pytest.raises(AssertionError, match=r"coordinate \(1,\), global batch size 1: size node mul_\d+ \(mul\) computes 4, but "
                                             r"the program records 8\*s\d+ = 8 for this size"):
        assert_distributed(sim)


def test_symbolic_program_with_an_unpadded_gather_fails_at_uneven_sizes_only():
    """The cumsum gathers the batch, each rank's piece padded to ceil(B/3) rows first. With
    the padding dropped from the all_gather every even size still passes (equal pieces);
    the uneven sizes the check feeds by default catch it."""
    sim = _dynamic_sim(_cumsum_step)
    for gm in _each_program(sim):
        gather = next(n for n in gm.graph.nodes if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default)
        padded = gather.args[0]  # contiguous(cat(local rows, new_zeros(pad rows)))
        assert padded.args[0].target is torch.ops.aten.cat.default, padded.format_node()
        gather.args = (padded.args[0].args[0][0], *gather.args[1:])
        gm.recompile()
    assert assert_distributed(sim, batch_sizes=[3, 6, 12]).batch_sizes == (3, 6, 12)  # every piece equal: nothing to see
    # the first size fed, one row (rank 1's piece empty; the program serves it since the
    # cumsum backward has no size guard), catches it
    with pytest.raises(AssertionError, match=r"coordinate \(1,\), global batch size 1: all_gather_into_tensor\S* .*\(from cumsum, "
                                             r"test_testing_checks.py:\d+: loss = \(model\(x\).cumsum\(0\) \* y\).mean\(\)\) has shape "
                                             r"\[0, 8\], but the program records \[3\*u\d+, 8\] = \[3, 8\] for this size"):
        assert_distributed(sim)


def test_collective_buffers_must_agree_across_the_ranks_of_a_group():
    from spmd_compiler.testing.symbolic_checks import _same_buffers

    same = {(0, 0): [("all_gather", "dp", (3, 6), "ag")], (1, 0): [("all_gather", "dp", (3, 6), "ag")],
            (0, 1): [("all_gather", "dp", (2, 6), "ag")], (1, 1): [("all_gather", "dp", (2, 6), "ag")]}
    _same_buffers(same, ("dp", "tp"), 7)  # groups of dp: {(0,0),(1,0)} and {(0,1),(1,1)}, each one shape
    differ = {**same, (1, 1): [("all_gather", "dp", (1, 6), "ag")]}
    with pytest.raises(AssertionError, match=r"batch size 7: all_gather over mesh axis dp .*\(0, 1\): ag \[2, 6\], \(1, 1\): ag \[1, 6\]"):
        _same_buffers(differ, ("dp", "tp"), 7)
