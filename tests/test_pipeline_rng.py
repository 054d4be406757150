"""Randomness in a pipeline (docs/randomness.md, "Pipelines"), on real gloo processes:
pp2 x tp2, Megatron-TP MLP with dropout on a sharded and on a replicated activation.

- Every rank seeded differently (``torch.manual_seed(100 + rank)``): the tp ranks of a
  stage must still draw one mask for the replicated activation, else the parameters the
  plan calls Replicate (``l2.bias``, ``l3``) part ways between the two replicas.
- The stage's first rank advances its generator; the other ranks' generators are put
  back after each step (their own streams are untouched).
- Every rank seeded alike: no broadcast, and the run is reproducible (two runs equal).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate

import spmd_compiler as sc
from gloo_launch import run_processes
from spmd_compiler.testing.models import megatron_mlp_plan, mse_train_step

from test_runtime_rng import DropMLP, _batches

pytestmark = pytest.mark.gloo


def _run(rank: int, seed: int) -> dict:
    torch.manual_seed(0)
    model = DropMLP().double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = sc.Plan(params=megatron_mlp_plan().params, default_input=[sc.Replicate()])
    step = sc.compile(mse_train_step, mesh={"pp": 2, "tp": 2}, plan=plan,
                      pipeline=sc.Pipeline(chunks=2, schedule="1F1B"))
    torch.manual_seed(seed)
    losses, kept = [], []
    for x, y in _batches():
        before = torch.get_rng_state()
        losses.append(step(model, opt, x, y).item())
        kept.append(torch.equal(before, torch.get_rng_state()))
    replicated = {name: p.to_local().tolist() for name, p in model.named_parameters()
                  if p is not None and all(isinstance(pl, Replicate) for pl in p.placements)}
    return {"losses": losses, "replicated": replicated, "kept": kept,
            "adopted": getattr(getattr(step.last.pipeline, "rng_sync", None), "adopted", None)}


def _cases(rank: int, world: int) -> dict:
    return {"per_rank": _run(rank, 100 + rank), "same": _run(rank, 100), "same_again": _run(rank, 100)}


@pytest.fixture(scope="module")
def results():
    return run_processes(_cases, 4, timeout=300)


@pytest.mark.parametrize("case", ["per_rank", "same"])
def test_tp_replicas_of_a_stage_draw_one_mask(results, case):
    for a, b in ((0, 1), (2, 3)):  # the tp ranks of stage 0, of stage 1
        ra, rb = results[a][case]["replicated"], results[b][case]["replicated"]
        assert ra and set(ra) == set(rb), (a, sorted(ra), sorted(rb))
        for name in ra:
            assert ra[name] == rb[name], f"{case}: replicated {name} differs between ranks {a} and {b}"
    assert len({tuple(r[case]["losses"]) for r in results}) == 1


def test_stage_first_rank_draws_others_keep_their_streams(results):
    assert [r["per_rank"]["adopted"] for r in results] == [3, 3, 3, 3]
    assert [r["same"]["adopted"] for r in results] == [0, 0, 0, 0]
    for rank in (1, 3):  # not a stage's first rank: its generator is put back
        assert results[rank]["per_rank"]["kept"] == [True, True, True]
    for rank in (0, 2):  # the stage's first rank draws, so its generator moves
        assert results[rank]["per_rank"]["kept"] == [False, False, False]


def test_same_seed_is_reproducible(results):
    for r in results:
        assert r["same"] == r["same_again"]
