"""A torchtitan-style Llama 3 (tests/zoo/titan_llama.py: complex rotary embeddings,
grouped-query attention by repeat_kv, RMSNorm, SwiGLU, clip_grad_norm_) under DP, FSDP,
torchtitan's TP plan and 2-D, 3 AdamW steps against one device."""

from __future__ import annotations

import pytest
import torch
from titan_llama import Transformer, batches, tp_params, train_step
from torch.distributed.tensor import Replicate, Shard

import spmd_compiler as sc
from spmd_compiler.testing import assert_distributed, assert_training_matches, fake_mesh


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


PLANS = {
    "dp": (((2,), ("dp",)), lambda: sc.Plan()),
    "fsdp": (((2,), ("dp",)), lambda: sc.Plan(params={"*": [Shard(0)]}, fsdp_axes=(0,))),
    "tp": (((2,), ("tp",)), lambda: sc.Plan(params=tp_params(1), default_input=[Replicate()])),
    "2d": (((2, 2), ("dp", "tp")), lambda: sc.Plan(params=tp_params(2), default_input=[Shard(0), Replicate()])),
}


@pytest.mark.parametrize("plan_name", list(PLANS))
def test_titan_llama_float64_equals_one_device(plan_name):
    """Float64 throughout (the rotation too): one device's numbers to 1e-10."""
    (shape, names), plan = PLANS[plan_name]
    torch.manual_seed(0)
    model = Transformer(rope_dtype=torch.float64).double()
    res = assert_training_matches(train_step, model, adamw, batches(), fake_mesh(shape, names), plan(), atol=1e-10, rtol=1e-8)
    dist = assert_distributed(res, collectives=1)
    if plan_name in ("tp", "2d"):
        # Megatron through the complex rotation: one tp all_reduce per attention and per
        # feed-forward in forward, no gathers anywhere
        assert dist.count("forward/all_reduce/tp") == 4 and dist.count("all_gather") == 0, dist.describe()
        assert_distributed(res, sharded=["layers.0.attention.wq.weight", "layers.1.feed_forward.w2.weight"])
    else:
        assert_distributed(res, sharded=["batch[0]"])


def test_titan_llama_as_written_float32_rope_under_tp():
    """As torchtitan writes it (float32 model, float32 rotation): TP agrees with one device
    to float32 rounding (a rank's matmuls sum fewer features before the all_reduce, and each
    RMSNorm's two Partial input-gradient terms are summed before their one all_reduce:
    optimize/partial_sums.py). The losses agree to a float32 ulp; a parameter to 1 % of one
    AdamW step (lr 0.01): Adam divides by the root of the second moment, so a near-zero
    gradient's rounding moves its element by up to a step (the worst element: 1.3e-5 with
    the terms reduced apart, 1.05e-4 summed first, both float32 orders; the float64 runs of
    the same model and plan agree to 1e-10, tests/test_optimize_partial_sums.py)."""
    (shape, names), plan = PLANS["tp"]
    torch.manual_seed(0)
    res = assert_training_matches(train_step, Transformer(), adamw, batches(), fake_mesh(shape, names), plan(), atol=1e-4 * 2, rtol=1e-4)
    for got, want in zip(res.losses, res.reference_losses):
        assert abs(got - want) <= 1e-6 * abs(want), (res.losses, res.reference_losses)
