"""Pipeline schedules and stage assignment, checked without processes."""

from __future__ import annotations

import pytest
import torch

import spmd_compiler as sc
from spmd_compiler.pipeline import assign_stages, build_schedule, format_schedule, split_program, validate
from spmd_compiler.pipeline.balance import partition_costs
from spmd_compiler.pipeline.schedule import Action
from spmd_compiler.testing.models import GPT, SkipNet, mse_train_step, train_step


def test_gpipe_order():
    order = build_schedule("GPipe", 2, 3)
    assert format_schedule(order) == "rank 0: 0F0 0F1 0F2 0B0 0B1 0B2\nrank 1: 1F0 1F1 1F2 1B0 1B1 1B2"


def test_1f1b_order_limits_live_microbatches():
    order = build_schedule("1F1B", 4, 8)
    assert [str(a) for a in order[0][:5]] == ["0F0", "0F1", "0F2", "0F3", "0B0"]  # p - 1 warm-up forwards
    assert [str(a) for a in order[3][:4]] == ["3F0", "3B0", "3F1", "3B1"]  # last stage: one forward, one backward
    for r, row in order.items():  # at most p - r micro-batches in flight on rank r
        live, peak = 0, 0
        for a in row:
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
        assert peak == min(4 - r, 8)


def test_1f1b_order_on_four_stages():
    """Written out by hand: rank r warms up with 3 - r forwards, alternates one forward and
    one backward, then drains the backwards oldest first."""
    assert format_schedule(build_schedule("1F1B", 4, 4)) == "\n".join([
        "rank 0: 0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3",
        "rank 1: 1F0 1F1 1F2 1B0 1F3 1B1 1B2 1B3",
        "rank 2: 2F0 2F1 2B0 2F2 2B1 2F3 2B2 2B3",
        "rank 3: 3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3",
    ])


def test_interleaved_uses_torch_order_and_validates():
    order = build_schedule("Interleaved1F1B", 2, 4, stages_per_rank=2)
    assert {a.stage for a in order[0]} == {0, 2} and {a.stage for a in order[1]} == {1, 3}
    assert order[0][0] == Action(0, "F", 0)


def test_schedule_errors():
    with pytest.raises(ValueError, match="needs at least as many micro-batches as pipeline ranks"):
        build_schedule("Interleaved1F1B", 4, 2, stages_per_rank=2)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        build_schedule("ZeroBubble", 2, 2)
    with pytest.raises(ValueError, match="runs one stage per rank"):
        build_schedule("1F1B", 2, 2, stages_per_rank=2)
    bad = {0: [Action(0, "B", 0), Action(0, "F", 0)], 1: []}
    with pytest.raises(ValueError, match="before its forward"):
        validate(bad, 2, 1)


def test_backward_nodes_belong_to_the_stage_they_differentiate():
    """Every backward node carries the autograd sequence number of the forward op it
    differentiates; stage 1's weights get their gradients computed on stage 1."""
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 32, (4, 8))
    traced = sc.trace(train_step, model, opt, ids, ids, split_points={"blocks.1": sc.SplitPoint.BEGINNING})
    a = assign_stages(traced.gm, traced.outputs)
    assert a.num_stages == 2
    fwd_seq = {n.meta["seq_nr"]: a.of(n.name) for n in traced.gm.graph.nodes if n.meta.get("spmd_phase") == "forward" and n.op == "call_function"}
    bwd = [n for n in traced.gm.graph.nodes if n.meta.get("spmd_phase") == "backward" and n.op == "call_function"]
    matched = [n for n in bwd if n.meta.get("seq_nr") in fwd_seq]
    assert len(matched) > 0.8 * len(bwd)
    for n in matched:  # same stage as the forward op, or earlier (where the gradient flows next)
        assert min(a.of(n.name)) <= min(fwd_seq[n.meta["seq_nr"]])
    # parameters are owned by the stage that uses them, and updated there
    assert a.param_stages["blocks.0.fc.weight"] == (0,) and a.param_stages["blocks.1.fc.weight"] == (1,)
    assert a.param_stages["head.weight"] == (1,) and a.param_stages["tok.weight"] == (0,)
    upd = [n for n in traced.gm.graph.nodes if n.meta.get("spmd_phase") == "optimizer" and n.op == "call_function" and n.args and getattr(n.args[0], "name", "") == "p_blocks_1_fc_weight"]
    assert upd and all(a.of(n.name) == frozenset([1]) for n in upd)


def test_tied_parameter_is_owned_by_both_stages(mesh4):
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=2, tie_embeddings=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.randint(0, 32, (4, 8))
    traced = sc.trace(train_step, model, opt, ids, ids, split_points={"blocks.1": sc.SplitPoint.BEGINNING})
    a = assign_stages(traced.gm, traced.outputs)
    assert a.tied() == {"tok.weight": (0, 1)}


def test_only_boundary_values_cross_stages():
    model = SkipNet(8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    traced = sc.trace(mse_train_step, model, opt, x, x)
    a = assign_stages(traced.gm, traced.outputs)
    assert a.num_stages == 4
    from spmd_compiler.testing import fake_mesh

    program = split_program(sc.expand(traced, fake_mesh((4,), ("pp",))).gm, a)
    crossing = program.cross_stage()
    forward = {(t, s) for _, t, s, tk, k in crossing if tk == "F"}
    # activations 0->1, 1->2, 2->3, the skip connection 0->2, and no value back in forward
    assert {(0, 1), (1, 2), (2, 3), (0, 2)} <= forward and all(t < s for t, s in forward)
    backward = {(t, s) for _, t, s, tk, k in crossing if tk == "B"}
    assert backward and all(t > s for t, s in backward)


def test_balance_partition():
    assert partition_costs([1, 1, 1, 1], 2) == [0, 2]
    assert partition_costs([4, 1, 1, 1, 1], 2) == [0, 1]
    with pytest.raises(ValueError, match="cannot cut 2 layers into 3 stages"):
        partition_costs([1, 1], 3)


def test_text_timeline_and_bubbles():
    from spmd_compiler.pipeline.timeline import bubble_fractions, chrome_trace_events, format_timeline

    def span(kind, mb, start, end, stage=0):
        return {"rank": 0, "kind": kind, "stage": stage, "microbatch": mb, "start": start, "end": end, "detail": ""}

    # GPipe, 2 stages, 2 micro-batches of unit cost: each rank idles 2 of 6 slots
    r0 = [span("F", 0, 0, 1), span("F", 1, 1, 2), span("B", 0, 4, 5), span("B", 1, 5, 6)]
    r1 = [span("recv", 0, 0, 1, 1), span("F", 0, 1, 2, 1), span("F", 1, 2, 3, 1), span("B", 0, 3, 4, 1), span("B", 1, 4, 5, 1)]
    text = format_timeline([r0, r1], width=6)
    assert text.splitlines()[1].startswith("rank 0  |01  ab|")
    assert text.splitlines()[2].startswith("rank 1  |~01ab |")
    assert [round(b, 3) for b in bubble_fractions([r0, r1])] == [round(1 / 3, 3), round(1 / 3, 3)]
    events = chrome_trace_events([r0, r1])["traceEvents"]
    assert [e["name"] for e in events if e.get("pid") == 1 and e["ph"] == "X"][:2] == ["recv1 mb0", "F1 mb0"]
