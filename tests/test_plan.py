"""Plan resolution: patterns, defaults, optimizer state, validation errors."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import spmd_compiler as sc
from spmd_compiler.testing.models import MLP, mse_train_step


def step(model, optimizer, x):
    loss = model(x).sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


@pytest.fixture
def traced_adam():
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    step(model, opt, torch.randn(8, 16))  # materialize state
    return sc.trace(step, model, opt, torch.randn(8, 16))


def _by_label(traced, resolved):
    return {i.label: pl for i, pl in zip(traced.inputs, resolved.placements)}


def test_default_is_data_parallel(traced_adam, mesh4):
    got = _by_label(traced_adam, sc.Plan().resolve(traced_adam, mesh4))
    assert got["l1.weight"] == (Replicate(),)
    assert got["batch[0]"] == (Shard(0),)


def test_patterns_exact_wins_and_state_follows(traced_adam, mesh4):
    plan = sc.Plan(params={"*.weight": [Shard(0)], "l2.weight": [Shard(1)]})
    got = _by_label(traced_adam, plan.resolve(traced_adam, mesh4))
    assert got["l1.weight"] == (Shard(0),)
    assert got["l2.weight"] == (Shard(1),)  # exact FQN beats the pattern
    assert got["l1.bias"] == (Replicate(),)
    assert got["l1.weight['exp_avg']"] == (Shard(0),)  # optimizer state follows its parameter
    assert got["l1.weight['step']"] == (Replicate(),)  # 0-d step stays replicated


def test_unknown_fqn_suggests_names(traced_adam, mesh4):
    with pytest.raises(ValueError, match=r"'l1.wieght' names no parameter.*Did you mean 'l1.weight'"):
        sc.Plan(params={"l1.wieght": [Shard(0)]}).resolve(traced_adam, mesh4)


def test_pattern_matching_nothing(traced_adam, mesh4):
    with pytest.raises(ValueError, match="matches no parameter"):
        sc.Plan(params={"encoder.*": [Shard(0)]}).resolve(traced_adam, mesh4)


def test_wrong_number_of_placements(traced_adam, mesh2x2):
    with pytest.raises(ValueError, match="got 1 placements .* for a mesh with 2 axes"):
        sc.Plan(params={"l1.weight": [Shard(0)]}).resolve(traced_adam, mesh2x2)


def test_shard_dim_out_of_range(traced_adam, mesh4):
    with pytest.raises(ValueError, match=r"Shard\(2\) on mesh axis 0 is out of range for a 2-d tensor"):
        sc.Plan(params={"l1.weight": [Shard(2)]}).resolve(traced_adam, mesh4)


def test_negative_shard_dim_normalized(traced_adam, mesh4):
    got = _by_label(traced_adam, sc.Plan(params={"l1.weight": [Shard(-1)]}).resolve(traced_adam, mesh4))
    assert got["l1.weight"] == (Shard(1),)


def test_not_a_placement(traced_adam, mesh4):
    with pytest.raises(TypeError, match="is not a Placement"):
        sc.Plan(params={"l1.weight": ["shard"]}).resolve(traced_adam, mesh4)


def test_inputs_by_index_and_path(traced_adam, mesh4):
    got = _by_label(traced_adam, sc.Plan(inputs=[[Replicate()]]).resolve(traced_adam, mesh4))
    assert got["batch[0]"] == (Replicate(),)
    got = _by_label(traced_adam, sc.Plan(inputs={"batch[0]": [Shard(1)]}).resolve(traced_adam, mesh4))
    assert got["batch[0]"] == (Shard(1),)
    with pytest.raises(ValueError, match="names no batch tensor"):
        sc.Plan(inputs={"batch[7]": [Shard(0)]}).resolve(traced_adam, mesh4)


def test_every_bad_entry_in_one_error(traced_adam, mesh4):
    """Several mistakes: one error lists them all, the first one's message (and type)
    first, as a plan with that mistake alone raises it; a parameter's grad and optimizer
    state, which follow its entry, do not repeat it."""
    plan = sc.Plan(params={"l1.wieght": [Shard(0)], "l2.weight": [Shard(2)], "encoder.*": [Shard(0)]},
                   inputs={"batch[3]": [Replicate()]}, fsdp_axes=("dpp",))
    with pytest.raises(ValueError) as info:
        plan.resolve(traced_adam, mesh4)
    text = str(info.value)
    lines = text.splitlines()
    assert lines[0].startswith("plan entry 'l1.wieght' names no parameter"), text
    assert "the plan has 4 more bad entries (all 5 listed; fix each):" in lines[1], text
    assert len(lines) == 6, text
    for part in (r"Did you mean 'l1.weight'", "l2.weight (shape [16, 32]) gets placements [Shard(dim=2)] from plan['l2.weight']",
                 "plan pattern 'encoder.*' matches no parameter", "plan input 'batch[3]' names no batch tensor",
                 "fsdp axis 'dpp' is not a mesh axis name"):
        assert part in text, (part, text)
    assert all("fix:" in line for line in lines[2:]), text
    assert text.count("l2.weight (shape") == 1, text  # not again for its grad and Adam state
    with pytest.raises(ValueError) as alone:
        sc.Plan(params={"l1.wieght": [Shard(0)]}).resolve(traced_adam, mesh4)
    assert str(alone.value) == lines[0]


def test_first_bad_entry_keeps_its_type(traced_adam, mesh4):
    with pytest.raises(TypeError, match=r"is not a Placement(.|\n)*the plan has 1 more bad entry(.|\n)*'l1.wieght'"):
        sc.Plan(params={"l2.weight": ["shard"], "l1.wieght": [Shard(0)]}).resolve(traced_adam, mesh4)


def _bn_model():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 8)).double()


@pytest.fixture
def traced_bn():
    model = _bn_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return sc.trace(mse_train_step, model, opt, torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64))


def test_wildcard_never_shards_a_0d_tensor(traced_bn, mesh4, caplog):
    with caplog.at_level("DEBUG", logger="spmd_compiler.plan"):
        resolved = sc.Plan(params={"*": [Shard(0)]}).resolve(traced_bn, mesh4)
    got = _by_label(traced_bn, resolved)
    assert got["1.num_batches_tracked"] == (Replicate(),)
    assert got["1.running_mean"] == (Shard(0),) and got["0.weight"] == (Shard(0),)
    assert "1.num_batches_tracked [] on mesh axes [0] (a 0-d tensor)" in caplog.text
    src = dict(zip([i.label for i in traced_bn.inputs], resolved.sources))["1.num_batches_tracked"]
    assert "plan['*'], Replicate on mesh axes [0]" in src


def test_wildcard_shard_dim_a_tensor_lacks_replicates(traced_bn, mesh2x2):
    plan = sc.Plan(params={"*.[wb][ei]*": [Replicate(), Shard(1)]}, default_param=[Shard(0), Replicate()])
    got = _by_label(traced_bn, plan.resolve(traced_bn, mesh2x2))
    assert got["0.weight"] == (Replicate(), Shard(1))
    assert got["0.bias"] == (Replicate(), Replicate())  # a 1-d bias has no dim 1
    assert got["1.running_mean"] == (Shard(0), Replicate())  # default_param
    assert got["1.num_batches_tracked"] == (Replicate(), Replicate())  # default_param on a 0-d buffer


def test_exact_entry_sharding_a_0d_tensor_is_an_error(traced_bn, mesh4):
    with pytest.raises(ValueError, match=r"1.num_batches_tracked \(shape \[\]\) gets placements \[Shard\(dim=0\)\] from "
                                         r"plan\['1.num_batches_tracked'\].*fix: .*Replicate\(\)"):
        sc.Plan(params={"*": [Shard(0)], "1.num_batches_tracked": [Shard(0)]}).resolve(traced_bn, mesh4)


def test_fsdp_wildcard_shards_parameters_only(traced_bn, mesh2x2):
    """Under fsdp_axes a pattern or default_param leaves buffers whole on the FSDP axes
    (as fully_shard); the other axes and exact entries mean what they say."""
    plan = sc.Plan(params={"*": [Shard(0), Replicate()], "1.running_var": [Shard(0), Replicate()]},
                   default_param=[Replicate(), Shard(0)], fsdp_axes=("dp",))
    resolved = plan.resolve(traced_bn, mesh2x2)
    got = _by_label(traced_bn, resolved)
    assert got["0.weight"] == got["1.weight"] == (Shard(0), Replicate())
    assert got["1.running_mean"] == got["1.num_batches_tracked"] == (Replicate(), Replicate())
    assert got["1.running_var"] == (Shard(0), Replicate())  # named exactly: sharded as asked
    src = dict(zip([i.label for i in traced_bn.inputs], resolved.sources))["1.running_mean"]
    assert src == "plan['*'], Replicate on FSDP axes [0] (a buffer: FSDP shards parameters)"
    # without fsdp_axes the same wildcard shards the buffer, as a DTensor operand
    assert _by_label(traced_bn, sc.Plan(params={"*": [Shard(0), Replicate()]}).resolve(traced_bn, mesh2x2))["1.running_mean"] == (Shard(0), Replicate())


@pytest.mark.parametrize("fsdp_axes", [(), ("dp",)])
def test_batchnorm_model_under_wildcard_shard_trains_as_one_device(fsdp_axes):
    """Also the plain FSDP plan: its wildcard keeps the BatchNorm statistics whole, so
    the batch stays split: one gather per module's parameters, the global statistics
    by 2 all_reduces, nothing all-to-all (a sharded running_mean moved the batch so)."""
    from spmd_compiler.testing import assert_distributed, assert_training_matches, fake_mesh

    batches = [(torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)) for _ in range(2)]
    res = assert_training_matches(
        mse_train_step, _bn_model(), lambda p: torch.optim.AdamW(p, lr=1e-2), batches, fake_mesh((2,), ("dp",)),
        sc.Plan(params={"*": [Shard(0)]}, fsdp_axes=fsdp_axes),
    )
    if not fsdp_axes:
        assert_distributed(res, sharded=["0.weight", "1.running_mean"])
        return
    dist = assert_distributed(res, sharded=["0.weight", "batch[0]"], collectives={"all_to_all": 0, "forward/all_gather": 3, "forward/all_reduce": 2})
    assert dist.placements["1.running_mean"] == "R", dist.describe()


def test_reshard_after_forward_is_a_bool_defaulting_to_fully_shards():
    assert sc.Plan(fsdp_axes=("dp",)).reshard_after_forward is True  # fully_shard's default
    with pytest.raises(TypeError, match=r"reshard_after_forward='no'.*expected True .* or False .*fix: pass a bool"):
        sc.Plan(fsdp_axes=("dp",), reshard_after_forward="no")


@pytest.mark.parametrize("axes", [None, "dp", 0, ("dp", 1.5)])
def test_fsdp_axes_must_be_a_tuple_of_axis_names_or_indices(axes):
    with pytest.raises(TypeError, match=r"Plan\(fsdp_axes=.*\): expected a tuple of mesh axis names or indices.*fix: fsdp_axes=\('dp',\)"):
        sc.Plan(fsdp_axes=axes)
    assert sc.Plan(fsdp_axes=["dp", 1]).fsdp_axes == ["dp", 1]


def test_fused_shard_is_a_strided_shard_normalized_and_checked(traced_adam, mesh4):
    """``fused_shard(d, k)``: each rank its block of each of k equal pieces of dim d
    (torch's _StridedShard); a negative dim normalizes, a dim not made of k equal pieces
    and bad arguments are refused with what was expected."""
    import spmd_compiler._private_torch as pt

    assert sc.fused_shard(0, 1) == Shard(0)
    got = _by_label(traced_adam, sc.Plan(params={"l1.weight": [sc.fused_shard(-2, 2)]}).resolve(traced_adam, mesh4))
    assert got["l1.weight"] == (pt.StridedShard(0, split_factor=2),)
    assert got["l1.weight['exp_avg']"] == got["l1.weight"]  # the state follows
    rows = traced_adam.inputs[[i.label for i in traced_adam.inputs].index("l1.weight")].shape[0]
    with pytest.raises(ValueError, match=rf"fused_shard\(0, 7\) on mesh axis 0: dim 0 of size {rows}; expected a dim"):
        sc.Plan(params={"l1.weight": [sc.fused_shard(0, 7)]}).resolve(traced_adam, mesh4)
    with pytest.raises(ValueError, match=r"out of range"):
        sc.Plan(params={"l1.weight": [sc.fused_shard(2, 2)]}).resolve(traced_adam, mesh4)
    with pytest.raises(TypeError, match=r"expected two ints"):
        sc.fused_shard("0", 2)
    with pytest.raises(ValueError, match=r"expected pieces >= 1"):
        sc.fused_shard(0, 0)
