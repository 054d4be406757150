"""The benchmark GPT's shared setup, for ``step_time.py``, ``comm_profile.py``, ``memory.py``
and ``peers.py``: its config and data, the compiled side's plan and mesh per kind (dp,
fsdp, fsdp_reshard, tp, 2d), the hand-built peer of each kind, each rank's share of the batch, the
compute-floor program (collectives replaced by local ops) and the collective bytes per
step, measured (fake process group) and the analytic minimum.
"""

from __future__ import annotations

import copy
import pathlib
import sys
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import spmd_compiler as sc  # noqa: E402
from spmd_compiler.testing.models import GPT, GPTConfig, gpt_2d_plan, gpt_fsdp_plan, gpt_tp_plan, train_step  # noqa: E402

PEERS = {"dp": "DDP", "fsdp": "FSDP2 fully_shard", "fsdp_reshard": "FSDP2 fully_shard, reshard_after_forward=True",
         "tp": "eager DTensor TP", "2d": "eager DTensor TP + dp all_reduce"}
TIMING_WORLD = {"dp": 2, "fsdp": 2, "fsdp_reshard": 2, "tp": 2, "2d": 4}


def _cfg(args: Any, dim: int | None = None) -> GPTConfig:
    return GPTConfig(vocab=args.vocab, seq=args.seq, dim=dim or args.dim, heads=args.heads, layers=args.layers)


def _batch(step: int, args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    return ids, torch.roll(ids, -1, 1)


def _plan(kind: str, world: int) -> tuple[Any, dict[str, int]]:
    return {
        "dp": (None, {"dp": world}),
        "fsdp": (gpt_fsdp_plan(reshard_after_forward=False), {"dp": world}),  # as its FSDP2 peer
        "fsdp_reshard": (gpt_fsdp_plan(reshard_after_forward=True), {"dp": world}),  # gathered again in backward
        "tp": (gpt_tp_plan(), {"tp": world}),
        "2d": (gpt_2d_plan(), {"dp": world // 2, "tp": 2}),
    }[kind]


def _styles() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.out": RowwiseParallel(), "fc": ColwiseParallel(), "proj": RowwiseParallel()}


def _peer(kind: str, model: torch.nn.Module, world: int) -> torch.nn.Module:
    """The hand-built distributed model for ``kind``."""
    from torch.distributed.device_mesh import init_device_mesh

    if kind == "dp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if kind in ("fsdp", "fsdp_reshard"):
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=kind == "fsdp_reshard")
        fully_shard(model, mesh=mesh, reshard_after_forward=kind == "fsdp_reshard")
        return model
    from torch.distributed.tensor.parallel import parallelize_module

    if kind == "tp":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        tp = mesh
    else:
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        tp = mesh["tp"]
    for block in model.blocks:
        parallelize_module(block, tp, _styles())
        block.attn.heads //= tp.size()  # local heads, as torchtitan does with parallelize_module
    if kind == "2d" and mesh["dp"].size() > 1:
        _sync_gradients_over(model, mesh["dp"].get_group())
    return model


def _sync_gradients_over(model: torch.nn.Module, group: Any) -> None:
    """Hand-written data parallel for the eager 2-D peer: average every gradient over the
    dp group (one all_reduce per parameter) once it is accumulated."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    size = dist.get_world_size(group)

    def hook(param: torch.Tensor) -> None:
        g = param.grad
        local = g.to_local() if isinstance(g, DTensor) else g
        dist.all_reduce(local, group=group)
        local.div_(size)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)


def _local_batch(kind: str, ids: torch.Tensor, tg: torch.Tensor, world: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    if kind in ("dp", "fsdp", "fsdp_reshard"):
        return ids.chunk(world)[rank], tg.chunk(world)[rank]
    if kind == "2d":
        dp_rank = rank // 2
        return ids.chunk(world // 2)[dp_rank], tg.chunk(world // 2)[dp_rank]
    return ids, tg


def _without_collectives(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of the per-rank program with every collective replaced by a local op of the same
    output shape (all_reduce: a copy; all_gather: the shard repeated; reduce_scatter: the first
    chunk). Its step time is the program's compute alone: the floor any implementation of the
    plan reaches with these kernels if communication cost nothing. Numbers it computes are wrong;
    only its time is used."""
    gm = copy.deepcopy(gm)
    g, aten, c10d = gm.graph, torch.ops.aten, torch.ops._c10d_functional
    for n in list(g.nodes):
        if n.op != "call_function" or getattr(n.target, "namespace", None) != "_c10d_functional":
            continue
        if n.target is c10d.wait_tensor.default:
            n.replace_all_uses_with(n.args[0])
            g.erase_node(n)
            continue
        x = n.args[0]
        with g.inserting_before(n):
            if n.target is c10d.all_reduce.default:
                local = g.call_function(aten.clone.default, (x,))
            elif n.target is c10d.all_gather_into_tensor.default:
                local = g.call_function(aten.repeat.default, (x, [n.args[1]] + [1] * (x.meta["val"].dim() - 1)))
            elif n.target is c10d.reduce_scatter_tensor.default:
                chunk = g.call_function(aten.slice.Tensor, (x, 0, 0, x.meta["val"].shape[0] // n.args[2]))
                local = g.call_function(aten.clone.default, (chunk,))
            else:
                raise NotImplementedError(f"no local stand-in for {n.target}")
        local.meta = dict(n.meta)
        n.replace_all_uses_with(local)
        g.erase_node(n)
    g.lint()
    gm.recompile()
    return gm


def _param_bytes(args: Any) -> dict[str, int]:
    model = GPT(_cfg(args))
    total = sum(p.numel() for p in model.parameters()) * 4
    tp_sharded = 0
    # what backward reads of a block's parameters: the weights (a Linear's for its input's
    # gradient, a LayerNorm's for its input's); no bias (its gradient is the output's, summed)
    blocks_backward = sum(p.numel() for n, p in model.blocks.named_parameters() if n.endswith("weight")) * 4
    for name, p in model.named_parameters():
        if any(k in name for k in ("attn.q.", "attn.k.", "attn.v.", "fc.")) or name.endswith("attn.out.weight") or name.endswith("proj.weight"):
            tp_sharded += p.numel() * 4
    return {"total": total, "tp_sharded": tp_sharded, "blocks_backward": blocks_backward}


def analytic_min(kind: str, args: Any, world: int) -> int:
    """Bytes of collective buffers per rank per step a hand-written program needs."""
    pb = _param_bytes(args)
    act = args.batch * args.seq * args.dim * 4  # one [B, T, D] float32 activation
    if kind == "dp":  # all_reduce every gradient, and the loss
        return pb["total"] + 4
    if kind == "fsdp":  # gather parameters once (kept for backward), reduce-scatter gradients
        return 2 * pb["total"] + 4
    if kind == "fsdp_reshard":  # gather in forward, the blocks' weights again in backward (the root's kept), reduce-scatter
        return 2 * pb["total"] + pb["blocks_backward"] + 4
    if kind == "tp":  # Megatron: 2 all_reduces per block in forward and 2 in backward
        return 4 * args.layers * act
    dp = world // 2  # 2-D: TP on the local batch, then all_reduce of the local gradients over dp
    local_grads = pb["total"] - pb["tp_sharded"] + pb["tp_sharded"] // 2
    return 4 * args.layers * act // dp + local_grads + 4


def compiled_bytes(kind: str, args: Any, world: int = 4) -> tuple[int, int]:
    """(collectives, bytes) per rank per step of the compiled program on a fake world."""
    from spmd_compiler.testing import fake_mesh

    torch.manual_seed(0)
    model = GPT(_cfg(args))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    plan, shape = _plan(kind, world)
    mesh = fake_mesh(tuple(shape.values()), tuple(shape))
    step = sc.compile(train_step, mesh=mesh, plan=plan, check_ranks=False)
    ids, tg = _local_batch(kind, *_batch(0, args), world, 0)
    step(model, opt, ids, tg)
    step(model, opt, ids, tg)  # the steady step (AdamW state exists)
    s = step.comm_summary()
    import torch.distributed as dist

    dist.destroy_process_group()
    return s.total_count, s.total_bytes
