"""torch.nn models: nn.TransformerEncoderLayer, nn.Transformer, nn.MultiheadAttention
(with and without attention weights) and a small CNN with BatchNorm, under data parallel
and FSDP-style plans: 3 steps vs one device."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from zoo_common import SDPA, adamw, attention_collectives, mse_step, ops_in, run_case

import spmd_compiler as sc
from spmd_compiler.testing import assert_distributed, assert_training_matches, fake_mesh

DIM, SEQ, BATCH = 16, 8, 4


class SelfAttentionBlock(nn.Module):
    """nn.MultiheadAttention with a causal boolean mask, then a Linear. With
    ``need_weights`` the averaged attention weights feed the output too."""

    def __init__(self, need_weights: bool) -> None:
        super().__init__()
        self.need_weights = need_weights
        self.attn = nn.MultiheadAttention(DIM, 4, batch_first=True)
        self.out = nn.Linear(DIM, DIM)
        self.register_buffer("mask", torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, w = self.attn(x, x, x, need_weights=self.need_weights, attn_mask=self.mask)
        return self.out(y) + (w.sum(-1, keepdim=True) if w is not None else 0)


class Seq2Seq(nn.Module):
    """nn.Transformer (one encoder and one decoder layer) on the same sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Transformer(DIM, 4, 1, 1, 32, dropout=0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.t(x, x, tgt_mask=nn.Transformer.generate_square_subsequent_mask(SEQ, dtype=x.dtype), tgt_is_causal=True)


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, stride=2)
        self.fc = nn.Linear(8, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.c2(torch.relu(self.bn(self.c1(x)))))
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


def tokens(n: int = 3) -> list:
    return [(torch.randn(BATCH, SEQ, DIM, dtype=torch.float64), torch.randn(BATCH, SEQ, DIM, dtype=torch.float64)) for _ in range(n)]


def images(n: int = 3) -> list:
    return [(torch.randn(8, 3, 8, 8, dtype=torch.float64), torch.randn(8, DIM, dtype=torch.float64)) for _ in range(n)]


MODELS = {
    "encoder_layer": (lambda: nn.TransformerEncoderLayer(DIM, 4, 32, dropout=0.0, batch_first=True), tokens),
    "transformer": (Seq2Seq, tokens),
    "mha_weights": (lambda: SelfAttentionBlock(need_weights=True), tokens),
    "mha_no_weights": (lambda: SelfAttentionBlock(need_weights=False), tokens),
    "cnn_batchnorm": (SmallCNN, images),
}
USES_SDPA = {"encoder_layer", "transformer", "mha_no_weights"}


@functools.cache
def trained(name: str, plan: str) -> Any:
    """One checked run (run_case) per model and plan, shared by the tests that assert
    more on the same program (compiling dominates a case's time)."""
    make, data = MODELS[name]
    return run_case(mse_step, make().double(), data(), plan)


@pytest.mark.parametrize("plan", ["dp", "fsdp"])
@pytest.mark.parametrize("name", list(MODELS))
def test_torch_nn_model(name, plan):
    """3 steps equal one device; under dp nothing is gathered (run_case), so this also
    covers MHA with attention weights under DP without gathers."""
    res = trained(name, plan)
    if name in USES_SDPA:
        assert SDPA in ops_in(res), "expected SDPA's CPU flash op in the program"
        assert attention_collectives(res) == []


def test_batchnorm_statistics_are_global():
    """Batch statistics are those of the global batch (as SyncBatchNorm): the running
    statistics after 3 steps equal one device's (assert_training_matches compares
    buffers), which per-rank statistics of 2 images each would not."""
    res = run_case(mse_step, SmallCNN().double(), images(), "dp", ranks=4)
    assert res.sim.model.bn.num_batches_tracked.item() == 3


def test_batchnorm_dp_all_reduces_channel_sums_instead_of_gathering():
    """expand/rules/batchnorm.py: the activation stays split; per step, the forward
    all-reduces two per-channel sums (mean, variance) and the backward one stacked pair."""
    res = trained("cnn_batchnorm", "dp")
    dist = assert_distributed(res, sharded=["batch[0]"], collectives={"all_gather": 0})
    assert dist.count("forward/all_reduce") >= 2 and dist.count("backward/all_reduce") >= 1, dist.describe()



def test_batchnorm_statistics_named_sharded_under_fsdp_stay_exact():
    """Running statistics the FSDP plan names sharded are written in place by the step,
    so they are not gathered like parameters (a write to the gathered copy would be
    lost): they stay sharded operands, updated in place on each rank's channels, and
    equal one device's after 3 steps (assert_training_matches compares buffers)."""
    plan = sc.Plan(params={"*": [Shard(0)], "bn.running_mean": [Shard(0)], "bn.running_var": [Shard(0)]},
                   default_input=[Shard(0)], fsdp_axes=("dp",))
    res = assert_training_matches(mse_step, SmallCNN().double(), adamw, images(), fake_mesh((2,), ("dp",)), plan)
    assert_distributed(res, sharded=["bn.running_mean", "bn.running_var", "batch[0]"])

# ----------------------------------------------------------------------------- TP

def megatron_plan(name: str) -> sc.Plan:
    """Megatron by placement on a 1-D tp mesh: MHA's fused in_proj split by output
    features, each rank its share of q, of k and of v (sc.fused_shard(0, 3)); out_proj
    and linear2 by input features; linear1 by output features."""
    attn = "attn." if name.startswith("mha") else "self_attn."
    params: dict = {
        attn + "in_proj_weight": [sc.fused_shard(0, 3)], attn + "in_proj_bias": [sc.fused_shard(0, 3)],
        attn + "out_proj.weight": [Shard(1)],
    }
    if name == "encoder_layer":
        params.update({"linear1.weight": [Shard(0)], "linear1.bias": [Shard(0)], "linear2.weight": [Shard(1)]})
    return sc.Plan(params=params, default_input=[Replicate()])


@pytest.mark.parametrize("name", ["encoder_layer", "mha_no_weights"])
def test_torch_nn_megatron(name):
    make, data = MODELS[name]
    res = assert_training_matches(mse_step, make().double(), adamw, data(), fake_mesh((2,), ("tp",)), megatron_plan(name))
    assert_distributed(res, sharded=["attn.in_proj_weight" if name.startswith("mha") else "self_attn.in_proj_weight"], collectives=1)
    if name == "encoder_layer":  # the whole layer (attention and MLP) without gathers
        assert_distributed(res, collectives={"all_gather": 0})


def test_mha_weights_megatron_without_gathers():
    """The head-averaged attention weights (need_weights=True) are replicated over tp; in
    backward their gradient meets the head-split one in an add, which narrows the
    replicated operand (expand/follow.py:follow_strided) instead of gathering."""
    make, data = MODELS["mha_weights"]
    res = assert_training_matches(mse_step, make().double(), adamw, data(), fake_mesh((2,), ("tp",)), megatron_plan("mha_weights"))
    assert_distributed(res, sharded=["attn.in_proj_weight"], collectives={"all_gather": 0, "forward/all_reduce/tp": 2})
