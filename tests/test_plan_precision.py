"""Mixed precision (plan/precision.py, expand/fsdp.py's cast before the gather).

``MixedPrecisionPolicy(param_dtype=...)``: the modules compute with cast parameters, the
optimizer updates the parameters, gradients are reduced in the parameters' dtype; under
FSDP the cast is made on the shard, so each gather carries the narrow dtype (half the
bytes), for the policy and for ``torch.autocast`` alike, and the gathers still fuse per
unit. Numerics: float64 parameters computed in float32 on 4 simulated ranks against the
same mixed precision written by hand on one device, gradients clipped over
``model.parameters()`` (outside the forward they are the parameters, as under FSDP2).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.testing import SimulatedTraining, fake_mesh
from spmd_compiler.testing.models import GPT, MLP, gpt_fsdp_plan, train_step


def _gathers(**options) -> dict:
    """Bytes and launches per (phase, kind) of a 2-block GPT's FSDP step over 4 fake ranks."""
    torch.manual_seed(0)
    model = GPT(vocab=64, seq=16, dim=32, heads=4, layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    autocast = options.pop("autocast", False)
    step = sc.compile(train_step, mesh=fake_mesh((4,), ("dp",)), plan=gpt_fsdp_plan(), symbolic="none", **options)
    ids = torch.zeros(2, 16, dtype=torch.long)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        step(model, opt, ids, ids)
    out: dict = {}
    for r in step.comm_summary().rows:
        count, nbytes = out.get((r.phase, r.kind), (0, 0))
        out[(r.phase, r.kind)] = (count + r.count, nbytes + r.bytes)
    return out


def test_parameters_are_cast_before_their_gather(monkeypatch):
    monkeypatch.setenv("SPMD_COMPILER_EXPLAIN", "1")
    full = _gathers()
    policy = _gathers(mixed_precision=sc.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    autocast = _gathers(autocast=True)
    forward = ("forward", "all_gather")
    # every parameter (the policy casts them all): half the bytes, one launch per unit as before
    assert policy[forward] == (full[forward][0], full[forward][1] // 2), (policy, full)
    # autocast casts the matmul weights, not the LayerNorms' or the embeddings': a bf16 and a float32 gather per unit
    assert full[forward][1] // 2 < autocast[forward][1] < 0.6 * full[forward][1] and autocast[forward][0] == 2 * full[forward][0]
    backward = ("backward", "all_gather")  # the blocks' casts gathered again for backward (reshard_after_forward)
    assert policy[backward] == (full[backward][0], full[backward][1] // 2), (policy, full)
    grads = ("optimizer", "reduce_scatter")  # gradients reduced in float32
    assert policy[grads][1] > 0.99 * full[grads][1] and autocast[grads][1] > 0.99 * full[grads][1]  # (the loss rides elsewhere)


def test_policy_validates_itself():
    with pytest.raises(ValueError, match=r"param_dtype=torch.int8.*expected a floating torch.dtype"):
        sc.MixedPrecisionPolicy(param_dtype=torch.int8)
    with pytest.raises(ValueError, match=r"expected a spmd_compiler.MixedPrecisionPolicy"):
        sc.compile(train_step, mesh=(1,), mixed_precision=torch.bfloat16)
    model = MLP(dim=4, hidden=8).double()
    with pytest.raises(ValueError, match=r"reduce_dtype=torch.float32\) reduces gradients in the parameters' own dtype, but 4"):
        sc.trace(train_step, model, None, torch.zeros(2, 4), torch.zeros(2, 4),
                 mixed_precision=sc.MixedPrecisionPolicy(param_dtype=torch.bfloat16))


def _by_hand(model, optimizer, x, y):
    """FSDP2's mixed precision on one device: float32 copies of the float64 parameters (and
    input) for compute, float64 gradients, the update on the float64 parameters."""
    params = {n: p.float() for n, p in model.named_parameters()}
    loss = F.mse_loss(torch.func.functional_call(model, params, (x.float(),)), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _mse_step(model, optimizer, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05)  # the float64 parameters' gradients, not the casts'
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_float32_compute_of_float64_parameters_matches_one_device_by_hand():
    torch.manual_seed(0)
    model, ref = MLP().double(), None
    ref = MLP().double()
    ref.load_state_dict(model.state_dict())
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref))  # SGD: a clipped step shows
    policy = sc.MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float64)
    sim = SimulatedTraining(_mse_step, model, opt, fake_mesh((4,), ("dp",)), sc.Plan(params={"*": [sc.Shard(0)]}, fsdp_axes=(0,)),
                            mixed_precision=policy)
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(8, 16, dtype=torch.float64, generator=g), torch.randn(8, 16, dtype=torch.float64, generator=g)
        got, want = sim.step(x, y), _by_hand(ref, ref_opt, x, y)
        assert got.dtype == want.dtype == torch.float64  # float32 output, float64 target: the loss in float64
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.dtype == torch.float64, n  # the parameters (and AdamW's state) stay float64
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    gathers = [n for n in sim.expansions[(0,)].gm.graph.nodes if n.meta.get("spmd_comm", {}).get("kind") == "all_gather"]
    assert gathers and all(n.meta["spmd_comm"]["dtype"] == "float32" for n in gathers), [n.meta["spmd_comm"]["dtype"] for n in gathers]
