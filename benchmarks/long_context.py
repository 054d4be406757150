"""Long sequences and large vocabularies: context parallelism and loss parallelism.

Two tables (``--part static``, ``--part step``, both by default):

**Static** (compiled on ``meta``, a fake process group, explain mode: never run; the
program traced for CPU, whose SDPA is the CPU flash kernel): the torchtitan-style Llama of
tests/zoo/titan_llama.py (dim 1024, 2 layers, 8 query / 4 key-value heads, SwiGLU 2816,
float32, AdamW in its steady state). Per row: the static peak per rank
(``memory_trace``), the bytes each rank sends per step (``wire_bytes`` of every
collective), and the share of them that serves attention or the loss against its analytic
minimum.

* context parallelism, sequence 8K to 32K, one sequence per data-parallel rank, vocab 32000:
  ``cp 4`` and ``dp 2 x cp 2`` with all-gather or ring attention, next to the same mesh
  without ``Plan(context_parallel=...)`` (the sequence split, the causal attention's query
  gathered: every rank computes all of it). Analytic minimum of the attention bytes: every
  rank receives every other rank's keys and values once and sends their gradients back:
  ``2 (n - 1) / n`` of one sequence's keys and values per layer, as SDPA gets them (after
  ``repeat_kv``: as many heads as the query; gathering before the repeat would halve it for
  this model's 2 query heads per key head: not done, the rule sees SDPA's arguments). The
  all-gather variant meets it (its backward reuses the forward's gather); the ring sends
  the blocks again in backward and the gradients ``n`` times: ``(3 n - 2) / (2 n - 2)`` of it.
* loss parallelism, vocab 128256, sequence 8192, ``tp 4`` (torchtitan's Megatron plan, the
  embedding and output layer ``Shard(0)``), next to the same plan with the loss-parallel
  rules off (``expand/rules/loss_parallel.py`` taken out of the registry: the logits are
  gathered). Analytic minimum of the whole step (Megatron): ``4 L + 2`` all_reduces of one
  ``[tokens, dim]`` activation and 3 values per token, each all_reduce sending
  ``2 (n - 1) / n`` of its buffer.

**Step time** (4 gloo ranks, one thread each, small dims; ratios of paired medians, ours
over the peer, every side in one rotation):

* ``cp``: the same Llama (dim 64, 2 layers, sequence 2048, batch 1, vocab 256) with ring
  and all-gather attention against ``torch.distributed.tensor.experimental.context_parallel``
  (torch's ring attention with its head-tail load balancer; DDP reduces the gradients). On
  CPU torch dispatches SDPA to ``_scaled_dot_product_flash_attention_for_cpu``, for which
  torch's context parallelism has no handler: the peer registers that kernel with torch's
  own ``_templated_ring_attention`` (forward and backward), as torch does for the CUDA
  kernels; rotation ``allgather`` (torch's default) and ``alltoall``.
* ``lp``: embedding, RMSNorm, output layer and cross entropy (vocab 32000, dim 256, 2048
  tokens), the output layer split by vocab over 4 ranks: ours against a hand-written
  Megatron vocab-parallel cross entropy (local logits, all_reduce of the row max, of the
  sum of exponentials and of the target logit; the hidden state's gradient all-reduced).

Usage::

    python benchmarks/long_context.py [--part static step] [--seqs 8192 16384 32768]

Writes benchmarks/results/long_context.md (with the load average before and after).
"""

from __future__ import annotations

import argparse
import copy
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))  # _table.py
sys.path.insert(0, str(HERE.parent / "tests" / "zoo"))  # titan_llama.py

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.tensor import Replicate, Shard  # noqa: E402

import spmd_compiler as sc  # noqa: E402
from _table import results_path, write_results  # noqa: E402
from compile_scale import _steady_adamw  # noqa: E402  (AdamW with its state made, on meta)
from peers import _CopyToParallel  # noqa: E402  (Megatron's f)
from spmd_compiler.dump.format import format_bytes  # noqa: E402

STATIC = dict(dim=1024, n_layers=2, n_heads=8, n_kv_heads=4, hidden_dim=2816)
SMALL = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=176)
LP_VOCAB, CP_VOCAB = 128256, 32000


# ------------------------------------------------------------------ static rows
def _model(vocab: int, seq: int, cfg: dict) -> Any:
    from titan_llama import Transformer

    with torch.device("meta"):
        return Transformer(**cfg, vocab=vocab, max_seq=seq, rope_theta=500000.0)


def _vocab_params(ndim: int) -> dict:
    from titan_llama import tp_params

    rest = [Replicate()] * (ndim - 1)
    return {**tp_params(ndim), "tok_embeddings.weight": rest + [Shard(0)], "output.weight": rest + [Shard(0)]}


CP_ROWS = {
    # name -> (mesh shape, names, batch placements, context parallel or None)
    "cp 4, all-gather": ((4,), ("cp",), [Shard(1)], sc.ContextParallel(axis="cp")),
    "cp 4, ring": ((4,), ("cp",), [Shard(1)], sc.ContextParallel(axis="cp", attention="ring")),
    "cp 4, without CP": ((4,), ("cp",), [Shard(1)], None),
    "dp 2 x cp 2, all-gather": ((2, 2), ("dp", "cp"), [Shard(0), Shard(1)], sc.ContextParallel(axis="cp")),
    "dp 2 x cp 2, without CP": ((2, 2), ("dp", "cp"), [Shard(0), Shard(1)], None),
}


def _compile(model: Any, mesh: Any, plan: Any, batch: int, seq: int) -> Any:
    """Compile the step for this rank's local batch ``(batch, seq)`` (its piece of the global one)."""
    from titan_llama import train_step

    before = os.environ.get("SPMD_COMPILER_EXPLAIN")
    os.environ["SPMD_COMPILER_EXPLAIN"] = "1"  # compile only; the step part's processes must run for real
    try:
        opt = _steady_adamw(model)
        ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
        step = sc.compile(train_step, mesh=mesh, plan=plan, device_type="cpu", check_ranks=False, progress=False)
        step(model, opt, ids, ids)
        return step.last
    finally:
        if before is None:
            del os.environ["SPMD_COMPILER_EXPLAIN"]
        else:
            os.environ["SPMD_COMPILER_EXPLAIN"] = before


def _sent(step: Any, *words: str) -> int:
    return sum(n.meta["spmd_comm"]["wire_bytes"] for n in step.collectives()
               if not words or any(w in n.meta["spmd_comm"]["reason"] for w in words))


def static_cp_row(name: str, seq: int) -> dict:
    from spmd_compiler.dump.memory import memory_trace
    from spmd_compiler.testing import fake_mesh

    shape, names, placements, cp = CP_ROWS[name]
    mesh = fake_mesh(shape, names, world_size=int(torch.tensor(shape).prod()))
    dp = shape[0] if len(shape) == 2 else 1
    n = shape[-1]
    t0 = time.perf_counter()
    step = _compile(_model(CP_VOCAB, seq, STATIC), mesh, sc.Plan(default_input=placements, context_parallel=cp), 1, seq // n)
    # one sequence's keys and values as SDPA gets them, float32 (after repeat_kv: as many heads as the query)
    kv = 2 * seq * STATIC["dim"] * 4
    mem = memory_trace(step.gm)
    return {"name": name, "seq": seq, "peak": mem.peak_bytes, "above": mem.peak_bytes - mem.total_input_bytes, "sent": _sent(step),
            "attention": _sent(step, "scaled_dot_product"), "min": STATIC["n_layers"] * 2 * (n - 1) * kv // n,
            "share": _attention_share(step, seq, n), "dp": dp, "seconds": time.perf_counter() - t0}


def _attention_share(step: Any, seq: int, n: int) -> float:
    """The causal attention one rank's forward computes, as a multiple of a ``1/n`` share
    (score entries: ``rows x keys`` per kernel call, ``rows (rows + 1) / 2`` for a causal
    square one; one layer)."""
    work = 0.0
    for node in step.gm.graph.nodes:
        if node.target is torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default:
            rows, keys = node.args[0].meta["val"].shape[2], node.args[1].meta["val"].shape[2]
            work += rows * (rows + 1) / 2 if len(node.args) > 4 and node.args[4] else rows * keys
    return work / STATIC["n_layers"] / (seq * (seq + 1) / 2 / n)


def static_lp_row(loss_parallel: bool, seq: int = 8192, n: int = 4) -> dict:
    from spmd_compiler.dump.memory import memory_trace
    from spmd_compiler.expand import registry
    from spmd_compiler.testing import fake_mesh

    aten = torch.ops.aten
    off = (aten._log_softmax.default, aten._log_softmax_backward_data.default, aten.nll_loss_backward.default,
           aten.embedding_dense_backward.default)
    saved = {op: registry._RULES.pop(op) for op in off} if not loss_parallel else {}
    try:
        plan = sc.Plan(params=_vocab_params(1), default_input=[Replicate()])
        step = _compile(_model(LP_VOCAB, seq, STATIC), fake_mesh((n,), ("tp",), world_size=n), plan, 1, seq)
    finally:
        registry._RULES.update(saved)
    act = seq * STATIC["dim"] * 4
    wire = 2 * (n - 1) / n
    minimum = int(((4 * STATIC["n_layers"] + 2) * act + 3 * seq * 4) * wire)
    return {"name": "tp 4, loss parallel" if loss_parallel else "tp 4, without loss parallel (logits gathered)", "seq": seq,
            "peak": memory_trace(step.gm).peak_bytes, "sent": _sent(step), "min": minimum,
            "loss": _sent(step, "log_softmax", "nll_loss", "_log_softmax")}


# ------------------------------------------------------------------ step time (gloo)
def _torch_cp_cpu_kernel() -> None:
    """Register the CPU flash kernel with torch's context parallelism (torch's own ring
    attention, ``_templated_ring_attention``), as torch does for its CUDA kernels."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as A

    aten = torch.ops.aten
    fwd, bwd = aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_flash_attention_for_cpu_backward.default

    def ring_forward(mesh, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        return A._templated_ring_attention(mesh.get_group(), 2, fwd, query=query, key=key, value=value, is_causal=is_causal,
                                           dropout_p=dropout_p, scale=scale)

    def ring_backward(mesh, grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None):
        return A._templated_ring_attention_backward(mesh.get_group(), 2, bwd, grad_out=grad_out, grad_out_name="grad_out", query=query,
                                                    key=key, value=value, out=out, logsumexp=logsumexp, is_causal=is_causal,
                                                    dropout_p=dropout_p, scale=scale)

    maps = {fwd: ring_forward, bwd: ring_backward}
    original = A._sdpa_handler

    def handler(op_call, args, kwargs):
        if op_call not in maps:
            return original(op_call, args, kwargs)
        from torch.distributed.tensor import DTensor

        info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        out = maps[op_call](info.compute_mesh, *info.local_args, **info.local_kwargs)
        spec = info.flat_args_schema[0]
        return tuple(DTensor.from_local(o, spec.mesh, spec.placements, run_check=False) for o in out)

    A.custom_ops[fwd] = handler
    A.custom_ops[bwd] = handler


def _paired(sides: dict[str, Any], steps: int, warmup: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Every side once per round, the order rotated; the step times after ``warmup`` rounds
    (ours compiles at the first call) and each side's first loss."""
    names = list(sides)
    times: dict[str, list[float]] = {s: [] for s in names}
    first: dict[str, float] = {}
    for i in range(warmup + steps):
        order = names[i % len(names):] + names[: i % len(names)]
        for side in order:
            t0 = time.perf_counter()
            loss = sides[side](i)
            if i == 0:
                first[side] = loss
            if i >= warmup:
                times[side].append(time.perf_counter() - t0)
    return times, first


def _ratios(got: tuple, ours: list[str], peers: list[str]) -> dict:
    times, first = got
    losses = list(first.values())
    return {"median_ms": {s: statistics.median(t) * 1e3 for s, t in times.items()},
            "ratio": {f"{a} / {b}": statistics.median(x / y for x, y in zip(times[a], times[b])) for a in ours for b in peers},
            "first loss spread": (max(losses) - min(losses)) / abs(losses[0])}


def _cp_worker(rank: int, world: int, args: Any) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.nn.parallel import DistributedDataParallel
    from titan_llama import Transformer, train_step

    torch.manual_seed(0)
    seq = args.cp_seq
    model = Transformer(**SMALL, vocab=256, max_seq=seq)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    ours = {m: sc.compile(train_step, mesh=mesh, plan=sc.Plan(default_input=[Shard(1)],
                                                              context_parallel=sc.ContextParallel(axis="cp", attention=m)))
            for m in ("allgather", "ring")}
    models = {m: copy.deepcopy(model) for m in ours}
    _torch_cp_cpu_kernel()
    peers = {r: DistributedDataParallel(copy.deepcopy(model)) for r in ("allgather", "alltoall")}  # one model per side
    opts = {s: torch.optim.AdamW(m.parameters(), lr=1e-3) for s, m in {**models, **{f"torch {r}": p for r, p in peers.items()}}.items()}
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 256, (1, seq), generator=g), torch.randint(0, 256, (1, seq), generator=g)) for _ in range(64)]
    cp = sc.ContextParallel(axis="cp")

    def run_ours(method: str, i: int) -> None:
        ids, tg = batches[i % len(batches)]
        return ours[method](models[method], opts[method], cp.shard(ids, 1, rank, world), cp.shard(tg, 1, rank, world)).item()

    def run_torch(rotate: str, i: int) -> None:
        ids, tg = (t.clone() for t in batches[i % len(batches)])
        set_rotate_method(rotate)
        peer = peers[rotate]
        freqs = peer.module.freqs_cis
        with context_parallel(mesh, buffers=[ids, tg, freqs], buffer_seq_dims=[1, 1, 0], no_restore_buffers={ids, tg}):
            local = train_step(peer, opts[f"torch {rotate}"], ids, tg).detach()
        dist.all_reduce(local)  # each rank's mean over its tokens (equal counts): their average is the global mean
        return local.item() / world

    sides = {"ours all-gather": lambda i: run_ours("allgather", i), "ours ring": lambda i: run_ours("ring", i),
             "torch CP allgather": lambda i: run_torch("allgather", i), "torch CP alltoall": lambda i: run_torch("alltoall", i)}
    times = _paired(sides, args.steps, args.warmup)
    return _ratios(times, ["ours all-gather", "ours ring"], ["torch CP allgather", "torch CP alltoall"])


class _Head(nn.Module):
    """Embedding, RMSNorm, output layer: the loss end of a language model."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(self.tok(ids)))


def _lm_step(model: nn.Module, optimizer: Any, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(ids).flatten(0, 1).float(), targets.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's vocab-parallel cross entropy (mean over tokens)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, start: int) -> torch.Tensor:
        top = logits.max(dim=-1)[0]
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        shifted = logits - top.unsqueeze(-1)
        local = target - start
        outside = (local < 0) | (local >= logits.shape[-1])
        local = local.masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(picked)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(total)
        ctx.save_for_backward(exp.div_(total.unsqueeze(-1)), local, outside)
        return (total.log() - picked).mean()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        softmax, local, outside = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local.unsqueeze(-1), -(~outside).to(g.dtype).unsqueeze(-1))
        return g * (grad / local.numel()), None, None


class _MegatronHead(nn.Module):
    def __init__(self, head: _Head, rank: int, world: int) -> None:
        super().__init__()
        self.tok, self.norm = head.tok, head.norm
        self.weight = nn.Parameter(head.output.weight.detach().chunk(world, 0)[rank].clone())
        self.start = rank * self.weight.shape[0]

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = _CopyToParallel.apply(self.norm(self.tok(ids)))
        logits = F.linear(h, self.weight).flatten(0, 1).float()
        return _VocabParallelCrossEntropy.apply(logits, targets.flatten(), self.start)


def _lp_worker(rank: int, world: int, args: Any) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    head = _Head(args.lp_vocab, args.lp_dim)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ours = sc.compile(_lm_step, mesh=mesh, plan=sc.Plan(params={"output.weight": [Shard(0)]}, default_input=[Replicate()]))
    mine = copy.deepcopy(head)
    peer = _MegatronHead(copy.deepcopy(head), rank, world)
    opts = {"ours": torch.optim.AdamW(mine.parameters(), lr=1e-3), "megatron": torch.optim.AdamW(peer.parameters(), lr=1e-3)}
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, args.lp_vocab, (1, args.lp_tokens), generator=g),) * 2 for _ in range(16)]

    def run_peer(i: int) -> None:
        ids, tg = batches[i % len(batches)]
        loss = peer.loss(ids, tg)
        loss.backward()
        opts["megatron"].step()
        opts["megatron"].zero_grad()
        return loss.item()

    sides = {"ours": lambda i: ours(mine, opts["ours"], *batches[i % len(batches)]).item(), "megatron": run_peer}
    return _ratios(_paired(sides, args.steps, args.warmup), ["ours"], ["megatron"])


# ------------------------------------------------------------------ main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", nargs="+", default=["static", "step"], choices=["static", "step"])
    p.add_argument("--seqs", nargs="+", type=int, default=[8192, 16384, 32768])
    p.add_argument("--rows", nargs="+", default=list(CP_ROWS), choices=list(CP_ROWS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cp-seq", type=int, default=2048)
    p.add_argument("--lp-vocab", type=int, default=32000)
    p.add_argument("--lp-dim", type=int, default=256)
    p.add_argument("--lp-tokens", type=int, default=2048)
    p.add_argument("--out", default=str(results_path("long_context")))
    args = p.parse_args()
    load = [os.getloadavg()[0]]
    lines = [f"# Long context: context parallelism and loss parallelism\n",
             f"`python benchmarks/long_context.py --part {' '.join(args.part)}` on {platform.machine()}, {os.cpu_count()} cores, "
             f"torch {torch.__version__}. See the script's docstring for the model, plans and minima.\n"]
    if "static" in args.part:
        lines += ["## Static peak and bytes per rank per step (compiled on meta, fake process group)\n",
                  f"Llama-style: {STATIC}, vocab {CP_VOCAB} (context parallel rows) / {LP_VOCAB} (loss parallel rows), float32, AdamW.\n",
                  "| plan | sequence | static peak / rank | of it above the inputs | causal attention / rank (x 1/n) | sent / rank / step | "
                  "of it attention | attention minimum | attention / minimum |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for seq in args.seqs:
            for name in args.rows:
                r = static_cp_row(name, seq)
                lines.append(f"| {name} | {seq} | {format_bytes(r['peak'])} | {format_bytes(r['above'])} | {r['share']:.2f} | "
                             f"{format_bytes(r['sent'])} | {format_bytes(r['attention'])} | {format_bytes(r['min'])} | "
                             f"{r['attention'] / r['min']:.2f} |")
                print(lines[-1], flush=True)
        lines += ["", "| plan | sequence | static peak / rank | sent / rank / step | of it the loss's | Megatron minimum (whole step) | sent / minimum |",
                  "|---|---|---|---|---|---|---|"]
        for lp in (True, False):
            r = static_lp_row(lp)
            lines.append(f"| {r['name']} | {r['seq']} | {format_bytes(r['peak'])} | {format_bytes(r['sent'])} | {format_bytes(r['loss'])} | "
                         f"{format_bytes(r['min'])} | {r['sent'] / r['min']:.2f} |")
            print(lines[-1], flush=True)
        lines.append("")
    if "step" in args.part:
        from spmd_compiler.runtime.launch import run_processes

        cp = run_processes(_cp_worker, 4, args, timeout=3600)[0]
        lp = run_processes(_lp_worker, 4, args, timeout=3600)[0]
        lines += ["## Step time on 4 gloo ranks (paired medians, ours / peer)\n",
                  f"cp: Llama {SMALL}, sequence {args.cp_seq}, batch 1, vocab 256. lp: vocab {args.lp_vocab}, dim {args.lp_dim}, "
                  f"{args.lp_tokens} tokens. {args.warmup} warm-up steps, {args.steps} timed, every side in one rotation.\n",
                  "| part | side | median ms |", "|---|---|---|"]
        for part, got in (("cp", cp), ("lp", lp)):
            lines += [f"| {part} | {side} | {ms:.1f} |" for side, ms in got["median_ms"].items()]
        lines += ["", "| part | ours / peer | paired median ratio |", "|---|---|---|"]
        for part, got in (("cp", cp), ("lp", lp)):
            lines += [f"| {part} | {pair} | {ratio:.2f} |" for pair, ratio in got["ratio"].items()]
        lines += ["", f"First-step losses of all sides agree to {cp['first loss spread']:.1e} (cp) and {lp['first loss spread']:.1e} "
                      f"(lp), relative: every side starts from the same weights and batch."]
        lines.append("")
    load.append(os.getloadavg()[0])
    lines.append(f"Load average (1 min) before {load[0]:.2f}, after {load[1]:.2f}.")
    write_results(args.out, lines)


if __name__ == "__main__":
    main()
