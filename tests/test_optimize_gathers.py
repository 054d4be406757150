"""FSDP parameter gathers fused per module unit (spmd_compiler/optimize/gathers.py)."""

from __future__ import annotations

import pytest
import torch

import spmd_compiler as sc
from spmd_compiler.dump import memory_trace
from spmd_compiler.optimize import bucket_parameter_gathers_pass, default_passes, overlap_pass, run_passes
from spmd_compiler.optimize.gathers import unit_of
from spmd_compiler.optimize.graph_utils import alias_root, is_collective, is_wait, positions
from spmd_compiler.optimize.overlap import is_param_gather
from spmd_compiler.testing import assert_distributed, assert_training_matches, fake_mesh
from spmd_compiler.testing.models import GPT, gpt_fsdp_plan, train_step


def test_unit_of():
    assert unit_of("blocks.3.attn.q.weight") == "blocks.3"
    assert unit_of("encoder.layers.12.fc.bias") == "encoder.layers.12"
    assert unit_of("tok.weight") == ""
    assert unit_of("head.weight") == ""


def _fsdp_step(mesh, vocab=32, layers=2, reshard_after_forward=True):
    model = GPT(vocab=vocab, seq=8, dim=16, heads=2, layers=layers)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ids = torch.randint(0, vocab, (8, 8))
    train_step(model, opt, ids, ids)
    plan = gpt_fsdp_plan(reshard_after_forward=reshard_after_forward)
    return sc.expand(sc.trace(train_step, model, opt, ids, ids), mesh, plan)


@pytest.fixture(scope="module")
def optimized_resharded():
    """The default passes' program of ``_fsdp_step`` (4 ranks, reshard_after_forward=True),
    read (never changed) by the tests below."""
    return run_passes(_fsdp_step(fake_mesh((4,), ("dp",))).gm, default_passes())[0]


def _gathers(gm):
    return [n for n in gm.graph.nodes if is_collective(n) and is_param_gather(n)]


def test_one_gather_per_unit(mesh4, optimized_resharded):
    step = _fsdp_step(mesh4, reshard_after_forward=False)
    gm = sc.optimize.remove_redundant_collectives_pass(step.gm)
    before = _gathers(gm)
    gm = bucket_parameter_gathers_pass(gm)
    after = _gathers(gm)
    assert len(before) == sum(1 for i in step.traced.inputs if i.kind == "param")  # one per parameter
    # and nothing else: the causal-mask buffer stays whole under the plan's "*" (it used to be
    # gathered for masked_fill in forward and backward of every block, every step)
    assert [n for n in gm.graph.nodes if is_collective(n) and "all_gather" in str(n.target) and not is_param_gather(n)] == []
    units = sorted(n.meta["spmd_param_gather"] for n in after)
    assert units == ["", "blocks.0", "blocks.1"]
    assert sum(n.meta["spmd_comm"]["bytes"] for n in after) == sum(n.meta["spmd_comm"]["bytes"] for n in before)
    block0 = next(n for n in after if n.meta["spmd_param_gather"] == "blocks.0")
    assert "gather the 16 parameters of unit blocks.0" in block0.meta["spmd_comm"]["reason"]
    assert len(block0.meta["spmd_comm"]["bucket"]) == 16  # provenance of every member kept
    with pytest.raises(ValueError, match="by must be"):
        bucket_parameter_gathers_pass(gm, by="layer")

    # Plan(reshard_after_forward=...), fully_shard's option: True gathers every block unit
    # again for backward (and takes the views autograd saved, t(weight), from that gather),
    # so no block's forward gather lives into backward; the root unit (head, final norm)
    # keeps its forward gather, as fully_shard keeps its root; False (above) keeps every
    # forward gather for backward
    gms = {True: optimized_resharded, False: run_passes(gm, default_passes())[0]}
    counts = {r: {ph: sum(1 for n in _gathers(g) if n.meta["spmd_phase"] == ph) for ph in ("forward", "backward")}
              for r, g in gms.items()}
    assert counts == {True: {"forward": 3, "backward": 2}, False: {"forward": 3, "backward": 0}}
    assert _reads_forward_gather(gms[True], "") != [] and _reads_forward_gather(gms[True], "blocks.") == []
    assert len(_reads_forward_gather(gms[False], "blocks.")) >= 4  # each block's t(weight)s, at least
    regathered = [n for n in gms[True].graph.nodes if "spmd_regathered" in n.meta]
    assert regathered and all(n.meta["spmd_phase"] == "backward" for n in regathered)
    # liveness: the static peak (in backward) is lower, by the gathered parameters
    peaks = {r: memory_trace(g) for r, g in gms.items()}
    assert peaks[True].peak_bytes < peaks[False].peak_bytes
    gathered = {r: sum(b for w, b in t.breakdown().items() if w.endswith("gathered parameters")) for r, t in peaks.items()}
    assert gathered[True] < gathered[False]


def _reads_forward_gather(gm, unit: str) -> list[str]:
    """Backward nodes that read a forward parameter gather of a unit whose name starts
    with ``unit`` (directly or through views)."""
    forward = {next(u for u in n.users if is_wait(u)) for n in _gathers(gm)
               if n.meta["spmd_phase"] == "forward" and n.meta["spmd_param_gather"].startswith(unit)}
    return [n.name for n in gm.graph.nodes if n.meta.get("spmd_phase") == "backward"
            and any(alias_root(a) in forward for a in n.all_input_nodes)]


def test_reshard_after_forward_gathers_the_minimum_bytes(optimized_resharded):
    """reshard_after_forward=True: forward gathers every parameter once; backward gathers
    again only what backward reads of the blocks, their weights (and the LayerNorms'
    biases, which native_layer_norm_backward takes for its gradient's shape), never a
    bias of a Linear, never a root parameter (tok, pos, ln, head: kept from forward, as
    fully_shard keeps its root). Reduce-scatters move every gradient once."""
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=2)
    full = {n: p.numel() * 4 for n, p in model.named_parameters()}
    gm = optimized_resharded
    got = {ph: sum(n.meta["spmd_comm"]["bytes"] for n in _gathers(gm) if n.meta["spmd_phase"] == ph) for ph in ("forward", "backward")}
    reads = sum(b for n, b in full.items() if n.startswith("blocks.") and n.endswith("weight"))
    ln_bias = sum(b for n, b in full.items() if n.startswith("blocks.") and ".ln" in n and n.endswith("bias"))
    assert got == {"forward": sum(full.values()), "backward": reads + ln_bias}, (got, reads, ln_bias)
    gathered = {m["value"] for n in _gathers(gm) if n.meta["spmd_phase"] == "backward" for m in n.meta["spmd_comm"]["bucket"]}
    assert gathered and not any(v.startswith(("p_tok", "p_pos", "p_ln", "p_head")) or v.endswith(("attn_q_bias", "fc_bias", "proj_bias")) for v in gathered), gathered
    scattered = sum(n.meta["spmd_comm"]["bytes"] for n in gm.graph.nodes if is_collective(n) and n.meta.get("spmd_comm", {}).get("kind") == "reduce_scatter")
    # the mean's [loss sum, count] pair riding in a bucket: 4 ranks' slots in each of the 4 rows
    assert sum(full.values()) <= scattered <= sum(full.values()) + 4 * 4 * 2 * 4


def test_units_are_prefetched_in_order_of_need(mesh4):
    step = _fsdp_step(mesh4, layers=3)
    gm = sc.optimize.remove_redundant_collectives_pass(step.gm)
    gm = overlap_pass(bucket_parameter_gathers_pass(gm), prefetch=1)
    pos = positions(gm)
    gathers = sorted(_gathers(gm), key=lambda n: pos[n])
    # reshard_after_forward: gathered again for backward, in backward's order of need
    assert [(n.meta["spmd_phase"], n.meta["spmd_param_gather"]) for n in gathers] == [
        *(("forward", u) for u in ("", "blocks.0", "blocks.1", "blocks.2")),
        *(("backward", u) for u in ("blocks.2", "blocks.1", "blocks.0")),  # the root's kept from forward
    ]
    first_backward = min(pos[n] for n in gm.graph.nodes if n.meta.get("spmd_phase") == "backward")
    assert all(pos[n] >= first_backward for n in gathers if n.meta["spmd_phase"] == "backward")  # none issued in forward

    def first_compute_use(g):
        w = next(u for u in g.users if is_wait(u))
        todo, uses = [w], []
        while todo:
            for u in todo.pop().users:
                (todo if u.meta.get("spmd_copy_out") else uses).append(u)
        return min(pos[u] for u in uses)

    for earlier, later in zip(gathers, gathers[1:]):
        # with prefetch=1 a unit is gathered only once the previous one is in use
        assert pos[later] > first_compute_use(earlier) - 2
        assert pos[later] < first_compute_use(later)


# 31 rows split unevenly over 2 ranks (16 and 15): padded shards, so each rank compiles its
# own program (2 ranks keep that cheap); reshard_after_forward: gathered again for backward
# (True, fully_shard's default) or the forward's gather kept (False, 4 even ranks)
@pytest.mark.parametrize("vocab,reshard,ranks", [(32, False, 4), (31, True, 2)])
def test_fused_gathers_keep_training_numerics(vocab, reshard, ranks):
    model = GPT(vocab=vocab, seq=8, dim=16, heads=2, layers=2).double()
    batches = [(torch.randint(0, vocab, (8, 8)), torch.randint(0, vocab, (8, 8))) for _ in range(3)]
    res = assert_training_matches(
        train_step, model, lambda p: torch.optim.AdamW(p, lr=0.01), batches, fake_mesh((ranks,), ("dp",)),
        gpt_fsdp_plan(reshard_after_forward=reshard), passes=default_passes(),
    )
    assert_distributed(res, sharded=["tok.weight", "blocks.0.fc.weight", "batch[0]"])
    gm = next(iter(res.sim.expansions.values())).gm
    units = sorted((n.meta["spmd_phase"], n.meta["spmd_param_gather"]) for n in _gathers(gm))
    backward = [("backward", u) for u in ("blocks.0", "blocks.1")] if reshard else []  # the root unit kept from forward
    assert units == backward + [("forward", u) for u in ("", "blocks.0", "blocks.1")]


def test_gathers_of_views_made_late_are_left_alone(mesh2x2):
    # no fsdp_axes: DTensor gathers what each op needs, e.g. t(weight) in backward, made
    # long after the unit's first gather is needed; fusing it there read it before it
    # existed (the pass failed its lint: "used before it has been defined")
    from torch.distributed.tensor import Shard

    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ids = torch.randint(0, 32, (4, 8))
    step = sc.expand(sc.trace(train_step, model, opt, ids, ids), mesh2x2, sc.Plan(params={"*": [Shard(0), Shard(0)]}))
    gm = bucket_parameter_gathers_pass(sc.optimize.remove_redundant_collectives_pass(step.gm))
    gm.graph.lint()
    pos = positions(gm)
    for fused in _gathers(gm):
        for member in fused.meta.get("spmd_copy_in", []):
            assert all(pos[a] < pos[fused] for a in member.all_input_nodes)


# issue #16: weights stored Shard(1) (a tied embedding/head) and an nn.Embedding feeding
# Hugging Face's Conv1D ((in, out) weights) under FSDP-style plans. Gathers of any shard
# dim (movedim before the collective, padding for uneven shards) are fused; one whose
# input is made too late is left out, and the pass runner checks the result.
class Conv1D(torch.nn.Module):
    """Hugging Face's Conv1D: a Linear whose weight is stored (in, out)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = torch.nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        size_out = x.size()[:-1] + (self.weight.size(-1),)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class EmbedConv1D(torch.nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.head = Conv1D(vocab, dim)

    def forward(self, ids):
        return self.head(self.emb(ids))


def _adamw(p):
    return torch.optim.AdamW(p, lr=0.01)


def _lm_batches(n=2, vocab=32):
    return [(torch.randint(0, vocab, (8, 8)), torch.randint(0, vocab, (8, 8))) for _ in range(n)]


def _members(res):
    gm = next(iter(res.sim.expansions.values())).gm
    return {n.meta["spmd_param_gather"]: n.meta["spmd_comm"]["value"] for n in _gathers(gm) if "spmd_param_gather" in n.meta}


def test_tied_embedding_stored_shard1_is_gathered_in_its_unit(mesh4):
    from torch.distributed.tensor import Shard

    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=1, tie_embeddings=True).double()
    plan = sc.Plan(params={"tok.weight": [Shard(1)], "*": [Shard(0)]}, default_input=[Shard(0)], fsdp_axes=(0,))
    res = assert_training_matches(train_step, model, _adamw, _lm_batches(), mesh4, plan)
    assert_distributed(res, sharded=["tok.weight", "blocks.0.fc.weight"])
    assert "p_tok_weight" in _members(res)[""]  # movedim'd to gather along dim 1, fused with the root unit


@pytest.mark.parametrize("fsdp_axes", [(), (0,)])
def test_embedding_into_conv1d_every_parameter_shard0(mesh4, fsdp_axes):
    # without fsdp_axes this failed the pass's lint: "Argument 't' of Node 'movedim_int' was
    # used before it has been defined" (the gather of t(weight), made in backward, fused early)
    from torch.distributed.tensor import Shard

    plan = sc.Plan(params={"*": [Shard(0)]}, default_input=[Shard(0)], fsdp_axes=fsdp_axes)
    res = assert_training_matches(train_step, EmbedConv1D().double(), _adamw, _lm_batches(), mesh4, plan)
    assert_distributed(res, sharded=["emb.weight", "head.weight"])
    if fsdp_axes:
        assert sorted(_members(res)[""][5:-1].split(", ")) == ["p_emb_weight", "p_head_bias", "p_head_weight"]  # unit[...]


def test_tied_embedding_under_tp_and_fsdp(mesh2x2):
    # failed the pass's lint before: "Argument 't_23' ... used before it has been defined"
    from torch.distributed.tensor import Replicate, Shard

    from spmd_compiler.testing.models import _tp_params

    params = {**_tp_params(2, 1), "tok.weight": [Shard(0), Shard(1)], "*": [Shard(0), Replicate()]}
    plan = sc.Plan(params=params, default_input=[Shard(0), Replicate()], fsdp_axes=(0,))
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=1, tie_embeddings=True).double()
    res = assert_training_matches(train_step, model, _adamw, _lm_batches(), mesh2x2, plan)
    assert_distributed(res, sharded=["tok.weight", "blocks.0.fc.weight"])
    assert {"", "blocks.0"} <= set(_members(res))


def test_a_gather_is_not_moved_past_a_write_to_its_input(mesh4):
    """A member gathered before the unit's first use keeps reading its input as it was
    then: with an in-place write in between, it stays out of the fused gather."""
    from spmd_compiler.optimize.graph_utils import new_node

    step = _fsdp_step(mesh4, layers=1)
    gm = sc.optimize.remove_redundant_collectives_pass(step.gm)
    pos = positions(gm)
    gathers = {n.meta["spmd_comm"]["value"]: n for n in _gathers(gm)}
    first = min(gathers.values(), key=lambda g: min(pos[u] for w in g.users for u in w.users))
    param = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == first.meta["spmd_comm"]["value"])
    use = min((u for w in first.users for u in w.users), key=lambda u: pos[u])
    with gm.graph.inserting_before(use):
        write = new_node(gm.graph, torch.ops.aten.mul_.Tensor, (param, 2.0))
    gm = bucket_parameter_gathers_pass(gm)
    gm.graph.lint()
    pos = positions(gm)
    assert first in gm.graph.nodes and pos[first] < pos[write]  # still its own gather, before the write
    fused = [n for n in _gathers(gm) if n.meta.get("spmd_param_gather") == unit_of(param.meta["spmd_input"].name)]
    assert fused and all(param.name not in n.meta["spmd_comm"]["value"] for n in fused)


def test_a_buffer_named_sharded_is_called_a_buffer_in_the_gather_reasons(mesh4):
    """A buffer the FSDP plan names sharded (the causal mask here, Llama's rotary
    ``inv_freq`` in the zoo) is gathered like a parameter; the reasons the dump prints say
    "buffer" for it, "parameter" for the parameters."""
    model = GPT(vocab=32, seq=8, dim=16, heads=2, layers=1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ids = torch.randint(0, 32, (8, 8))
    plan = gpt_fsdp_plan(reshard_after_forward=False)
    plan = sc.Plan(params={**plan.params, "blocks.0.attn.mask": [sc.Shard(0)]}, default_input=plan.default_input,
                   fsdp_axes=plan.fsdp_axes, reshard_after_forward=False)
    step = sc.expand(sc.trace(train_step, model, opt, ids, ids), mesh4, plan)
    gm = sc.optimize.remove_redundant_collectives_pass(step.gm)
    reasons = [n.meta["spmd_comm"]["reason"] for n in _gathers(gm)]
    assert any(r.startswith("FSDP: gather buffer blocks.0.attn.mask for forward:") for r in reasons), reasons
    assert any(r.startswith("FSDP: gather parameter blocks.0.attn.q.weight for forward:") for r in reasons), reasons
    assert not any("parameter blocks.0.attn.mask" in r for r in reasons), reasons


class _ScaledLinear(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("scale", torch.linspace(1.0, 2.0, 8))

    def forward(self, x):
        return self.lin(x) * self.scale


def _sum_step(model, opt, x):
    loss = model(x).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_a_fused_gather_with_a_buffer_counts_it_as_a_buffer(mesh4):
    model = _ScaledLinear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = sc.Plan(params={"*": [sc.Shard(0)], "scale": [sc.Shard(0)]}, default_input=[sc.Shard(0)], fsdp_axes=(0,),
                   reshard_after_forward=False)
    step = sc.expand(sc.trace(_sum_step, model, opt, torch.randn(8, 8)), mesh4, plan)
    gm = bucket_parameter_gathers_pass(sc.optimize.remove_redundant_collectives_pass(step.gm))
    fused = [n.meta["spmd_comm"]["reason"] for n in _gathers(gm)]
    assert fused == ["FSDP: gather the 2 parameters and 1 buffer of unit <root> in one collective"], fused
