"""Pipelined compiles on a fake process group (explain mode: compiled and dumped, not run)."""

from __future__ import annotations

import torch

import spmd_compiler as sc
from spmd_compiler.testing.mesh import fake_mesh
from spmd_compiler.testing.models import GPT, gpt_tp_plan, train_step

S = sc.SplitPoint.BEGINNING


def test_stage_dump_files(tmp_path, monkeypatch):
    monkeypatch.setenv("SPMD_COMPILER_EXPLAIN", "1")
    torch.manual_seed(0)
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=2, tie_embeddings=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    step = sc.compile(train_step, mesh=fake_mesh((2, 2), ["pp", "tp"]), plan=gpt_tp_plan(), dump_dir=str(tmp_path),
                      pipeline=sc.Pipeline(chunks=2, schedule="1F1B", split={"blocks.1": S}))
    ids = torch.randint(0, 32, (4, 8))
    loss = step(model, opt, ids, ids)
    assert loss.shape == ()
    folder = step.dumps[-1]
    names = {p.name for p in folder.iterdir()}
    assert {f"stage_{s}_{k}.py" for s in (0, 1) for k in "FBO"} <= names
    assert {"traced.py", "expanded.py", "comm_summary.txt", "report.html", "pipeline.txt"} <= names
    # stage 0's forward: embedding and block 0, annotated with tp placements and local shapes
    f0 = (folder / "stage_0_F.py").read_text()
    assert "pipeline stage 0_F" in f0 and "embedding" in f0 and "S(0)" in f0
    b1 = (folder / "stage_1_B.py").read_text()
    assert "all_reduce" in b1  # Megatron TP backward inside a stage
    text = (folder / "pipeline.txt").read_text()
    assert "2 stages over mesh axis 'pp' (2 ranks), 2 micro-batches, schedule 1F1B" in text
    assert "0,1: tok.weight   (tied)" in text  # the embedding is also the LM head of stage 1
    assert "0: blocks.0.fc.weight" in text and "1: blocks.1.fc.weight" in text
    assert "rank 0: 0F0 0F1 0B0 0B1" in text and "rank 1: 1F0 1B0 1F1 1B1" in text
    crossing = text.split("values crossing stages")[1].split("schedule")[0]
    assert "0F -> 1F" in crossing and "1B -> 0B" in crossing


def test_three_axis_mesh_and_tie_groups_follow_the_mesh(monkeypatch):
    """pp=4 x dp=2 x tp=2 on 16 fake ranks: the step expands over dp x tp inside each stage;
    the tied embedding lives on stages 0 and 3, and this rank's partner for it is the rank
    with the same (dp, tp) coordinate on the last stage."""
    from spmd_compiler.testing.models import gpt_2d_plan

    monkeypatch.setenv("SPMD_COMPILER_EXPLAIN", "1")
    torch.manual_seed(0)
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=4, tie_embeddings=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    mesh = fake_mesh((4, 2, 2), ["pp", "dp", "tp"])
    step = sc.compile(train_step, mesh=mesh, plan=gpt_2d_plan(), pipeline=sc.Pipeline(chunks=2, auto=True))
    ids = torch.randint(0, 32, (4, 8))  # this rank's dp shard of a batch of 8
    step(model, opt, ids, ids)
    compiled = step.last
    assert compiled.assignment.num_stages == 4
    assert compiled.assignment.tied() == {"tok.weight": (0, 3)}
    runner = compiled.pipeline
    assert runner.my_stages == [0]  # fake rank 0 = (pp 0, dp 0, tp 0)
    assert [runner.stage_rank(s) for s in range(4)] == [0, 4, 8, 12]  # same (dp, tp) on every stage
    # the gradient of the tied weight goes from stage 0's backward to stage 3's optimizer
    tied_grad = [c for c in compiled.program.cross_stage() if c[1:] == (0, 3, "B", "O")]
    assert tied_grad, compiled.program.cross_stage()
    # inside a stage, Megatron TP collectives over tp and gradient reductions over dp
    kinds = {(n.meta["spmd_comm"]["kind"], n.meta["spmd_comm"]["axis"]) for n in compiled.collectives()}
    # stages expand over the (dp, tp) sub-mesh: no collective can cross stages
    assert compiled.mctx.axis_names == ("dp", "tp")
    assert ("all_reduce", 1) in kinds and any(axis == 0 for _, axis in kinds)  # stage-mesh axes 0 = dp, 1 = tp


def test_no_chunk_inputs_are_passed_whole(monkeypatch):
    monkeypatch.setenv("SPMD_COMPILER_EXPLAIN", "1")

    def weighted_step(model, optimizer, ids, targets, class_weights):
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), weight=class_weights)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile(weighted_step, mesh=fake_mesh((2,), ["pp"]),
                      pipeline=sc.Pipeline(chunks=4, split={"blocks.1": S}, no_chunk=["batch[2]"]))
    ids = torch.randint(0, 32, (8, 8))
    step(model, opt, ids, ids, torch.ones(32))
    shapes = {i.index: tuple(n.meta["val"].shape) for n in step.last.traced.gm.graph.nodes
              if n.op == "placeholder" and (i := n.meta.get("spmd_input")) is not None and i.kind == "batch"}
    assert shapes == {0: (2, 8), 1: (2, 8), 2: (32,)}  # micro-batches of 2 rows; the weights whole


def test_fused_optimizer_is_split_per_stage(monkeypatch):
    """A fused=True optimizer is traced with its per-parameter update under a pipeline:
    each stage's optimizer piece updates its own parameters (one fused kernel over all
    of them would span stages and be refused)."""
    monkeypatch.setenv("SPMD_COMPILER_EXPLAIN", "1")
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    step = sc.compile(train_step, mesh=fake_mesh((2,), ["pp"]), pipeline=sc.Pipeline(chunks=2, split={"blocks.1": S}))
    ids = torch.randint(0, 32, (4, 8))
    step(model, opt, ids, ids)
    ops = {str(n.target) for n in step.last.traced.gm.graph.nodes}
    assert not any(o.startswith("aten._fused_") for o in ops) and "aten.addcdiv_.default" in ops


def test_pipeline_plan_keeps_every_field_of_the_users_plan():
    """The full-mesh and stage-mesh plans differ from the user's only where the pipeline
    axis is inserted (placements, fsdp axis indices, the batch default); every other
    field of Plan, including any added later, is the user's."""
    import dataclasses

    from torch.distributed.tensor import Replicate, Shard

    from spmd_compiler.pipeline.api import pipeline_plan

    user = sc.Plan(params={"blocks.*": [Shard(0)]}, inputs=[[Shard(0)]], default_param=[Replicate()],
                   default_input=[Shard(0)], style_axis="dp", strict=False, fsdp_axes=("dp",),
                   activation_sharding="greedy", reshard_after_forward=False, defer_grad_sync=True, expert_axes=("dp",),
                   expert_capacity=2.0, context_parallel=sc.ContextParallel(axis=0))
    defaults = sc.Plan()
    widened = {"params", "inputs", "default_param", "default_input", "fsdp_axes", "expert_axes", "context_parallel"}
    for f in dataclasses.fields(sc.Plan):
        assert getattr(user, f.name) != getattr(defaults, f.name), f"give {f.name} a non-default value in this test"
    for pp_index in (0, 1, None):
        plan = pipeline_plan(user, pp_index, 2)
        kept = {f.name for f in dataclasses.fields(sc.Plan) if getattr(plan, f.name) == getattr(user, f.name)}
        assert kept >= {f.name for f in dataclasses.fields(sc.Plan)} - widened, (pp_index, plan)
    full = pipeline_plan(user, 0, 2)
    assert list(full.params["blocks.*"]) == [Replicate(), Shard(0)] and list(full.default_input) == [Replicate(), Shard(0)]
    assert full.context_parallel.axis == 1 and pipeline_plan(user, 1, 2).context_parallel.axis == 0  # indices shift past pp


def test_stages_expand_with_the_users_activation_sharding_and_resharding(monkeypatch):
    """A pipelined FSDP plan with activation_sharding="greedy" and reshard_after_forward=False:
    the stage expansion and the full-mesh plan carry both (they once fell back to the
    defaults "follow" and True)."""
    import spmd_compiler.pipeline.step as pipeline_step
    from torch.distributed.tensor import Shard

    monkeypatch.setenv("SPMD_COMPILER_EXPLAIN", "1")
    seen = []
    real_expand = pipeline_step.expand

    def spy(traced, mesh, plan, **kwargs):
        seen.append(plan)
        return real_expand(traced, mesh, plan, **kwargs)

    monkeypatch.setattr(pipeline_step, "expand", spy)
    torch.manual_seed(0)
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = sc.Plan(params={"*": [Shard(0)]}, fsdp_axes=("dp",), activation_sharding="greedy", reshard_after_forward=False)
    step = sc.compile(train_step, mesh=fake_mesh((2, 2), ["pp", "dp"]), plan=plan,
                      pipeline=sc.Pipeline(chunks=2, split={"blocks.1": S}))
    ids = torch.randint(0, 32, (4, 8))
    step(model, opt, ids, ids)
    assert len(seen) == 1
    for used in (seen[0], step.plan):  # the stage plan and the full-mesh plan (distribute)
        assert used.activation_sharding == "greedy" and used.reshard_after_forward is False
        assert used.strict is plan.strict and used.style_axis == plan.style_axis
    assert seen[0].fsdp_axes == ("dp",)


def _fsdp_tp_plan():
    """FSDP on dp (each weight split along the dim TP leaves whole) x Megatron TP on tp."""
    from torch.distributed.tensor import Replicate, Shard

    col, row, col_bias = [Shard(1), Shard(0)], [Shard(0), Shard(1)], [Replicate(), Shard(0)]
    return sc.Plan(params={"blocks.*.attn.[qkv].weight": col, "blocks.*.attn.[qkv].bias": col_bias,
                           "blocks.*.attn.out.weight": row, "blocks.*.fc.weight": col, "blocks.*.fc.bias": col_bias,
                           "blocks.*.proj.weight": row, "*": [Shard(0), Replicate()]},
                   default_input=[Shard(0), Replicate()], fsdp_axes=("dp",))


def _stage0_bytes(reshard: bool) -> tuple[dict, dict, int]:
    """pp 2 x dp 2 x tp 2, 4 micro-batches, one AdamW step: stage 0's collectives per piece,
    its dp bytes per step (F and B run once per micro-batch) and the analytic minimum."""
    from spmd_compiler.dump.summary import comm_summary

    m = 4
    model = GPT(vocab=64, seq=16, dim=32, heads=4, layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = sc.compile(train_step, mesh=fake_mesh((2, 2, 2), ["pp", "dp", "tp"]), plan=_fsdp_tp_plan(), check_ranks=False,
                      symbolic="none", pipeline=sc.Pipeline(chunks=m, auto=True, reshard_between_microbatches=reshard))
    ids = torch.zeros(8, 16, dtype=torch.long)
    step(model, opt, ids, ids)
    counts, dp_bytes = {}, 0
    for (s, kind), piece in step.last.program.pieces.items():
        if s == 0:
            rows = comm_summary(piece.gm).rows
            counts[kind] = sorted((r.kind, r.axis, r.count) for r in rows)
            dp_bytes += sum(r.bytes for r in rows if r.axis == "dp") * (m if kind in "FB" else 1)
    params = dict(model.named_parameters())
    minimum = 0  # an FSDP parameter gathered once and its gradient reduce-scattered once; a dp-replicated one reduced once
    for fqn, owners in step.last.assignment.param_stages.items():
        if 0 in owners:
            p = params[fqn]
            local = p.to_local().numel() * p.element_size()
            minimum += 2 * 2 * local if p.placements[1].is_shard() else local
    return counts, dp_bytes, minimum


def test_fsdp_stage_gathers_once_per_step_with_its_passes(monkeypatch):
    """Under a pipeline the passes run on every stage piece, and a stage's FSDP parameters
    are gathered once per step in its G piece (one all_gather per module unit: the root and
    the stage's block), not in every micro-batch's forward and backward; gradients are
    reduce-scattered once, in one bucket: the stage's dp bytes are the analytic minimum.
    (Before: 16 per-parameter gathers in each micro-batch's forward, 14 in its backward.)"""
    monkeypatch.setenv("SPMD_COMPILER_EXPLAIN", "1")
    counts, dp_bytes, minimum = _stage0_bytes(reshard=False)
    assert counts["G"] == [("all_gather", "dp", 2)], counts
    assert counts["F"] == [("all_reduce", "tp", 2)] and counts["B"] == [("all_reduce", "tp", 2)], counts
    assert counts["O"] == [("all_reduce", "dp", 1), ("reduce_scatter", "dp", 1)], counts  # one bucket each
    assert dp_bytes == minimum, (dp_bytes, minimum)
    counts, dp_bytes, _ = _stage0_bytes(reshard=True)  # asked for: gathered again for every micro-batch
    assert "G" not in counts and ("all_gather", "dp", 2) in counts["F"] and ("all_gather", "dp", 1) in counts["B"], counts
    assert dp_bytes > 3.5 * minimum  # 3.9x
