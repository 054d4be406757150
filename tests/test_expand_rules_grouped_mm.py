"""``torch._grouped_mm`` (spmd_compiler/expand/rules/grouped_mm.py) with the experts split
over two mesh axes, by expert over the data axis and by hidden dim over tp, and gate|up
stored as one fused weight split by ``chunk`` (Hugging Face's ``gate_up_proj``): the
fused pieces' strided layout meets the weight's plain ``Shard`` only in the gradient of
the routed rows, and is aligned there on tp alone, so the rows never leave their experts'
ranks: expert parallelism (four row exchanges) equal to one device in float64. Stored
with ``fused_shard(1, 2)`` (each rank its block of both pieces), the fused weight needs
no exchange at all: its products contract matching strided layouts into Partial sums."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import spmd_compiler as sc
import spmd_compiler._private_torch as pt
from spmd_compiler.expand.args import TensorArg
from spmd_compiler.expand.rules.grouped_mm import contracted_like_weight, grouped_mm_placements
from spmd_compiler.testing import assert_training_matches, fake_mesh
from spmd_compiler.testing.kernels import float64_grouped_mm
from spmd_compiler.testing.moe import MoEConfig, MoETransformer, moe_train_step

STRIDED = pt.StridedShard(1, split_factor=2)


def _arg(mesh, placements, shape) -> TensorArg:
    node = fx.Graph().placeholder("x")
    stride = torch.empty(shape, device="meta").stride()
    return TensorArg(node, pt.make_spec(mesh, list(placements), tuple(shape), stride, torch.float64))


def test_strided_rows_take_the_weights_plain_split_of_k_off_the_token_axes():
    """The gradient of the routed rows: ``a`` (rows, 2h) in the fused pieces' strided
    layout on tp, the weight (experts, 2h, d) ``Shard(1)`` there: ``a`` moves on tp only;
    on the token axis (dp) nothing moves."""
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    a = _arg(mesh, [Shard(0), STRIDED], (32, 16))
    w = _arg(mesh, [Shard(0), Shard(1)], (4, 16, 8))
    assert contracted_like_weight(a, w, (0,), 2) == [Shard(0), Shard(1)]
    assert contracted_like_weight(_arg(mesh, [Shard(0), Shard(1)], (32, 16)), w, (0,), 2) is None  # already aligned
    assert contracted_like_weight(a, _arg(mesh, [Shard(0), Replicate()], (4, 16, 8)), (0,), 2) is None  # k whole in the weight
    assert contracted_like_weight(a, w, (0, 1), 2) is None  # a token axis: the rows' order lives there, nothing moves


class FusedExperts(nn.Module):
    """SwiGLU experts with gate and up stored as one weight ``w13`` (experts, 2 x hidden,
    dim), split by ``chunk`` after the first grouped matmul, as transformers does."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        e, h, d = cfg.experts, cfg.hidden, cfg.dim
        self.w13 = nn.Parameter(torch.randn(e, 2 * h, d) * d**-0.5)
        self.w2 = nn.Parameter(torch.randn(e, d, h) * h**-0.5)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        gate, up = torch._grouped_mm(x, self.w13.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, self.w2.transpose(-2, -1), offs=offs)


def test_fused_experts_split_by_expert_and_hidden_dim_stay_expert_parallel():
    cfg = MoEConfig()
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    for layer in model.layers:
        layer.moe.experts = FusedExperts(cfg)
    plan = sc.Plan(params={"*.experts.w13": [Shard(0), Shard(1)], "*.experts.w2": [Shard(0), Shard(2)]},
                   default_input=[Shard(0), Replicate()])
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, cfg.vocab, (4, cfg.seq), generator=g), torch.randint(0, cfg.vocab, (4, cfg.seq), generator=g))
            for _ in range(3)]
    with float64_grouped_mm():
        res = assert_training_matches(moe_train_step, model.double(), lambda p: torch.optim.AdamW(p, lr=0.01), data,
                                      fake_mesh((2, 2), ("dp", "tp")), plan)
    e = res.sim.expansions[next(iter(res.sim.expansions))]
    assert e.stats.fallbacks == [], e.stats.fallbacks  # the routing stays on each rank's own tokens
    comms = [(str(n.target), n.meta["spmd_comm"]["reason"]) for n in e.collectives()]
    assert len([c for c in comms if c[0] == str(pt.ALL_TO_ALL_ROWS)]) == 4, comms  # to the experts and back, twice
    assert [c for c in comms if "all_gather" in c[0]] == [], comms


def test_matching_strided_contractions_are_partial_sums():
    """The routed rows' gradient ``a`` (rows, 2h) and the weight (experts, 2h, d) both in
    the fused pieces' strided layout on tp: each rank holds the same indices of the
    contracted dim in both, so the product is a Partial sum; the weight gradient of a
    strided ``b`` (rows, 2h) keeps the layout in its n dim."""
    mesh = fake_mesh((2,), ("tp",))
    a = _arg(mesh, [STRIDED], (32, 16))
    w = _arg(mesh, [STRIDED], (4, 16, 8))
    assert grouped_mm_placements(a, w, (), 1) == [pt.Partial("sum")]
    other = _arg(mesh, [pt.StridedShard(1, split_factor=4)], (4, 16, 8))
    assert grouped_mm_placements(a, other, (), 1) is None  # other blocks: no local form
    x_t = _arg(mesh, [Replicate()], (8, 32))
    assert grouped_mm_placements(x_t, a, (), 1) == [pt.StridedShard(2, split_factor=2)]


def _fused_model_and_data(cfg):
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    for layer in model.layers:
        layer.moe.experts = FusedExperts(cfg)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, cfg.vocab, (4, cfg.seq), generator=g), torch.randint(0, cfg.vocab, (4, cfg.seq), generator=g))
            for _ in range(3)]
    return model.double(), data


def test_fused_weight_stored_as_its_pieces_blocks_moves_nothing_but_the_tp_sums():
    """Experts' tensor parallelism with ``w13`` stored by ``fused_shard(1, 2)``: no
    all_to_all and no gather of the weight, its gradient or the rows (a plain ``Shard(1)``
    re-lays the rows out forward and backward, and the gradient before the optimizer);
    only the all_reduces Megatron makes; equal to one device."""
    cfg = MoEConfig()
    comms = {}
    for name, w13 in (("fused", sc.fused_shard(1, 2)), ("plain", Shard(1))):
        model, data = _fused_model_and_data(cfg)
        plan = sc.Plan(params={"*.experts.w13": [w13], "*.experts.w2": [Shard(2)]}, default_input=[Replicate()])
        with float64_grouped_mm():
            res = assert_training_matches(moe_train_step, model, lambda p: torch.optim.AdamW(p, lr=0.01), data,
                                          fake_mesh((2,), ("tp",)), plan)
        e = res.sim.expansions[next(iter(res.sim.expansions))]
        comms[name] = [(n.meta["spmd_comm"]["kind"], n.meta["spmd_comm"]["reason"]) for n in e.collectives()]
    assert {kind for kind, _ in comms["fused"]} == {"all_reduce"}, comms["fused"]
    moves = [why for kind, why in comms["plain"] if kind == "all_to_all"]
    assert len(moves) == 3 and "fused_shard(d, 2)" in moves[0], comms["plain"]  # what the fix saves, and the advice


def test_fused_weight_under_expert_parallel_x_tp_exchanges_rows_only():
    cfg = MoEConfig()
    model, data = _fused_model_and_data(cfg)
    plan = sc.Plan(params={"*.experts.w13": [Shard(0), sc.fused_shard(1, 2)], "*.experts.w2": [Shard(0), Shard(2)]},
                   default_input=[Shard(0), Replicate()])
    with float64_grouped_mm():
        res = assert_training_matches(moe_train_step, model, lambda p: torch.optim.AdamW(p, lr=0.01), data,
                                      fake_mesh((2, 2), ("dp", "tp")), plan)
    e = res.sim.expansions[next(iter(res.sim.expansions))]
    comms = [(str(n.target), n.meta["spmd_comm"]["kind"], n.meta["spmd_comm"]["reason"]) for n in e.collectives()]
    assert len([c for c in comms if c[0] == str(pt.ALL_TO_ALL_ROWS)]) == 4, comms
    # besides the rows, only their counts travel (one small all_to_all); nothing re-lays the fused weight out
    assert [c for c in comms if c[1] in ("all_to_all", "all_gather") and not c[2].startswith("expert parallelism")] == [], comms
