"""The RNG contract on real gloo processes (2 ranks, one launch), against one device.

- TP (dropout on a sharded and on a replicated activation), every rank seeded alike:
  equal to one device bit for bit on the first step, generators left as one device's.
- The same with per-rank seeds: the step draws from rank 0's generator (one broadcast),
  so it still equals one device seeded like rank 0; rank 1's generator is put back.
- A 2-stage pipeline with dropout: checkpoint="always" recomputes each forward with the
  forward's numbers, so it trains exactly like checkpoint="never".
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from gloo_launch import run_processes
from spmd_compiler.testing.models import megatron_mlp_plan, mse_train_step

pytestmark = pytest.mark.gloo


class DropMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.l2(self.drop(torch.relu(self.l1(x)))))  # TP: sharded, then replicated
        sc.pipe_split()
        return self.l3(self.drop(h))


def _batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randn(8, 8, generator=g, dtype=torch.float64)) for _ in range(3)]


def _tp(rank: int, per_rank_seed: bool) -> dict:
    torch.manual_seed(0)
    model = DropMLP().double()
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    step = sc.compile(mse_train_step, mesh=(2,), plan=sc.Plan(params=megatron_mlp_plan().params, default_input=[sc.Replicate()]))
    torch.manual_seed(100 + (rank if per_rank_seed else 0))
    ref_gen = torch.Generator().manual_seed(100)  # one device, seeded like rank 0
    losses, ref_losses, mine_kept, ref_state_equal = [], [], [], []
    for x, y in _batches():
        before = torch.get_rng_state()
        losses.append(step(model, opt, x, y).item())
        after = torch.get_rng_state()
        saved = torch.get_rng_state()
        torch.set_rng_state(ref_gen.get_state())
        ref_losses.append(mse_train_step(ref, ref_opt, x, y).item())
        ref_gen.set_state(torch.get_rng_state())
        torch.set_rng_state(saved)
        mine_kept.append(torch.equal(before, after))
        ref_state_equal.append(torch.equal(after, ref_gen.get_state()))
    err = max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    return {"losses": losses, "ref_losses": ref_losses, "param_err": err, "kept": mine_kept, "state_as_one_device": ref_state_equal,
            "adopted": step._guard.rng.adopted if step._guard and step._guard.rng else 0}


def _pipeline(rank: int, checkpoint: str) -> dict:
    torch.manual_seed(0)
    model = DropMLP().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile(mse_train_step, mesh={"pp": 2}, pipeline=sc.Pipeline(chunks=2, schedule="1F1B", checkpoint=checkpoint))
    torch.manual_seed(5)
    losses = [step(model, opt, x, y).item() for x, y in _batches()]
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
    return {"losses": losses, "params": [p.tolist() for p in params]}


def _cases(rank: int, world: int) -> dict:
    return {
        "same_seed": _tp(rank, per_rank_seed=False),
        "per_rank_seed": _tp(rank, per_rank_seed=True),
        "pp_never": _pipeline(rank, "never"),
        "pp_always": _pipeline(rank, "always"),
    }


@pytest.fixture(scope="module")
def results():
    return run_processes(_cases, 2, timeout=240)


@pytest.mark.parametrize("case", ["same_seed", "per_rank_seed"])
def test_tp_dropout_equals_one_device(results, case):
    for rank, r in enumerate(results):
        got = r[case]
        # the same draws: only the loss reduction's summation order differs (another mask: 1e-1)
        assert max(abs(a - b) for a, b in zip(got["losses"], got["ref_losses"])) < 1e-13, (rank, got)
        assert got["param_err"] < 1e-13
    assert results[0][case]["state_as_one_device"] == [True, True, True]  # rank 0 advances as one device


def test_per_rank_seeds_draw_from_rank0_and_keep_the_others_streams(results):
    assert results[1]["per_rank_seed"]["kept"] == [True, True, True]  # rank 1's own generator untouched
    assert results[1]["per_rank_seed"]["adopted"] == 3 and results[0]["same_seed"]["adopted"] == 0
    assert results[1]["same_seed"]["state_as_one_device"] == [True, True, True]


def test_pipeline_recompute_replays_the_forward_draws(results):
    for r in results:
        assert r["pp_always"]["losses"] == r["pp_never"]["losses"]
        assert r["pp_always"]["params"] == r["pp_never"]["params"]
