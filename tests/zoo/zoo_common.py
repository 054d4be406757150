"""Shared helpers of the model zoo: training steps, plans and the checks every case makes.

Each zoo case trains 3 AdamW steps in float64 on all simulated ranks and compares loss
and every parameter and buffer with the one-device run (atol 1e-9, rtol 1e-7), then
asserts the program is distributed (sharded batch or parameters, collectives).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import spmd_compiler as sc
from spmd_compiler.testing import assert_distributed, assert_training_matches, fake_mesh

SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
SDPA_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def dp_plan() -> sc.Plan:
    """Plain data parallel: parameters replicated, batch split along dim 0."""
    return sc.Plan()


def fsdp_plan(ndim: int = 1) -> sc.Plan:
    """FSDP-style, as ``fully_shard``, written the plain way: every parameter stored split
    along dim 0 and gathered for use; the buffers the wildcard matches (masks, BatchNorm
    statistics, rotary frequencies) stay Replicate on the FSDP axes by themselves."""
    return sc.Plan(params={"*": [Shard(0)] * ndim}, default_input=[Shard(0)] * ndim, fsdp_axes=tuple(range(ndim)))


def mesh(n: int) -> Any:
    return fake_mesh((n,), ("dp",))


def run_case(step: Any, model: torch.nn.Module, batches: list, plan_name: str, ranks: int = 2, *, dp_gathers: bool = False, **tolerance: float) -> Any:
    """Train ``model`` under ``plan_name`` ("dp" or "fsdp") and check it; returns the
    TrainingComparison. Under "dp" nothing but gradients and the loss may move, under
    "fsdp" nothing is gathered but parameters: no batch, no buffer, no mask built from
    one (``dp_gathers``: activations may be gathered too, for known gaps). ``tolerance``:
    ``atol``/``rtol`` for models that compute parts in float32 on purpose."""
    plan = dp_plan() if plan_name == "dp" else fsdp_plan()
    res = assert_training_matches(step, model, adamw, batches, mesh(ranks), plan, **tolerance)
    dist = assert_distributed(res, sharded=["batch[0]"], collectives=1)
    if plan_name == "fsdp":
        weights = [n for n, p in model.named_parameters() if p.dim() == 2]
        assert_distributed(res, sharded=weights[:3])
        assert dist.count("forward/all_gather") >= 1, dist.describe()  # parameters gathered for use
        if not dp_gathers:
            assert gathered(res, but="FSDP: gather") == [], dist.describe()
    elif not dp_gathers:
        assert dist.count("all_gather") == 0, dist.describe()  # nothing but gradients moves
    return res


def gathered(res: Any, but: str = "") -> list[str]:
    """The reasons of every rank's all_gathers, except those starting with ``but``."""
    return [
        n.meta["spmd_comm"]["reason"]
        for e in res.sim.expansions.values()
        for n in e.collectives()
        if "all_gather" in str(n.target) and not (but and n.meta["spmd_comm"]["reason"].startswith(but))
    ]


def ops_in(res: Any) -> set[Any]:
    """The aten ops of rank 0's program."""
    step = res.sim.expansions[next(iter(res.sim.expansions))]
    return {n.target for n in step.gm.graph.nodes if n.op == "call_function"}


def attention_collectives(res: Any) -> list[str]:
    """Collectives any rank emits for the inputs of SDPA's ops (none under DP/FSDP)."""
    return [
        n.meta["spmd_comm"]["reason"]
        for e in res.sim.expansions.values()
        for n in e.collectives()
        if "scaled_dot_product" in n.meta["spmd_comm"]["reason"]
    ]


def lm_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A Hugging Face model's training step: logits, cross-entropy, backward, update."""
    logits = model(input_ids=ids).logits
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def mse_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss
