"""dynamic=True beyond data parallel: one program per mesh serves every batch size for
FSDP plans, the GPT's flatten of a sharded batch, the GPT on DP x TP and the GPT with
its batch split along the sequence (docs/dynamic_shapes.md), equal to one device after
every step; the collectives are those of the per-shape program of an even size, or
differ by the all_gathers each test names."""

from __future__ import annotations

import copy
import operator
from collections import Counter

import pytest
import sympy
import torch
from torch.distributed.tensor import Shard

import spmd_compiler as sc
from spmd_compiler import _private_torch as sc_pt
from spmd_compiler.testing import SimulatedTraining, fake_mesh
from spmd_compiler.testing.models import GPT, MLP, _tp_params, gpt_2d_plan, gpt_fsdp_plan, mse_train_step, train_step

SIZES = [5, 1, 2, 4, 7, 33]  # uneven, smaller than the mesh, even, one row


def _comms(step) -> Counter:
    return Counter(n.meta["spmd_comm"]["kind"] for n in step.gm.graph.nodes if "spmd_comm" in n.meta)


def _train(step_fn, model, batches, mesh, plan, **options):
    """Steps on the simulated ranks and on one device; the parameters agree (1e-10) after
    every step. Returns the simulator."""
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    sim_model = copy.deepcopy(model)
    sim = SimulatedTraining(step_fn, sim_model, torch.optim.SGD(sim_model.parameters(), lr=0.1), mesh, plan, **options)
    for i, batch in enumerate(batches):
        loss = sim.step(*batch)
        ref_loss = step_fn(ref, ref_opt, *batch)
        torch.testing.assert_close(loss.detach(), ref_loss.detach(), atol=1e-10, rtol=0)
        for (name, p), q in zip(sim_model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), atol=1e-10, rtol=0,
                                       msg=lambda m, n=name: f"step {i} (batch {batch[0].shape[0]}): {n}: {m}")
    return sim


def _mlp_batches():
    torch.manual_seed(0)
    return [(torch.randn(b, 8, dtype=torch.float64), torch.randn(b, 8, dtype=torch.float64)) for b in SIZES]


def _gpt():
    torch.manual_seed(0)
    model = GPT(vocab=16, seq=4, dim=8, heads=2, layers=1).double()
    return model, [(torch.randint(0, 16, (b, 4)), torch.randint(0, 16, (b, 4))) for b in SIZES]


def _static_even(step_fn, model, batch, mesh, plan):
    """The per-shape program of one (even) batch: the collectives to match."""
    m = copy.deepcopy(model)
    sim = SimulatedTraining(step_fn, m, torch.optim.SGD(m.parameters(), lr=0.1), mesh, plan)
    sim.step(*batch)
    return sim.expansions[(0,) * len(mesh.shape)]


MLP_FSDP = sc.Plan(params={"*": [Shard(0)]}, default_input=[Shard(0)], fsdp_axes=("dp",))


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_fsdp_mlp_one_program_for_every_batch_size(ranks):
    mesh = fake_mesh((ranks,), ("dp",))
    model = MLP(8, 6).double()
    sim = _train(mse_train_step, model, _mlp_batches(), mesh, MLP_FSDP, dynamic=True)
    assert sim.compiles == 1, sim.reasons
    prog = sim.expansions[(0,)]
    assert [s.label for s in prog.size_symbols] == ["batch[0]"]
    even = ranks * 4
    static = _static_even(mse_train_step, model, (torch.randn(even, 8, dtype=torch.float64),) * 2, mesh, MLP_FSDP)
    # parameters gathered once per phase, gradients reduce-scattered in one bucket: as per shape
    assert _comms(prog) == _comms(static) and _comms(prog)["reduce_scatter"] == 1, (_comms(prog), _comms(static))


# 3 ranks: uneven shards; 4: also empty shards (B = 1, 2) and shards of one row, the
# cases 2 ranks checked (B = 1 empty, B = 5 uneven) included
@pytest.mark.parametrize("ranks", [3, 4])
@pytest.mark.parametrize("plan", ["dp", "fsdp"])
def test_gpt_one_program_for_every_batch_size(plan, ranks):
    """The GPT flattens the sharded batch, ``(B, T, D) -> (B*T, D)`` in every Linear and
    the loss: kept sharded in units of T rows for every B (no gather), so the program
    makes the collectives of the per-shape program of an even batch (one bucket with the
    mean's pair riding in it)."""
    mesh = fake_mesh((ranks,), ("dp",))
    the_plan = gpt_fsdp_plan() if plan == "fsdp" else None
    model, batches = _gpt()
    sim = _train(train_step, model, batches, mesh, the_plan, dynamic=True)
    assert sim.compiles == 1, sim.reasons
    prog = sim.expansions[(0,)]
    static = _static_even(train_step, model, tuple(torch.randint(0, 16, (ranks * 2, 4)) for _ in range(2)), mesh, the_plan)
    # one gradient bucket (DP) or reduce_scatter bucket (FSDP) with the [loss sum, target
    # count] pair riding in it (optimize/deferred_divisor.py), per shape and symbolic alike
    assert _comms(prog) == _comms(static), (_comms(prog), _comms(static))
    assert plan != "dp" or _comms(prog) == Counter(all_reduce=1), _comms(prog)
    # the flattened rows are this rank's chunk of B times T: an integer node 4 * local(B)
    views = [n for n in prog.gm.graph.nodes if n.target is torch.ops.aten.view.default and n.args[0].name == "in_batch_1"]
    assert views and views[0].args[1][0].target is operator.mul and 4 in views[0].args[1][0].args


def _cumsum_step(model, optimizer, x, y):
    out = model(x).flatten(0, 1)  # (B*T, D), split in units of T rows
    loss = (out.cumsum(0) * y.flatten(0, 1)).mean()  # gathered for the cumsum, narrowed back in backward
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


@pytest.mark.parametrize("ranks", [3, 4])
def test_flattened_batch_gathers_and_narrows_in_units_of_rows(ranks):
    """A flattened uneven batch is not torch.chunk's layout of B*T (5 rows of 4 over 3
    ranks: 8, 8, 4 rows, not 7, 7, 6): its gather pads each rank to T * ceil(B/n) rows and
    its narrow starts at T * coord * ceil(B/n), for every size."""
    torch.manual_seed(0)
    batches = [(torch.randn(b, 4, 8, dtype=torch.float64), torch.randn(b, 4, 6, dtype=torch.float64)) for b in SIZES]
    sim = _train(_cumsum_step, MLP(8, 6, 6).double(), batches, fake_mesh((ranks,), ("dp",)), None, dynamic=True)
    assert sim.compiles == 1, sim.reasons
    gathers = [n.meta["spmd_comm"]["reason"] for n in sim.expansions[(0,)].gm.graph.nodes
               if n.meta.get("spmd_comm", {}).get("kind") == "all_gather"]
    assert any("cumsum" in r for r in gathers), gathers


def test_a_returned_flattened_batch_is_gathered_for_the_caller():
    """The caller assembles a sharded output in torch.chunk's layout, which a dim split in
    units of rows is not (uneven B): such an output is gathered, equal to one device."""
    def step(model, optimizer, x, y):
        out = model(x).flatten(0, 1)
        loss = (out * y.flatten(0, 1)).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss, out.detach()

    torch.manual_seed(0)
    model = MLP(8, 6, 6).double()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    sim = SimulatedTraining(step, model, torch.optim.SGD(model.parameters(), lr=0.1), fake_mesh((3,), ("dp",)), dynamic=True)
    for b in SIZES:
        x, y = torch.randn(b, 4, 8, dtype=torch.float64), torch.randn(b, 4, 6, dtype=torch.float64)
        (loss, out), (ref_loss, ref_out) = sim.step(x, y), step(ref, ref_opt, x, y)
        torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=0)
        torch.testing.assert_close(loss, ref_loss, atol=1e-10, rtol=0)
    assert sim.compiles == 1, sim.reasons
    assert sim.expansions[(0,)].outputs[1].spec.placements == (sc.Replicate(),)


def test_2d_dp_by_tp_mlp_one_program_for_every_batch_size():
    """Batch split on 'dp', the Megatron MLP on 'tp' (2 x 2): DTensor's planner and its
    costs take the sizes' example values on two mesh axes (they hash shapes); the steps
    and collectives are placement changes, emitted for any size."""
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    plan = sc.Plan(params={"l1.weight": [sc.Replicate(), Shard(0)], "l1.bias": [sc.Replicate(), Shard(0)],
                           "l2.weight": [sc.Replicate(), Shard(1)]}, default_input=[Shard(0), sc.Replicate()])
    model = MLP(8, 6).double()
    sim = _train(mse_train_step, model, _mlp_batches(), mesh, plan, dynamic=True)
    assert sim.compiles == 1, sim.reasons
    static = _static_even(mse_train_step, model, (torch.randn(4, 8, dtype=torch.float64),) * 2, mesh, plan)
    assert _comms(sim.expansions[(0, 0)]) == _comms(static), (_comms(sim.expansions[(0, 0)]), _comms(static))


def _seq_batches(seq: int, sizes=SIZES):
    torch.manual_seed(0)
    model = GPT(vocab=16, seq=seq, dim=8, heads=2, layers=1).double()
    return model, [(torch.randint(0, 16, (b, seq)), torch.randint(0, 16, (b, seq))) for b in sizes]


SEQ_TP = sc.Plan(params=_tp_params(1, 0), default_input=[Shard(1)])  # Megatron TP, ids split along T


def _gathers(step) -> Counter:
    return Counter(c["reason"].split(" (")[0] for n in step.gm.graph.nodes
                   if (c := n.meta.get("spmd_comm")) and c["kind"] == "all_gather")


@pytest.mark.parametrize("ranks,seq", [(2, 4), (4, 8)])
def test_sequence_sharded_tp_gpt_one_program_for_every_batch_size(ranks, seq):
    """Megatron TP with the batch split along the sequence (``Shard(1)``): the batch
    size, dim 0, is the only size symbol (unsharded, the same on every rank); the split
    sequence stays static. So every flatten of ``(B, T)`` or ``(B, heads)`` with T or the
    heads split keeps a strided layout of B blocks (``pt.symbolic_split``, a static
    period), as the per-shape program keeps ``_StridedShard(0, B)``: the same collectives
    as per shape, and the LM head and the loss run on this rank's rows only
    (docs/dynamic_shapes.md, "Strided layouts"). On 4 ranks the 2 heads are not split
    and attention gathers in both programs. On 2 ranks every size 1..33 from the program
    of the first call (one row), equal to one device after every step; on 4, SIZES."""
    mesh = fake_mesh((ranks,), ("tp",))
    model, batches = _seq_batches(seq, range(1, 34) if ranks == 2 else SIZES)
    sim = _train(train_step, model, batches, mesh, SEQ_TP, dynamic=True)
    assert sim.compiles == 1, sim.reasons
    prog = sim.expansions[(0,)]
    assert {(s.label, s.dim) for s in prog.size_symbols} == {("batch[0]", 0)}  # B (the targets read the same symbol)
    static = _static_even(train_step, model, tuple(torch.randint(0, 16, (4, seq)) for _ in range(2)), mesh, SEQ_TP)
    assert _comms(prog) == _comms(static), (_comms(prog), _comms(static))
    where = [Counter(k.split(":")[0] for k in _gathers(p).elements()) for p in (prog, static)]  # "input 0 of mm.default"
    assert where[0] == where[1], where
    head = [n for n in prog.gm.graph.nodes if n.target is torch.ops.aten._log_softmax.default]
    assert [sc_pt.split_period(n.meta["spmd_spec"].placements[0]) for n in head] == [seq], head  # the loss on local rows
    bmms = [n for n in prog.gm.graph.nodes if n.target is torch.ops.aten.bmm.default]
    split = [n for n in bmms if sc_pt.split_period(n.meta["spmd_spec"].placements[0]) == 2]
    assert len(split) == (6 if ranks == 2 else 0), [n.meta["spmd_spec"].placements for n in bmms]


def test_sequence_sharded_tp_gpt_new_sequence_length_compiles_again():
    """The split sequence is static under dynamic=True: a new sequence length compiles
    one more symbolic program (named in the reason), which then serves every batch size
    of it; going back to the first length reuses the first program. Equal to one device
    after every step."""
    mesh = fake_mesh((2,), ("tp",))
    _, short = _seq_batches(4, [5, 2])
    model, long = _seq_batches(6, [3, 4])  # a model for up to 6 positions
    batches = [short[0], long[0], long[1], short[1]]
    sim = _train(train_step, model, batches, mesh, SEQ_TP, dynamic=True)
    assert sim.compiles == 2, sim.reasons
    assert "batch[0]" in sim.reasons[1] and "4" in sim.reasons[1] and "6" in sim.reasons[1], sim.reasons
    assert all(e.size_symbols for e in sim.expansions.values())


def test_sequence_sharded_tp_gpt_symbolic_program_collectives_as_per_shape():
    """The benchmark's ``tp_seq`` GPT (benchmarks/compile_time_dynamic.py: vocab 64, seq 16,
    dim 32, 4 heads, AdamW; one of its 2 layers here, the second repeats the first) on 4
    ranks, compiled only: the symbolic program
    makes no more all_gathers than the per-shape one of batch 16. Before, the flatten
    ``(B, T, D) -> (B*T, D)`` had a symbolic period (T a size symbol) and gathered there,
    running the LM head and the loss on every row on every rank."""
    torch.manual_seed(0)
    model = GPT(vocab=64, seq=16, dim=32, heads=4, layers=1)
    mesh = fake_mesh((4,), ("tp",))
    batch = (torch.randint(0, 64, (16, 16)), torch.randint(0, 64, (16, 16)))
    programs = {}
    for dynamic in (True, False):
        m = copy.deepcopy(model)
        sim = SimulatedTraining(train_step, m, torch.optim.AdamW(m.parameters(), lr=1e-3), mesh, SEQ_TP, dynamic=dynamic)
        sim.step(*batch)
        programs[dynamic] = sim.expansions[(0,)]
    assert programs[True].size_symbols and not programs[False].size_symbols
    sym, conc = _comms(programs[True]), _comms(programs[False])
    assert sym["all_gather"] <= conc["all_gather"], (sym, conc)
    assert sym == conc, (sym, conc)
    # the loss runs on this rank's rows: B sequences of 4 positions (16 split in 4)
    (rows,) = [n.meta["val"].shape[0] for n in programs[True].gm.graph.nodes if n.target is torch.ops.aten._log_softmax.default]
    (b,) = {s.symbol for s in programs[True].size_symbols}
    assert sympy.simplify(sc_pt.sym_expr(rows) - 4 * sympy.Symbol(str(b), integer=True, positive=True)) == 0 or \
        str(sc_pt.sym_expr(rows)) == f"4*{b}", rows
    assert [n.meta["val"].shape[0] for n in programs[False].gm.graph.nodes if n.target is torch.ops.aten._log_softmax.default] == [64]


@pytest.mark.parametrize("heads,dim", [(3, 12), (2, 8)])
def test_sequence_sharded_tp_gpt_on_3_ranks_one_program_for_every_batch_size(heads, dim):
    """Three ranks, the sequence (6) split in 3: one program, equal to one device for
    every B, with three heads and with two (features 8 over 3 ranks, uneven: the head
    split's view gathers them, as per shape). Before, that gather of a static uneven dim
    padded with ``constant_pad_nd``, whose fake kernel read the (B, T, 8) sizes as ints:
    B and T became constants and the step compiled per shape (INFO)."""
    torch.manual_seed(0)
    model = GPT(vocab=16, seq=6, dim=dim, heads=heads, layers=1).double()
    batches = [(torch.randint(0, 16, (b, 6)), torch.randint(0, 16, (b, 6))) for b in SIZES]
    mesh = fake_mesh((3,), ("tp",))
    sim = _train(train_step, model, batches, mesh, SEQ_TP, dynamic=True)
    assert sim.compiles == 1, sim.reasons
    if heads == 2:
        static = _static_even(train_step, model, tuple(torch.randint(0, 16, (3, 6)) for _ in range(2)), mesh, SEQ_TP)
        dyn, per_shape = _comms(sim.expansions[(0,)]), _comms(static)
        assert dyn["all_gather"] == per_shape["all_gather"] and dyn["all_reduce"] <= per_shape["all_reduce"], (dyn, per_shape)


def test_2d_gpt_one_program_for_every_batch_size():
    """The GPT on DP x TP (2 x 2) keeps one program for every batch size, uneven and
    one-row first batches included. Two guards pinned the batch before: the replicate
    fallback compared a size's example value with its SymInt (``Eq(2*s3, 10)`` for B=5:
    every later size concrete, a gather of the even-looking 20 rows left unnarrowed, a
    backward ``mm`` of [8, 20] x [24, 8]), and ``contiguous()`` of a gathered, moved dim
    asked ``Eq(16*s3, 16)`` for B=1.

    Collectives: the per-shape program's. Attention's flatten of (batch, heads), batch
    split on 'dp' and heads on 'tp', is a ``_StridedShard`` whose split factor is the
    symbolic local batch: kept as ``pt.symbolic_split`` (its static period, the heads),
    so the bmms run sharded on both axes (docs/dynamic_shapes.md, "Strided layouts")."""
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    model, batches = _gpt()
    sim = _train(train_step, model, batches, mesh, gpt_2d_plan(), dynamic=True)
    assert sim.compiles == 1, sim.reasons
    prog = sim.expansions[(0, 0)]
    static = _static_even(train_step, model, tuple(torch.randint(0, 16, (4, 4)) for _ in range(2)), mesh, gpt_2d_plan())
    # tp: 2 + 2 activation all_reduces; dp: one gradient bucket, the mean's pair riding in it
    assert _comms(static) == Counter(all_reduce=5), _comms(static)
    assert _comms(prog) == _comms(static), (_comms(prog), _comms(static))
    # attention's (batch, heads) flattens keep a strided layout with a symbolic block count
    strided = [n for n in prog.gm.graph.nodes if n.target is torch.ops.aten.bmm.default
               and sc_pt.split_period(n.meta["spmd_spec"].placements[1]) == 2]
    assert len(strided) == 6, strided


def test_2d_gpt_uneven_batch_per_shape_equals_one_device():
    """dynamic=False, B=5 on 2 x 2 (rows 3 and 2 per 'dp' rank): the per-shape program
    gathers the uneven flattens and equals one device."""
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    model, batches = _gpt()
    sim = _train(train_step, model, batches[:1] * 2, mesh, gpt_2d_plan())
    assert batches[0][0].shape[0] == 5 and sim.compiles == 1, sim.reasons


@pytest.mark.slow  # 33 steps on the simulated ranks and on one device
@pytest.mark.parametrize("plan", ["2d"])  # "seq": test_sequence_sharded_tp_gpt_one_program_for_every_batch_size[2-4]
def test_gpt_every_batch_size_from_1_to_33(plan):
    """Every size 1..33 (odd and even, below and above the mesh size) from the one
    program of the first call, equal to one device after every step."""
    model, batches = _seq_batches(4, range(1, 34))
    sim = _train(train_step, model, batches, fake_mesh((2, 2), ("dp", "tp")), gpt_2d_plan(), dynamic=True)
    assert sim.compiles == 1, sim.reasons


class _Conv1DMLP(torch.nn.Module):
    """GPT-2's ``Conv1D``: ``addmm(b, x.view(-1, x.size(-1)), w).view(*x.shape[:-1], n)``
    (an inferred ``-1`` in the flatten of the batch)."""

    def __init__(self, d: int = 8, h: int = 6):
        super().__init__()
        self.w1, self.b1 = torch.nn.Parameter(torch.randn(d, h)), torch.nn.Parameter(torch.randn(h))
        self.w2, self.b2 = torch.nn.Parameter(torch.randn(h, d)), torch.nn.Parameter(torch.randn(d))

    def forward(self, x):
        h = torch.addmm(self.b1, x.view(-1, x.size(-1)), self.w1).view(*x.shape[:-1], self.w1.shape[1])
        h = torch.tanh(h)
        return torch.addmm(self.b2, h.view(-1, h.size(-1)), self.w2).view(*h.shape[:-1], self.w2.shape[1])


@pytest.mark.parametrize("mesh_shape", [(3,), (2, 2)], ids=["dp3", "dp2xtp2"])
def test_inferred_flatten_of_the_batch_stays_sharded(mesh_shape):
    """``x.view(-1, D)`` of a batch split (unevenly) on dp: the -1 is the batch's rows
    times the static dims behind, so the view keeps the batch sharded (no gather)."""
    torch.manual_seed(0)
    model = _Conv1DMLP().double()
    batches = [(torch.randn(b, 4, 8, dtype=torch.float64), torch.randn(b, 4, 8, dtype=torch.float64)) for b in SIZES]
    names = ("dp",) if len(mesh_shape) == 1 else ("dp", "tp")
    plan = sc.Plan(default_input=[Shard(0)] + [sc.Replicate()] * (len(mesh_shape) - 1))
    sim = _train(mse_train_step, model, batches, fake_mesh(mesh_shape, names), plan, dynamic=True)
    assert sim.compiles == 1, sim.reasons
    step = sim.expansions[(0,) * len(mesh_shape)]
    assert _comms(step)["all_gather"] == 0, _comms(step)
