"""Ranks that must share batch values (Replicate on a mesh axis) are checked every step
(spmd_compiler/driver/batch_digest.py): the digest's encoding, exactly; real gloo runs
where tp peers pass different rows raise on every rank, before anything changed, through
the folded check, the standalone one and the first call's exchange."""

from __future__ import annotations

import copy
import pytest
import torch
from torch.distributed.tensor import Replicate

import spmd_compiler as sc
from gloo_launch import run_processes
from spmd_compiler.driver.batch_digest import (
    NONE, combine, digest_agrees, digest_bits, encode, leaf_digest, slots_agree, standalone_slots, values_error,
)
from spmd_compiler.testing.models import GPT, MLP, gpt_tp_plan, megatron_mlp_plan, train_step
from spmd_compiler.testing.models import accumulating_mse_step as accumulating_step
from spmd_compiler.testing.models import mse_train_step as mse_step


# ---------------------------------------------------------------- the encoding, exactly


@pytest.mark.parametrize("n", range(2, 9))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_sum_encoding_reads_all_equal_exactly(n, dtype):
    """n * sum(d*d) == sum(d)**2 iff every d is equal, with every partial sum exact in the
    payload's dtype (summed there in rank order, as a ring or tree would in any order:
    the values are integers below 2**mantissa, so any order is exact)."""
    bits = digest_bits(dtype, "all_reduce", "sum", n)
    assert bits == ((11 if n <= 4 else 10) if dtype == torch.float32 else 24)
    top = (1 << bits) - 1
    limit = 2 ** 24 if dtype == torch.float32 else 2 ** 53
    assert n * top * top < limit  # the largest partial sum is exact
    g = torch.Generator().manual_seed(n)
    cases = [[top] * n, [0] * n, [top] * (n - 1) + [top - 1], [0] * (n - 1) + [1], [1] + [0] * (n - 1)]
    cases += [torch.randint(0, top + 1, (n,), generator=g).tolist() for _ in range(200)]
    cases += [[v] * n for v in torch.randint(0, top + 1, (50,), generator=g).tolist()]
    for ds in cases:
        rows = torch.tensor([encode(d, "all_reduce", "sum", bits) for d in ds], dtype=dtype)
        total = rows.sum(0)
        assert total.tolist() == [sum(ds), sum(d * d for d in ds)]  # exact
        assert digest_agrees([total.tolist()], "all_reduce", "sum", n, bits) == (len(set(ds)) == 1), ds


@pytest.mark.parametrize("n", [2, 3, 8])
def test_max_avg_and_gather_encodings(n):
    for op in ("max", "avg"):
        bits = digest_bits(torch.float32, "all_reduce", op, n)
        top = (1 << bits) - 1
        for ds in [[5] * n, [5] * (n - 1) + [6], [0] + [top] * (n - 1), [top] * n]:
            rows = torch.tensor([encode(d, "all_reduce", op, bits) for d in ds], dtype=torch.float32)
            out = rows.max(0).values if op == "max" else rows.sum(0) / n
            assert digest_agrees([out.tolist()], "all_reduce", op, n, bits) == (len(set(ds)) == 1), (op, ds)
    bits = digest_bits(torch.float32, "all_gather", "", n)
    assert digest_agrees([[3]] * n, "all_gather", "", n, bits)
    assert not digest_agrees([[3]] * (n - 1) + [[4]], "all_gather", "", n, bits)
    assert digest_bits(torch.bfloat16, "all_reduce", "sum", 2) == 0  # too few bits: no digest


def test_leaf_digest_sees_values_bits_and_row_order():
    ids = torch.randint(0, 1000, (8, 64), generator=torch.Generator().manual_seed(0))
    assert leaf_digest(ids) == leaf_digest(ids.clone())
    other = ids.clone()
    other[3, 5] += 1
    assert leaf_digest(other) != leaf_digest(ids)
    assert leaf_digest(ids[[1, 0, *range(2, 8)]]) != leaf_digest(ids)  # two rows swapped
    x = torch.zeros(4, 3)
    assert leaf_digest(x) != leaf_digest(-x)  # -0.0: another bit pattern
    assert leaf_digest(x) != leaf_digest(torch.zeros(3, 4))  # the same values, other rows
    assert combine([ids, x]) != combine([x, ids])
    assert leaf_digest(torch.tensor(True)) != leaf_digest(torch.tensor(False))
    assert leaf_digest(ids.T) == leaf_digest(ids.T.contiguous())  # strides do not matter


def test_standalone_slots_under_max():
    """The MAX of every rank's slots agrees iff each tp group's ranks sent the same digest
    (a 2 x 2 mesh: dp groups may differ)."""
    shape = (2, 2)
    a, b = torch.arange(6).view(2, 3), torch.arange(6).view(2, 3) + 1
    axes = {1: [0]}

    def reduced(batches):
        slots = [standalone_slots(axes, [batches[r]], divmod(r, 2), shape) for r in range(4)]
        assert all(NONE not in (s[i], s[i + 1]) or s[i] == s[i + 1] == NONE for s in slots for i in range(0, 4, 2))
        return [max(col) for col in zip(*slots)]

    assert slots_agree(reduced([a, a, b, b]))  # dp peers differ: fine
    assert not slots_agree(reduced([a, a, a, b]))  # tp peers (2, 3) differ


def test_values_error_names_the_axis_the_tensor_and_the_fix():
    sent = [((d, t), {1: [("batch[0]", (4, 3), 10 * d + (t if d == 1 else 0))]}) for d in range(2) for t in range(2)]
    e = values_error(sent, ["dp", "tp"])
    assert isinstance(e, ValueError)
    text = str(e)
    assert "(1, 0) and (1, 1)" in text and "batch[0]" in text and "'tp'" in text and "Replicate" in text, text
    assert "mesh['dp'].get_local_rank()" in text and "fix:" in text, text
    same = [((d, t), {1: [("batch[0]", (4, 3), d)]}) for d in range(2) for t in range(2)]
    assert values_error(same, ["dp", "tp"]) is None
    shapes = [((0, t), {1: [("batch[0]", (4 - t, 3), t)]}) for t in range(2)]
    assert values_error(shapes, ["dp", "tp"]) is None  # a shape difference: the shape check's error


# ---------------------------------------------------------------- real gloo runs


def _rows(i: int, n: int = 8):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(n, 16, dtype=torch.float64, generator=g), torch.randn(n, 16, dtype=torch.float64, generator=g)


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type and text are what the test reads
        return f"{type(e).__name__}: {e}"
    return "no error"


def _params(model) -> list[torch.Tensor]:
    return [p.full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]


def _run(step, model, opt, ref, ref_opt, calls, take) -> dict:
    """``calls``: per call, whether some ranks' rows differ from their peers';
    ``take(x, y, differs)``: this rank's rows of the global batch. The one-device copy
    steps only on the calls that agree, on the global batch."""
    out = {"errors": [], "error": 0.0, "unchanged": True}
    for i, differs in enumerate(calls):
        x, y = _rows(i)
        if differs:
            before = _params(model)
            out["errors"].append(_error(lambda: step(model, opt, *take(x, y, True))))
            out["unchanged"] &= all(torch.equal(a, b) for a, b in zip(before, _params(model)))
        else:
            loss = step(model, opt, *take(x, y, False))
            out["error"] = max(out["error"], abs(loss.item() - mse_step(ref, ref_opt, x, y).item()))
    out["error"] = max(out["error"], *(abs(a - b).max().item() for a, b in zip(_params(model), ref.parameters())))
    out["checks"] = dict(step.checks)
    return out


def _digests(step) -> list:
    point = getattr(step.last, "fold_point", None)
    return [(p.bits, len(p.digest)) for p in getattr(point, "points", [point] if point else [])]


def _pair():
    torch.manual_seed(0)
    model = MLP().double()
    ref = copy.deepcopy(model)
    return model, ref, *(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))


def _pure_tp(rank: int, world: int) -> dict:
    """The MLP split over tp = 2, the batch Replicate: rank 1's rows differ on the first
    call (the exchange) and on the fourth (the step check), folded or standalone. Then a
    GPT with int64 ids (the fold is a float32 sum: 11 bits)."""
    plan = sc.Plan(params=megatron_mlp_plan().params, default_input=[Replicate()])
    out = {}
    for fold in (True, False):
        model, ref, opt, ref_opt = _pair()
        step = sc.compile(mse_step, mesh={"tp": 2}, plan=plan)
        step.fold_guard = fold
        calls = [True, False, False, True, False]
        out[fold] = _run(step, model, opt, ref, ref_opt, calls, lambda x, y, differs: _rows(99) if differs and rank == 1 else (x, y))
        out[fold]["digest"] = _digests(step)
        # rank 1's shape changes (it raises the flag, sending no digest): the shape check's error, no hang
        out[fold]["shape"] = _error(lambda: step(model, opt, *_rows(7, 8 if rank == 0 else 6)))
    torch.manual_seed(0)
    gpt = GPT(vocab=32, seq=8, dim=16, heads=2, layers=1)
    opt = torch.optim.AdamW(gpt.parameters(), lr=0.01)
    step = sc.compile(train_step, mesh={"tp": 2}, plan=gpt_tp_plan())
    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        step(gpt, opt, ids, ids)
    other = ids.clone()
    other[2, 3] = (other[2, 3] + rank) % 32  # rank 1: one token differs
    out["gpt"] = _error(lambda: step(gpt, opt, other, other))
    point = step.last.fold_point
    out["gpt_bits"] = point.bits
    return out


def _dp_tp(rank: int, world: int) -> dict:
    """dp x tp = 2 x 2 (rank = 2 * dp + tp), the MLP split over tp, the batch Shard(0) on
    dp and Replicate on tp: dp peers pass different rows (normal, trains as one device);
    on the third call rank 3 passes other rows than its tp peer 2 (same shape)."""
    dp = rank // 2

    def take(x, y, differs):
        if differs and rank == 3:
            x, y = _rows(99)
        return x[4 * dp: 4 * dp + 4], y[4 * dp: 4 * dp + 4]

    out = {}
    for fold in (True, False):
        model, ref, opt, ref_opt = _pair()
        step = sc.compile(mse_step, mesh={"dp": 2, "tp": 2}, plan=megatron_mlp_plan(ndim=2, axis=1))
        step.fold_guard = fold
        out[fold] = _run(step, model, opt, ref, ref_opt, [False, False, True, False], take)
        out[fold]["digest"] = _digests(step)
    return out


@pytest.fixture(scope="module")
def pure_tp():
    return run_processes(_pure_tp, 2, timeout=180)


@pytest.mark.gloo
@pytest.mark.parametrize("fold", [True, False], ids=["folded", "standalone"])
def test_tp_peers_with_different_rows_raise_on_every_rank(pure_tp, fold):
    """The first call (the exchange before the compile) and the fourth (the step check:
    folded into the first tp all_reduce, or the standalone MAX) raise the same ValueError
    on both ranks, with the parameters untouched; the calls with equal rows train as one
    device, before and after."""
    for r in pure_tp:
        got = r[fold]
        assert got["error"] < 1e-10, got
        assert got["unchanged"], got
        assert len(got["errors"]) == 2, got
        for text in got["errors"]:
            assert text.startswith("ValueError") and "'tp'" in text and "batch[0], batch[1]" in text, text
            assert "Replicate" in text and "fix:" in text, text
        path = "folded" if fold else "standalone"
        assert got["checks"].get(f"resync ({path})") == 1, got  # the differing rows (the optimizer state exists before the trace)
        assert got["digest"] == ([(24, 2)] if fold else []), got  # a float64 sum: 24 bits, x and y
        assert got["shape"].startswith("ValueError") and "has size" in got["shape"] and "different values" not in got["shape"], got
    assert pure_tp[0][fold]["errors"] == pure_tp[1][fold]["errors"]


@pytest.mark.gloo
def test_tp_peers_with_different_token_ids_raise(pure_tp):
    """A GPT on int64 ids: one token differs on rank 1; the fold is a float32 sum (11 bits)."""
    for r in pure_tp:
        assert r["gpt_bits"] == 11, r
        assert r["gpt"].startswith("ValueError") and "'tp'" in r["gpt"], r["gpt"]


@pytest.mark.gloo
def test_dp_x_tp_tp_peers_must_agree_dp_peers_need_not():
    """Folded (a FoldChain: only the tp fold carries the digest) and standalone (the MAX's
    slot pair per tp group)."""
    results = run_processes(_dp_tp, 4, timeout=180)
    for fold in (True, False):
        for r in (r[fold] for r in results):
            assert r["error"] < 1e-10, r  # dp peers' different rows: the normal case, as one device
            assert r["unchanged"] and len(r["errors"]) == 1, r
            text = r["errors"][0]
            assert text.startswith("ValueError") and "(1, 0) and (1, 1)" in text and "mesh['dp'].get_local_rank()" in text, text
            assert sorted(r["digest"]) == ([(0, 0), (24, 2)] if fold else []), r  # only the tp fold carries it
            assert r["checks"].get("resync (folded)" if fold else "resync (standalone)") == 1, r  # the differing rows
        assert len({r[fold]["errors"][0] for r in results}) == 1


def _tp_more(rank: int, world: int) -> dict:
    """Pure TP = 2: gradient accumulation switches programs every window through the fold
    (the digest rides along: no extra resync), and backend="inductor" runs the digest as
    a host node before the compiled segment's collective."""
    plan = sc.Plan(params=megatron_mlp_plan().params, default_input=[Replicate()])
    model, _, opt, _ = _pair()
    step = sc.compile(accumulating_step, mesh={"tp": 2}, plan=plan)
    out = {}
    for i in range(8):
        if i == 4:
            warm = dict(step.checks)
        step(model, opt, *_rows(i), i % 2 == 1)
    out["window_checks"] = {k: v - warm.get(k, 0) for k, v in step.checks.items() if v != warm.get(k, 0)}
    out["accumulating"] = _error(lambda: step(model, opt, *_rows(99 if rank else 98), False))
    model, ref, opt, ref_opt = _pair()
    step = sc.compile(mse_step, mesh={"tp": 2}, plan=plan, backend="inductor")
    out["inductor"] = _run(step, model, opt, ref, ref_opt, [False, False, False, True, False],
                           lambda x, y, differs: _rows(99) if differs and rank == 1 else (x, y))
    out["inductor"]["digest"] = _digests(step)
    return out


@pytest.mark.gloo
def test_accumulation_switches_and_inductor_carry_the_digest():
    for r in run_processes(_tp_more, 2, timeout=300):
        assert r["window_checks"] == {"folded": 4, "switched (folded)": 4}, r  # every call switches, none resyncs
        assert r["accumulating"].startswith("ValueError") and "'tp'" in r["accumulating"], r
        got = r["inductor"]
        assert got["error"] < 1e-10 and got["unchanged"] and got["digest"] == [(24, 2)], got
        assert len(got["errors"]) == 1 and got["errors"][0].startswith("ValueError"), got
