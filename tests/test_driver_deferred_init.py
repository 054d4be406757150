"""Deferred initialization (driver/deferred_init.py): a model built on ``meta`` is
allocated shard by shard and initialized there, with values equal to one device's.

Cheap tests: the counter-based draws are shard-independent (a shard drawn at its offset
is the slice of the whole draw), ``materialize`` is deterministic and independent of the
order parameters are initialized in, and the refusals (no init path; draws that would
depend on the sharding; tensors left uninitialized or replaced) on a fake mesh. One gloo
run: 2 ranks, FSDP, a meta-built Llama trains equal to the one-device model (float64,
1e-10) and no rank ever allocates a whole parameter.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import spmd_compiler as sc
from gloo_launch import run_processes
from spmd_compiler.driver.deferred_init import _fill, materialize
from spmd_compiler.testing import fake_mesh
from spmd_compiler.testing.models import MLP, mse_train_step

aten = torch.ops.aten
FSDP = sc.Plan(params={"*": [sc.Shard(0)]}, fsdp_axes=(0,))


@pytest.mark.parametrize("op", [aten.uniform_.default, aten.normal_.default])
@pytest.mark.parametrize("dim", [0, 1])
def test_a_shard_draws_its_slice_of_the_whole_draw(op, dim):
    whole = torch.empty(7, 10, dtype=torch.float64)
    _fill(whole, op, 1234, (), (7, 10), (0, 0))
    size = whole.shape[dim]
    for start in range(0, size, 3):  # uneven shards: 3, 3, 1 rows (or 3, 3, 3, 1 columns)
        n = min(3, size - start)
        shard = torch.empty(*(n if d == dim else whole.shape[d] for d in range(2)), dtype=torch.float64)
        _fill(shard, op, 1234, (), (7, 10), tuple(start if d == dim else 0 for d in range(2)))
        assert torch.equal(shard, whole.narrow(dim, start, n))
    if op is aten.normal_.default:  # a standard normal, not a constant
        big = torch.empty(200_000, dtype=torch.float64)
        _fill(big, op, 7, (), (200_000,), (0,))
        assert abs(big.mean().item()) < 0.01 and abs(big.std().item() - 1) < 0.01


def _meta_mlp() -> torch.nn.Module:
    with torch.device("meta"):
        return MLP(dim=8, hidden=16).double()


def test_materialize_depends_on_seed_and_names_not_on_init_order():
    a = materialize(_meta_mlp(), "reset_parameters", seed=0)
    b = materialize(_meta_mlp(), lambda m: [x.reset_parameters() for x in reversed(list(m.children()))], seed=0)
    c = materialize(_meta_mlp(), "reset_parameters", seed=1)
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), n
        assert not torch.equal(p, r), n
    bound = 1 / math.sqrt(8)  # nn.Linear's kaiming bound from the fan-in
    assert 0.9 * bound < a.l1.weight.abs().max().item() <= bound


def _step_on_fake_mesh(model, **options):
    mesh = fake_mesh((2,), ("dp",), world_size=2)
    step = sc.compile(mse_train_step, mesh=mesh, plan=FSDP, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, dtype=torch.float64)
    return step, opt, step(model, opt, x, x)


def test_meta_model_without_init_is_refused_with_the_fix():
    with pytest.raises(sc.DeferredInitError, match=r"4 parameter\(s\)/buffer\(s\) of the model are on the meta device "
                       r"\(l1.weight, l1.bias, l2.weight, \.\.\.\).*\n  fix: compile\(\.\.\., init_weights='reset_parameters'\)"):
        _step_on_fake_mesh(_meta_mlp())


def _half_meta_mlp() -> torch.nn.Module:
    model = MLP(dim=8, hidden=16).double()  # l1 has values (loaded weights, say); l2 left on meta
    with torch.device("meta"):
        model.l2 = torch.nn.Linear(16, 8, dtype=torch.float64)
    return model


def test_meta_model_with_real_batches_is_a_deferred_init_error_not_a_fake_tensor_traceback():
    """The usual mistake: a model built under torch.device('meta'), real CPU batches, no
    init_weights; and a model with one submodule left on meta."""
    with pytest.raises(sc.DeferredInitError) as info:
        _step_on_fake_mesh(_meta_mlp())
    assert "FakeTensor" not in str(info.value) and info.value.names == ["l1.weight", "l1.bias", "l2.weight", "l2.bias"]
    with pytest.raises(sc.DeferredInitError, match=r"2 parameter\(s\)/buffer\(s\) of the model are on the meta device "
                       r"\(l2.weight, l2.bias\).*\n  fix: compile\(\.\.\., init_weights="):
        _step_on_fake_mesh(_half_meta_mlp())


def test_partly_meta_model_is_not_overwritten_by_init_weights():
    """init_weights would re-initialize the submodule that has values: refused, naming both parts."""
    model = _half_meta_mlp()
    before = model.l1.weight.detach().clone()
    with pytest.raises(sc.DeferredInitError, match=r"partly on the meta device: 2 .*\(l2.weight, l2.bias\) and 2 "
                       r"parameter\(s\) with values \(l1.weight, l1.bias\).*\n  fix: build the whole model on meta"):
        _step_on_fake_mesh(model, init_weights="reset_parameters")
    assert torch.equal(model.l1.weight, before)


def test_fake_mesh_rank_materializes_only_its_shards():
    model = _meta_mlp()
    step = sc.compile(mse_train_step, mesh=fake_mesh((2,), ("dp",), world_size=2), plan=FSDP, init_weights="reset_parameters")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step.distribute(model, opt)
    ref = materialize(_meta_mlp(), "reset_parameters")
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.to_local().shape[0] == q.shape[0] // 2, n  # rank 0's half, its values
        assert torch.equal(p.to_local(), q[: q.shape[0] // 2]), n
    assert opt.param_groups[0]["params"][0] is model.l1.weight
    x = torch.randn(4, 8, dtype=torch.float64)
    assert torch.isfinite(step(model, opt, x, x)).all()


def _then(bad):
    """An init that resets every module, then does ``bad``."""
    def init(m):
        for x in m.children():
            x.reset_parameters()
        bad(m)

    return init


REFUSED = {
    "factory": (_then(lambda m: m.l1.weight.copy_(torch.randn(16, 8, dtype=torch.float64))),
                r"aten.randn.default \(only uniform_, normal_.*would depend on how the model is sharded"),
    "plain tensor": (_then(lambda m: m.l1.weight.copy_(torch.empty(16, 8, dtype=torch.float64).normal_())),
                     r"aten.normal_.default into a plain tensor of shape \[16, 8\]: a plain tensor is drawn whole on every rank"),
    "generator": (_then(lambda m: torch.nn.init.normal_(m.l1.weight, generator=torch.Generator())), r"explicit generator"),
    "other random op": (_then(lambda m: m.l1.weight.bernoulli_(0.5)), r"aten.bernoulli_.float"),
    "local shard": (_then(lambda m: m.l1.weight.to_local().normal_()), r"into the local shard of 'l1.weight'"),
    "uninitialized": (lambda m: m.l1.reset_parameters(),
                      r"2 parameter\(s\)/buffer\(s\) were left uninitialized by the init \(l2.bias, l2.weight\)"),
    "replaced": (_then(lambda m: setattr(m.l2, "bias", torch.nn.Parameter(torch.zeros(8)))), r"replaced parameter\(s\) \['l2.bias'\]"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_shard_dependent_inits_are_refused(case):
    init, message = REFUSED[case]
    with pytest.raises(sc.DeferredInitError, match=message):
        _step_on_fake_mesh(_meta_mlp(), init_weights=init)


# ---------------------------------------------------------------------------- gloo
def _llama_init(model):
    from titan_llama import precompute_freqs_cis

    for m in model.modules():
        if m is not model and callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()
    torch.nn.init.trunc_normal_(model.output.weight, std=0.02, a=-0.03, b=0.03)  # resamples: temporaries drawn too
    model.freqs_cis = precompute_freqs_cis(8, 64, dtype=torch.float64)  # a buffer computed in __init__: meta too


class _Largest(TorchDispatchMode):
    """The elements of the largest tensor any op makes (a DTensor's local tensor)."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, (t.to_local() if hasattr(t, "to_local") else t).numel())
        return out


def _meta_llama_trains(rank: int, world: int) -> dict:
    from titan_llama import Transformer, batches, train_step

    with torch.device("meta"):
        model = Transformer(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, rope_dtype=torch.float64, max_seq=64).double()
    ref = materialize(copy.deepcopy(model), _llama_init, seed=5)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    step = sc.compile(train_step, mesh=(world,), plan=FSDP, init_weights=_llama_init, init_seed=5, symbolic="none")
    with _Largest() as seen:
        step.distribute(model, opt)  # what the first call does: allocate the shards, initialize them
    out = {"init": max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())),
           "largest": seen.largest, "params": {n: (p.to_local().numel(), p.numel(), p.to_local().untyped_storage().nbytes())
                                                for n, p in model.named_parameters()}}
    errs = []
    for ids, targets in batches(2):  # the first program, then the one with AdamW's state
        ids, targets = ids[:, :64], targets[:, :64]
        n = ids.shape[0] // world
        loss = step(model, opt, ids[rank * n:(rank + 1) * n], targets[rank * n:(rank + 1) * n])
        errs.append(abs(loss.item() - train_step(ref, ref_opt, ids, targets).item()))
    errs.append(max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())))
    out["train"] = max(errs)
    out["state"] = max(v.to_local().numel() / v.numel() for s in opt.state.values() for v in s.values() if v.dim())
    return out


@pytest.mark.gloo
def test_meta_model_trains_as_one_device_with_no_whole_parameter_on_any_rank():
    for res in run_processes(_meta_llama_trains, 2, timeout=240):
        assert res["init"] == 0.0 and res["train"] < 1e-10, res
        for name, (local, whole, nbytes) in res["params"].items():
            assert local * 2 == whole and nbytes == local * 8, (name, local, whole, nbytes)  # half, in storage too
        assert res["largest"] <= max(local for local, _, _ in res["params"].values()), res["largest"]  # never a whole one
        assert res["state"] == 0.5  # AdamW's moments: shards too


def _strided_rows(t: torch.Tensor, dim: int, rank: int, world: int, pieces: int = 2) -> torch.Tensor:
    """Rank ``rank``'s block of each of ``pieces`` equal pieces of ``t``'s ``dim``."""
    blocks = t.movedim(dim, 0).reshape(pieces, world, t.shape[dim] // (pieces * world), *[s for d, s in enumerate(t.shape) if d != dim])
    return blocks[:, rank].reshape(-1, *blocks.shape[3:]).movedim(0, dim)


FUSED = sc.Plan(params={"l1.weight": [sc.fused_shard(0, 2)], "l1.bias": [sc.fused_shard(0, 2)], "l2.weight": [sc.fused_shard(1, 2)]},
                default_input=[sc.Replicate()])


def test_fake_mesh_rank_draws_its_blocks_of_a_fused_weight():
    """A ``fused_shard(0, 2)`` parameter on rank 0 of 2: its first quarter and its third
    (the first block of each piece), drawn as the slices of the whole draw."""
    model = _meta_mlp()
    step = sc.compile(mse_train_step, mesh=fake_mesh((2,), ("tp",), world_size=2), plan=FUSED, init_weights="reset_parameters")
    step.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ref = materialize(_meta_mlp(), "reset_parameters")
    assert torch.equal(model.l1.weight.to_local(), _strided_rows(ref.l1.weight, 0, 0, 2))
    assert torch.equal(model.l1.bias.to_local(), _strided_rows(ref.l1.bias, 0, 0, 2))
    assert torch.equal(model.l2.weight.to_local(), _strided_rows(ref.l2.weight, 1, 0, 2))
    assert torch.equal(model.l2.bias.to_local(), ref.l2.bias)


def _fused_mlp_trains(rank: int, world: int, meta: bool) -> dict:
    """Megatron's MLP with its weights stored by ``fused_shard`` (2 pieces), built on meta
    (deferred init) or on the CPU (rank 0's values scattered): each rank's blocks, then 3
    AdamW steps against one device."""
    if meta:
        model = _meta_mlp()
        ref = materialize(copy.deepcopy(model), "reset_parameters", seed=3)
    else:
        torch.manual_seed(0)
        model = MLP(dim=8, hidden=16).double()
        ref = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    step = sc.compile(mse_train_step, mesh=(world,), plan=FUSED, init_weights="reset_parameters" if meta else None, init_seed=3)
    step.distribute(model, opt)
    blocks = [torch.equal(model.l1.weight.to_local(), _strided_rows(ref.l1.weight, 0, rank, world)),
              torch.equal(model.l2.weight.to_local(), _strided_rows(ref.l2.weight, 1, rank, world))]
    g = torch.Generator().manual_seed(1)
    errs = []
    for _ in range(3):
        x, y = torch.randn(4, 8, generator=g, dtype=torch.float64), torch.randn(4, 8, generator=g, dtype=torch.float64)
        errs.append(abs(step(model, opt, x, y).item() - mse_train_step(ref, ref_opt, x, y).item()))
    errs.append(max((model.l1.weight.to_local() - _strided_rows(ref.l1.weight, 0, rank, world)).abs().max().item(),
                    (model.l2.weight.to_local() - _strided_rows(ref.l2.weight, 1, rank, world)).abs().max().item()))
    return {"blocks": blocks, "err": max(errs), "local": model.l1.weight.to_local().shape[0]}


@pytest.mark.gloo
@pytest.mark.parametrize("meta", [True, False], ids=["deferred", "scattered"])
def test_fused_shard_weights_hold_their_blocks_and_train_as_one_device(meta):
    for res in run_processes(_fused_mlp_trains, 2, meta, timeout=240):
        assert res["blocks"] == [True, True] and res["local"] == 8 and res["err"] < 1e-12, res
