"""Rank agreement: every collective's op, group, reduce op and sizes are part of the
fingerprint, so one rank changing any of them is a RankMismatchError, never a hang."""

from __future__ import annotations

import copy

import pytest
import torch

import spmd_compiler as sc
from spmd_compiler.errors import RankMismatchError
from spmd_compiler.driver.agreement import compare_fingerprints, fingerprint
from spmd_compiler.testing.mesh import fake_mesh
from spmd_compiler.testing.models import GPT, gpt_2d_plan, gpt_fsdp_plan, train_step

c10d = torch.ops._c10d_functional


@pytest.fixture(scope="module")
def steps():
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 32, (4, 8))
    traced = sc.trace(train_step, model, opt, ids, ids)
    two_d = sc.expand(traced, fake_mesh((2, 2), ("dp", "tp")), gpt_2d_plan())
    fsdp = sc.expand(traced, fake_mesh((4,), ("dp",)), gpt_fsdp_plan())  # gathers and reduce_scatters
    return {"2d": two_d, "fsdp": fsdp}


def _groups(step):
    return dict(zip(step.mctx.group_names, step.mctx.axis_names))


def _first(gm, target):
    return next(n for n in gm.graph.nodes if n.target is target)


def _reduce_op(gm, step):
    n = _first(gm, c10d.all_reduce.default)
    n.args = (n.args[0], "avg" if n.args[1] != "avg" else "sum", n.args[2])


def _group(gm, step):
    n = _first(gm, c10d.all_reduce.default)
    other = next(g for g in step.mctx.group_names if g != n.args[2])
    n.args = (*n.args[:2], other)


def _op(gm, step):
    n = _first(gm, c10d.all_reduce.default)
    n.target = c10d.reduce_scatter_tensor.default


def _size(gm, step):
    n = next(n for n in gm.graph.nodes if n.target in (c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default))
    i = 1 if n.target is c10d.all_gather_into_tensor.default else 2
    n.args = (*n.args[:i], n.args[i] * 2, *n.args[i + 1 :])


@pytest.mark.parametrize("mutate,which", [(_reduce_op, "2d"), (_group, "2d"), (_op, "2d"), (_size, "fsdp"), (_reduce_op, "fsdp")],
                         ids=["reduce-op", "group", "op", "size", "reduce-op-fsdp"])
@pytest.mark.parametrize("with_sizes", [True, False], ids=["even", "uneven"])
def test_a_changed_collective_on_one_rank_is_a_mismatch(steps, mutate, which, with_sizes):
    step_2d = steps[which]
    collectives = [n for n in step_2d.gm.graph.nodes if getattr(n.target, "namespace", "") == "_c10d_functional"]
    assert len(collectives) > 4
    clean = fingerprint(step_2d.gm, _groups(step_2d), with_sizes=with_sizes)
    gm = copy.deepcopy(step_2d.gm)
    mutate(gm, step_2d)
    changed = fingerprint(gm, _groups(step_2d), with_sizes=with_sizes)
    compare_fingerprints([clean, clean])  # same programs agree
    with pytest.raises(RankMismatchError, match="first difference at node") as info:
        compare_fingerprints([clean, changed], rank=1)
    rank0, rank1 = str(info.value).split("rank 0 has ")[1].split(", rank 1 has ")
    assert rank0 != rank1.split(". fix:")[0]  # the two ranks' nodes read differently


def test_a_difference_past_the_shown_text_is_shown_in_full(steps, monkeypatch):
    """A scalar far into a long node (past the 160 characters each fingerprint shows):
    the error exchanges that node's whole text and shows both versions."""
    from spmd_compiler.driver import agreement

    step = steps["2d"]
    gm_b = copy.deepcopy(step.gm)
    node = next(n for n in gm_b.graph.nodes if n.op == "call_function" and len(str(n.args)) > 10)
    node.args = (*node.args, "x" * 200 + "rank-b-only")  # a long argument, different on "rank 1"
    gm_a = copy.deepcopy(step.gm)
    node_a = next(n for n in gm_a.graph.nodes if n.name == node.name)
    node_a.args = (*node_a.args, "x" * 200 + "rank-a-only")
    fps = [fingerprint(g, _groups(step)) for g in (gm_a, gm_b)]
    i = next(k for k, (a, b) in enumerate(zip(*fps)) if a[1] != b[1])
    assert fps[0][i][0] == fps[1][i][0]  # the shown texts agree: the difference is past the cut
    calls = iter([[("ok", fps[0]), ("ok", fps[1])], [agreement._node_text(gm_a, i, _groups(step), True), agreement._node_text(gm_b, i, _groups(step), True)]])
    monkeypatch.setattr(agreement, "exchange", lambda payload, group=None: next(calls))
    with pytest.raises(RankMismatchError) as info:
        agreement.check_agreement(gm_a, _groups(step), with_sizes=True, error=None)
    text = str(info.value)
    assert "rank-a-only" in text and "rank-b-only" in text and "past the part shown" in text, text


# ---------------------------------------------------------------- which ranks the message names

_A = [("%x = add(a, b)", "d-add"), ("%y = mul(x, 2)", "d-mul2")]
_B = [("%x = add(a, b)", "d-add"), ("%y = mul(x, 3)", "d-mul3")]
_SHORT = [("%x = add(a, b)", "d-add")]


@pytest.mark.parametrize("everyone,named,reference,holds", [
    ([_A, _A, _A, _B], "rank 3 compiled a different graph", "than ranks 0, 1, 2", "ranks 0, 1, 2 have %y = mul(x, 2), rank 3 has %y = mul(x, 3)"),
    ([_B, _A, _A, _A], "rank 0 compiled a different graph", "than ranks 1, 2, 3", "ranks 1, 2, 3 have %y = mul(x, 2), rank 0 has %y = mul(x, 3)"),
    ([_A, _B, _A, _B], "the ranks compiled 2 different graphs, none held by most ranks:", "ranks 0, 2 / ranks 1, 3", "ranks 0, 2 have %y = mul(x, 2), ranks 1, 3 have %y = mul(x, 3)"),
    ([_A, _A, _SHORT, _B], "ranks 2, 3 compiled different graphs", "than ranks 0, 1",
     "ranks 0, 1 have %y = mul(x, 2), rank 2 has no node 1 (a graph of 1 nodes), rank 3 has %y = mul(x, 3)"),
    ([_A, _B], "the ranks compiled 2 different graphs, none held by most ranks:", "rank 0 / rank 1", "rank 0 has %y = mul(x, 2), rank 1 has %y = mul(x, 3)"),
], ids=["rank3", "rank0", "half", "three-graphs", "two-ranks"])
def test_the_message_names_the_ranks_that_differ_from_the_others(everyone, named, reference, holds):
    """Gathered fingerprints of 4 ranks: the ranks named are those outside the most
    common graph (never the first rank after rank 0), with what each group holds; on a
    tie (2 ranks, or 2 against 2) no group is named the odd one out."""
    with pytest.raises(RankMismatchError) as info:
        compare_fingerprints(everyone, rank=2)
    msg = str(info.value)
    assert msg.startswith(f"{named} {reference} (this is rank 2); first difference at node 1: {holds}. fix:"), msg


def test_a_difference_past_the_cut_on_4_ranks_names_rank_3(monkeypatch):
    """The whole node's text, exchanged, is shown per group of ranks."""
    from spmd_compiler.driver import agreement

    fps = [[("%y = f(x, ...)", "d-same")] for _ in range(3)] + [[("%y = f(x, ...)", "d-other")]]
    texts = ["%y = (x, 'long-a')"] * 3 + ["%y = (x, 'long-b')"]
    calls = iter([[("ok", fp) for fp in fps], texts])
    monkeypatch.setattr(agreement, "exchange", lambda payload, group=None: next(calls))
    monkeypatch.setattr(agreement, "fingerprint", lambda gm, groups, with_sizes: fps[0])
    monkeypatch.setattr(agreement, "_node_text", lambda gm, i, groups, with_sizes: texts[0])
    with pytest.raises(RankMismatchError) as info:
        agreement.check_agreement(object(), {}, with_sizes=True, error=None)
    msg = str(info.value)
    assert msg.startswith("rank 3 compiled a different graph than ranks 0, 1, 2"), msg
    assert msg.endswith("node 0 in full: ranks 0, 1, 2 have %y = (x, 'long-a'), rank 3 has %y = (x, 'long-b')"), msg


def test_every_rank_that_failed_to_compile_is_named(monkeypatch):
    from spmd_compiler.driver import agreement

    ok = ("ok", _A)
    monkeypatch.setattr(agreement, "exchange", lambda payload, group=None: [ok, ("error", "ValueError: bad\nmore"), ok, ("error", "TypeError: x")])
    monkeypatch.setattr(agreement, "fingerprint", lambda gm, groups, with_sizes: _A)
    with pytest.raises(RankMismatchError, match=r"^ranks 1, 3 failed to compile the step \(rank 1: ValueError: bad\)"):
        agreement.check_agreement(object(), {}, with_sizes=True, error=None)


def test_an_input_dtype_that_differs_on_one_rank_is_named():
    """A rank called with a float32 batch where the others pass float64: the first
    difference is the input itself, and the message says dtype (it used to point at a
    _to_copy deep in the graph)."""
    from spmd_compiler.testing.models import MLP, mse_train_step

    mesh = fake_mesh((2,), ("dp",))
    try:
        programs = []
        for dtype in (torch.float64, torch.float32):
            model = MLP(4, 8).double()
            x = torch.randn(4, 4, dtype=dtype)
            step = sc.expand(sc.trace(mse_train_step, model, torch.optim.SGD(model.parameters(), lr=0.1), x, x), mesh)
            programs.append(fingerprint(step.gm, _groups(step)))
    finally:
        torch.distributed.destroy_process_group()
    with pytest.raises(RankMismatchError, match=r"in_batch_0 .*dtype=torch\.float64.*rank 1 has %in_batch_0 .*dtype=torch\.float32.*fix: .*dtypes"):
        compare_fingerprints(programs, rank=1)
