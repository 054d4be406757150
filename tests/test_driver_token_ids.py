"""Token ids out of an embedding's table are refused on every call, before the program
runs: one device raises IndexError; a vocab-sharded table would mask the id out (a zero
row, a silently different loss)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from gloo_launch import run_processes
from spmd_compiler.testing import SimulatedTraining, fake_mesh

VOCAB = 10


class LM(nn.Module):
    def __init__(self, shifted: bool = True) -> None:
        super().__init__()
        self.shifted = shifted
        self.emb = nn.Embedding(VOCAB, 4)
        self.head = nn.Linear(4, VOCAB)

    def forward(self, ids):
        return self.head(self.emb(ids[:, :-1] if self.shifted else ids).mean(1))


def lm_step(model, optimizer, ids):
    loss = nn.functional.cross_entropy(model(ids), ids[:, -1])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _ids(seed: int, bad: int | None = None) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(seed))
    if bad is not None:
        ids[1, 3] = bad
    return ids


VOCAB_SHARDED = sc.Plan(params={"emb.weight": [sc.Shard(0)]}, default_input=[sc.Replicate()])  # a masked embedding


def _assert_message(err: BaseException, bad: int, shifted: bool) -> None:
    msg = str(err)
    where = "index [1, 3] of the ids the embedding reads" if shifted else "batch[0][1, 3]"
    assert f"(e.g. {bad} at {where})" in msg, msg  # the bad id and its position
    assert "the Embedding 'emb' (table emb.weight with 10 rows)" in msg, msg  # the embedding, the vocab size
    assert "expected every id in [0, 10)" in msg and "fix: keep the ids below num_embeddings=10" in msg, msg
    assert "test_driver_token_ids.py" in msg, msg  # the user's line


@pytest.mark.parametrize("shifted", [True, False], ids=["computed_ids", "batch_ids"])
@pytest.mark.parametrize("bad", [VOCAB, -1])
def test_a_later_bad_id_is_refused_before_the_program_runs(bad, shifted):
    """The compiled step on a vocab-sharded table: the program compiled for a good batch
    is cached, a later batch holds an id == vocab or -1: ValueError, nothing ran."""
    model = LM(shifted)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(IndexError):  # what one device does
        lm_step(copy.deepcopy(model), torch.optim.SGD(model.parameters(), lr=0.1), _ids(1, bad))
    step = sc.compile(lm_step, mesh=fake_mesh((4,), ("tp",)), plan=VOCAB_SHARDED)
    step(model, opt, _ids(0))
    before = [p.to_local().clone() for p in model.parameters()]
    with pytest.raises(ValueError) as info:
        step(model, opt, _ids(1, bad))
    _assert_message(info.value, bad, shifted)
    assert step.compiles == 1
    assert all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters()))  # nothing ran
    step(model, opt, _ids(2))  # a good batch runs the cached program again
    assert step.compiles == 1 and step.calls == 3


@pytest.mark.parametrize("bad", [VOCAB, -1])
def test_simulated_training_refuses_a_later_bad_id_and_matches_one_device(bad):
    """SimulatedTraining: the same ValueError (not torch's IndexError, nor a zero row), and
    the good batches around it train exactly as on one device."""
    torch.manual_seed(0)
    model = LM().double()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    sim = SimulatedTraining(lm_step, model, torch.optim.SGD(model.parameters(), lr=0.1), fake_mesh((4,), ("tp",)), VOCAB_SHARDED)
    losses = [sim.step(_ids(0))]
    with pytest.raises(ValueError) as info:
        sim.step(_ids(1, bad))
    _assert_message(info.value, bad, shifted=True)
    losses.append(sim.step(_ids(2)))
    want = [lm_step(ref, ref_opt, _ids(0)), lm_step(ref, ref_opt, _ids(2))]
    assert sim.compiles == 1
    torch.testing.assert_close(torch.stack(losses), torch.stack(want), atol=1e-12, rtol=0)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-12, rtol=0)


def _one_rank_bad(rank: int, world: int, dynamic: bool) -> dict:
    """Data parallel on 2 gloo ranks (the table whole on each): rank 1's shard of the
    third batch holds id 10. Both ranks must raise (rank 1 alone raising would leave
    rank 0 waiting in the step's first collective), then train on. ``dynamic``: the
    sizes ride in the step check (driver/sizes.py)."""
    torch.manual_seed(0)
    model = LM().double()
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    step = sc.compile(lm_step, mesh=(world,), timeout=60, dynamic=dynamic)
    out: dict = {"errors": []}
    for seed in range(4):
        ids = _ids(seed)
        if seed == 2:
            ids[3, 2] = VOCAB  # in rank 1's shard (rows 2-3); rank 0's is good
        try:
            step(model, opt, ids.chunk(world)[rank])
        except ValueError as e:
            out["errors"].append(str(e))
            continue
        lm_step(ref, ref_opt, ids)
    out["diff"] = max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    out["compiles"], out["checks"] = step.compiles, dict(step.checks)
    return out


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_bad_id_on_one_gloo_rank_stops_every_rank(dynamic):
    results = run_processes(_one_rank_bad, 2, dynamic, timeout=240)
    for rank, res in enumerate(results):
        assert len(res["errors"]) == 1, res
        assert res["diff"] < 1e-12 and res["compiles"] == 1, res
        assert sum(n for k, n in res["checks"].items() if k.startswith("resync")) == 1, res  # through the step check
    assert "(e.g. 10 at index [1, 2] of the ids the embedding reads" in results[1]["errors"][0], results[1]
    assert results[0]["errors"][0].startswith("the batch of rank 1 (every rank stops here, this is rank 0"), results[0]
    assert "token ids out of range for the Embedding 'emb'" in results[0]["errors"][0], results[0]


def test_every_rank_names_the_ranks_whose_batch_holds_a_bad_id():
    """What the ranks without a bad id raise, from every rank's gathered message."""
    from spmd_compiler.driver.token_ids import ranks_ids_error

    assert ranks_ids_error([None, None, None, None]) is None
    err = ranks_ids_error([None, "token ids out of range for A", None, "token ids out of range for B"])
    assert isinstance(err, ValueError)
    assert str(err) == ("the batch of ranks 1, 3 (every rank stops here, this is rank 0; nothing ran): "
                        "rank 1's error: token ids out of range for A"), str(err)
