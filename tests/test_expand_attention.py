"""Scaled dot-product attention on shards (spmd_compiler/expand/rules/attention.py) and
the replicate fallback's layouts (spmd_compiler/expand/layout.py).

The CPU kernel's cases train 3 AdamW steps in float64 on all simulated ranks and compare
loss and parameters with one device (atol 1e-9, rtol 1e-7), then check which collectives
the attention op caused. That covers the numerics of the rule every kernel shares.

The CUDA kernels (flash, efficient, cuDNN) cannot run without a GPU; their cases trace
each kernel and its backward on fake CUDA tensors (their meta kernels give the shapes)
and check only structure: which collectives the expansion emits, the placements of every
output, and local shapes. Their numerics on a GPU are not tested here.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import spmd_compiler as sc
from spmd_compiler.expand import ExpansionCache, registry
from spmd_compiler.expand.expander import expand_graph
from spmd_compiler.expand.layout import stride_order
from spmd_compiler.expand.values import DSymInt, MeshContext, placements_text
from spmd_compiler.testing import assert_distributed, assert_training_matches, fake_mesh
from spmd_compiler.trace.tracer import GraphInput

aten = torch.ops.aten
SDPA = aten._scaled_dot_product_flash_attention_for_cpu.default
SDPA_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class SelfAttention(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 4, causal: bool = True, mask: bool = False, seq: int = 8, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads, self.causal, self.dropout = heads, causal, dropout
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))
        # an additive float mask broadcast over batch and heads (padding-like)
        self.register_buffer("mask", torch.randn(seq, seq).double() if mask else None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, is_causal=self.causal, dropout_p=self.dropout)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


def step(model, optimizer, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def batches(n=3, batch=4, seq=8, dim=16):
    return [(torch.randn(batch, seq, dim, dtype=torch.float64), torch.randn(batch, seq, dim, dtype=torch.float64)) for _ in range(n)]


def attention_collectives(res) -> list[str]:
    """Collectives emitted for the attention ops' inputs, on every rank."""
    out = []
    for e in res.sim.expansions.values():
        for n in e.collectives():
            reason = n.meta["spmd_comm"]["reason"]
            if "scaled_dot_product" in reason:
                out.append(f"{n.meta['spmd_comm']['kind']}: {reason}")
    return out


def sdpa_nodes(res, op=SDPA):
    step = res.sim.expansions[next(iter(res.sim.expansions))]
    return [n for n in step.gm.graph.nodes if n.target is op]


@pytest.mark.parametrize("causal,mask", [(True, False), (False, True)])
def test_batch_shard_stays_local(mesh4, causal, mask):
    model = SelfAttention(causal=causal, mask=mask).double()
    res = assert_training_matches(step, model, adamw, batches(), mesh4)
    assert attention_collectives(res) == []
    assert_distributed(res, sharded=["batch[0]"], collectives={"forward/all_gather": 0, "forward/all_reduce": 0})
    (fwd,) = sdpa_nodes(res)
    assert fwd.args[0].meta["val"].shape[0] == 1  # batch 4 over 4 ranks


def test_head_shard_stays_local():
    mesh = fake_mesh((2,), ("tp",))
    plan = sc.Plan(params={"[qkv].weight": [Shard(0)], "[qkv].bias": [Shard(0)], "out.weight": [Shard(1)]}, default_input=[Replicate()])
    res = assert_training_matches(step, SelfAttention().double(), adamw, batches(), mesh, plan)
    assert attention_collectives(res) == []
    assert_distributed(res, sharded=["q.weight", "out.weight"])
    (fwd,) = sdpa_nodes(res)
    assert fwd.args[0].meta["val"].shape[1] == 2  # 4 heads over 2 ranks
    (bwd,) = sdpa_nodes(res, SDPA_BACKWARD)
    assert bwd.args[1].meta["val"].shape[1] == 2


def test_batch_and_heads_on_a_2d_mesh(mesh2x2):
    plan = sc.Plan(params={"[qkv].weight": [Replicate(), Shard(0)], "[qkv].bias": [Replicate(), Shard(0)], "out.weight": [Replicate(), Shard(1)]})
    res = assert_training_matches(step, SelfAttention().double(), adamw, batches(), mesh2x2, plan)
    assert attention_collectives(res) == []
    (fwd,) = sdpa_nodes(res)
    assert tuple(fwd.args[0].meta["val"].shape[:2]) == (2, 2)


@pytest.mark.parametrize("causal,mask", [(False, False), (True, False), (False, True)])
def test_sequence_shard(causal, mask):
    """A query split by rows attends to gathered keys/values (a mask split by the same
    rows); with is_causal the rows' global positions matter, so the query is gathered too."""
    mesh = fake_mesh((2,), ("sp",))
    plan = sc.Plan(default_input=[Shard(1)])
    res = assert_training_matches(step, SelfAttention(causal=causal, mask=mask).double(), adamw, batches(), mesh, plan)
    gathered = attention_collectives(res)
    (fwd,) = sdpa_nodes(res)
    q_rows, k_rows = fwd.args[0].meta["val"].shape[2], fwd.args[1].meta["val"].shape[2]
    if causal:
        assert (q_rows, k_rows) == (8, 8)
        assert any("query of" in g for g in gathered), gathered
    else:
        assert (q_rows, k_rows) == (4, 8)  # rows stay split, keys whole
        assert gathered and not any("query of" in g for g in gathered), gathered
        assert all(g.startswith("all_gather") or "backward" in g for g in gathered), gathered
        assert not any("attn_mask" in g for g in gathered), gathered  # the mask's rows stay split


def test_dropout_stays_sharded_and_exact():
    """With dropout and gradients, CPU SDPA is traced as its math path (no fused kernel):
    matmuls, softmax and a ``native_dropout`` of the attention weights, which draws the
    single-device numbers on shards (expand/rules/random.py). Heads stay split: the only
    collective is the Megatron forward all_reduce."""
    mesh = fake_mesh((2,), ("tp",))
    plan = sc.Plan(params={"[qkv].weight": [Shard(0)], "[qkv].bias": [Shard(0)], "out.weight": [Shard(1)]}, default_input=[Replicate()])
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    res = assert_training_matches(step, SelfAttention(causal=False, dropout=0.3).double(), sgd, batches(n=1), mesh, plan)
    assert_distributed(res, collectives={"all_gather": 0, "forward/all_reduce": 1})
    traced = next(iter(res.sim.expansions.values())).traced.gm.graph
    assert aten.native_dropout.default in {n.target for n in traced.nodes} and not sdpa_nodes(res)


def test_fallback_keeps_traced_layout(mesh4, monkeypatch):
    """Without the attention rule the op falls back to whole tensors; the gathered
    query is contiguous, and the traced ``view`` after ``transpose(1, 2)`` needs the
    traced (batch, seq, heads, dim) layout of the output back (issue #16)."""
    for op in (SDPA, SDPA_BACKWARD):
        monkeypatch.delitem(registry._RULES, op)
    res = assert_training_matches(step, SelfAttention().double(), adamw, batches(), mesh4)
    fallback = [n for e in res.sim.expansions.values() for n in e.gm.graph.nodes if "spmd_fallback" in n.meta]
    assert {n.target for n in fallback} == {SDPA, SDPA_BACKWARD}
    assert attention_collectives(res)  # the fallback gathers


def test_stride_order():
    t = torch.empty(2, 3, 4, 5).transpose(1, 2)
    assert stride_order(t.shape, t.stride()) == [0, 2, 1, 3]
    assert stride_order((2, 3), (3, 1)) == [0, 1]
    assert stride_order((2, 3), (0, 1)) is None  # expanded: not dense


# ---------------------------------------------------------------------- CUDA kernels
FLASH, FLASH_BACKWARD = aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_flash_attention_backward.default
EFFICIENT = aten._scaled_dot_product_efficient_attention.default
EFFICIENT_BACKWARD = aten._scaled_dot_product_efficient_attention_backward.default
CUDNN, CUDNN_BACKWARD = aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_cudnn_attention_backward.default


# each kernel and its backward with the arguments autograd passes (derivatives.yaml)
def _flash(q, k, v, go, bias, causal, p):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = FLASH(q, k, v, p, causal)
    return out, lse, *FLASH_BACKWARD(go, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, p, causal, seed, offset)


def _efficient(q, k, v, go, bias, causal, p):
    out, lse, seed, offset = EFFICIENT(q, k, v, bias, True, p, causal)
    grads = EFFICIENT_BACKWARD(go, q, k, v, bias, out, lse, seed, offset, p, [True, True, True, bias is not None], causal)
    return out, lse, *grads


def _cudnn(q, k, v, go, bias, causal, p):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = CUDNN(q, k, v, bias, True, p, causal)
    return out, lse, *CUDNN_BACKWARD(go, q, k, v, out, lse, seed, offset, bias, cum_q, cum_k, max_q, max_k, p, causal)


KERNELS = {"flash": (_flash, FLASH, FLASH_BACKWARD), "efficient": (_efficient, EFFICIENT, EFFICIENT_BACKWARD),
           "cudnn": (_cudnn, CUDNN, CUDNN_BACKWARD)}


def cuda_expansion(kernel, mesh, placements, *, heads=4, kv_heads=4, seq=64, bias=None, causal=False, p=0.0, symbolic=False,
                   fallback="replicate", cp=None):
    """Trace ``kernel`` forward and backward on fake CUDA float16 tensors (batch 4, head dim
    8) and expand it for rank 0 with q, k, v and grad_out placed as ``placements`` and the
    bias (``(4, heads, seq, seq)`` or ``(1, ...)`` when given) Replicate, ``cp`` the mesh's
    context-parallel layout (``plan.context.CPLayout``). ``symbolic``:
    trace sizes as symbols, as ``spmd_compiler.trace`` does (on ``meta`` tensors: the
    symbolic tracer makes its own fake tensors, and CUDA ones need a CUDA build)."""
    shapes = {"q": (4, heads, seq, 8), "k": (4, kv_heads, seq, 8), "v": (4, kv_heads, seq, 8), "go": (4, heads, seq, 8)}
    if bias is not None:
        shapes["bias"] = (bias, heads, seq, seq)
    fn = KERNELS[kernel][0]
    traced_fn = lambda *a: fn(*a[:4], a[4] if bias else None, causal, p)  # noqa: E731
    if symbolic:
        vals = [torch.empty(s, device="meta", dtype=torch.float16) for s in shapes.values()]
        gm = make_fx(traced_fn, tracing_mode="symbolic")(*vals)
    else:
        with FakeTensorMode():
            vals = [torch.empty(s, device="cuda", dtype=torch.float16) for s in shapes.values()]
            gm = make_fx(traced_fn)(*vals)
    inputs = [GraphInput("batch", name, tuple(t.shape), tuple(t.stride()), t.dtype, index=i, device=t.device)
              for i, (name, t) in enumerate(zip(shapes, vals))]
    for node, inp in zip(gm.graph.find_nodes(op="placeholder"), inputs):
        node.meta["spmd_input"] = inp
    traced = type("Traced", (), {"gm": gm, "inputs": inputs})
    planned = [[Replicate()] * mesh.ndim if i.name == "bias" else placements for i in inputs]
    return expand_graph(traced, MeshContext.of(mesh, (0,) * mesh.ndim, cp=cp), planned, cache=ExpansionCache(), fallback=fallback)


def comms(ex) -> list[str]:
    return [f"{n.meta['spmd_comm']['kind']}: {n.meta['spmd_comm']['reason']}" for n in ex.graph.nodes if "spmd_comm" in n.meta]


def results(ex, op) -> list:
    """The traced ``op`` node's result: (placements, local shape) per tensor, other values as they are."""
    (value,) = [v for n, v in ex.env.items() if n.op == "call_function" and n.target is op]
    return [(placements_text(v.spec.placements), tuple(v.local.shape)) if hasattr(v, "spec") else v for v in value]


def local_call(ex, op) -> dict:
    (node,) = [n for n in ex.graph.nodes if n.target is op]
    return dict(zip([a.name for a in op._schema.arguments], node.args))


def test_roles_name_every_tensor_argument_and_output():
    """The rule's table matches this torch's schemas: every kernel is registered, every
    role names an argument, every tensor argument and row count has a role, one role per
    output."""
    from spmd_compiler.expand.rules import attention

    assert {op for op in attention._ROLES} == {SDPA, SDPA_BACKWARD, *(op for _, *ops in KERNELS.values() for op in ops)}
    for op, (name, roles, out_roles) in attention._ROLES.items():
        args = {a.name: str(a.type) for a in op._schema.arguments}
        assert set(roles) <= set(args), name
        assert {n for n, t in args.items() if "Tensor" in t} == {n for n, r in roles.items() if r not in ("max_q", "max_k")}, name
        assert {n for n in ("max_q", "max_k") if n in args} == {n for n, r in roles.items() if r in ("max_q", "max_k")}, name
        assert len(out_roles) == len(op._schema.returns), name


LAYOUTS = {"batch": ((4,), [Shard(0)], (1, 4)), "heads": ((2,), [Shard(1)], (4, 2)), "2d": ((2, 2), [Shard(0), Shard(1)], (2, 2))}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_cuda_kernels_keep_batch_and_head_shards_local(kernel, layout, causal):
    shape, placements, (b, h) = LAYOUTS[layout]
    ex = cuda_expansion(kernel, fake_mesh(shape), placements, causal=causal)
    assert comms(ex) == []
    _, fwd, bwd = KERNELS[kernel]
    pl = placements_text(placements)
    lse = {"flash": (b, h, 64), "efficient": (b, h, 64), "cudnn": (b, h, 64, 1)}[kernel]
    assert results(ex, fwd)[:2] == [(pl, (b, h, 64, 8)), (pl, lse)]
    assert results(ex, bwd)[:3] == [(pl, (b, h, 64, 8))] * 3
    assert local_call(ex, bwd)["query"].meta["val"].shape == (b, h, 64, 8)
    if kernel != "efficient":
        assert results(ex, fwd)[4:6] == [64, 64]  # max_q, max_k: rows are whole


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_cuda_sequence_shard_gathers_key_and_value(kernel, causal):
    """Query rows split: keys/values gathered, output and logsumexp split by rows,
    key/value gradients Partial(sum). ``is_causal`` masks by local row numbers, so there
    the query is gathered too and nothing stays split."""
    ex = cuda_expansion(kernel, fake_mesh((2,), ("sp",)), [Shard(2)], causal=causal)
    _, fwd, bwd = KERNELS[kernel]
    gathered = sorted(c.split(" of ")[0] for c in comms(ex))
    out, lse = results(ex, fwd)[:2]
    grads = results(ex, bwd)[:3]
    if causal:
        assert gathered == ["all_gather: grad_out" + ("_" if kernel == "efficient" else ""), *["all_gather: key"] * 2,
                            *["all_gather: query"] * 2, *["all_gather: value"] * 2]
        assert out == ("R", (4, 4, 64, 8)) and grads == [("R", (4, 4, 64, 8))] * 3
        rows = 64
    else:
        assert gathered == ["all_gather: key"] * 2 + ["all_gather: value"] * 2
        assert out == ("S(2)", (4, 4, 32, 8)) and lse[0] == "S(2)" and lse[1][2] == 32
        assert grads == [("S(2)", (4, 4, 32, 8)), ("P(sum)", (4, 4, 64, 8)), ("P(sum)", (4, 4, 64, 8))]
        rows = 32
    if kernel != "efficient":
        max_q = results(ex, fwd)[4]
        assert max_q == (DSymInt(64, 32, (0,)) if not causal else 64)
        assert (local_call(ex, bwd)["max_q"], local_call(ex, bwd)["max_k"]) == (rows, 64)  # this rank's rows


def test_efficient_sequence_shard_needs_whole_logsumexp_blocks():
    """The efficient kernel pads logsumexp rows to a multiple of 32: 16 rows per rank
    would not line up with the global rows, so the query is gathered."""
    ex = cuda_expansion("efficient", fake_mesh((2,), ("sp",)), [Shard(2)], seq=32)
    assert any(c.startswith("all_gather: query of") for c in comms(ex)), comms(ex)
    assert results(ex, EFFICIENT)[:2] == [("R", (4, 4, 32, 8)), ("R", (4, 4, 32))]


@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
def test_cuda_grouped_kv_heads(kernel):
    """4 query heads over 2 key/value heads: split by 2 each rank keeps a whole group;
    split by 4 a key head would be cut, so heads are gathered."""
    _, fwd, bwd = KERNELS[kernel]
    ex = cuda_expansion(kernel, fake_mesh((2,)), [Shard(1)], kv_heads=2)
    assert comms(ex) == []
    assert local_call(ex, fwd)["key"].meta["val"].shape == (4, 1, 64, 8)
    assert results(ex, bwd)[:3] == [("S(1)", (4, 2, 64, 8)), ("S(1)", (4, 1, 64, 8)), ("S(1)", (4, 1, 64, 8))]
    ex = cuda_expansion(kernel, fake_mesh((4,)), [Shard(1)], kv_heads=2)
    assert comms(ex) and all(c.startswith("all_gather") for c in comms(ex))
    assert results(ex, bwd)[:3] == [("R", (4, 4, 64, 8)), ("R", (4, 2, 64, 8)), ("R", (4, 2, 64, 8))]


@pytest.mark.parametrize("bias,dim", [(4, 0), (4, 1), (4, 2), (1, 0), (1, 1)])
def test_efficient_attention_bias(bias, dim):
    """A replicated bias is narrowed like the query (no collective); its gradient is
    sharded like it, or Partial(sum) where the bias is broadcast over the split dim."""
    ex = cuda_expansion("efficient", fake_mesh((2,)), [Shard(dim)], bias=bias)
    assert [c for c in comms(ex) if "bias" in c or "query" in c] == []
    local = local_call(ex, EFFICIENT)["attn_bias"].meta["val"].shape
    grad_bias = results(ex, EFFICIENT_BACKWARD)[3]
    if bias == 1 and dim == 0:
        assert local == (1, 4, 64, 64) and grad_bias == ("P(sum)", (1, 4, 64, 64))
    else:
        shape = [bias, 4, 64, 64]
        shape[dim] //= 2
        assert local == tuple(shape) and grad_bias == (f"S({dim})", tuple(shape))


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_cuda_dropout_runs_on_whole_tensors(kernel, caplog):
    """A kernel with dropout draws its mask inside: on a shard it would draw other numbers
    than one device (DTensor's strategies keep the batch split), so it runs whole, with a
    warning."""
    _, fwd, bwd = KERNELS[kernel]
    ex = cuda_expansion(kernel, fake_mesh((2,)), [Shard(0)], p=0.1)
    assert f"{fwd} runs on gathered inputs: dropout inside attention" in caplog.text
    with pytest.raises(sc.UnsupportedOpError, match="would run on gathered inputs: dropout"):
        cuda_expansion(kernel, fake_mesh((2,)), [Shard(0)], p=0.1, fallback="error")
    assert {n.target for n in ex.graph.nodes if "dropout" in n.meta.get("spmd_fallback", "")} == {fwd, bwd}
    assert results(ex, fwd)[0] == ("R", (4, 4, 64, 8))


@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
def test_cuda_symbolic_row_counts(kernel):
    """Traced with symbolic sizes, the backward's ``max_q`` is ``q.size(2)``, a DSymInt of
    the sequence-split query: the local kernel gets this rank's rows."""
    _, fwd, bwd = KERNELS[kernel]
    ex = cuda_expansion(kernel, fake_mesh((2,), ("sp",)), [Shard(2)], symbolic=True)
    assert [n.target for n in ex.traced.gm.graph.nodes if n.target is aten.sym_size.int]  # the symbolic path
    assert (local_call(ex, bwd)["max_q"], local_call(ex, bwd)["max_k"]) == (32, 64)
    assert results(ex, bwd)[:3] == [("S(2)", (4, 4, 32, 8)), ("P(sum)", (4, 4, 64, 8)), ("P(sum)", (4, 4, 64, 8))]


class FlashAttention(nn.Module):
    """Self-attention calling the CUDA flash kernel directly (autograd adds its backward)."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        return self.out(FLASH(q, k, v)[0].transpose(1, 2).reshape(b, t, d))


def test_cuda_kernel_compiles_whole_step_on_meta(monkeypatch):
    """The whole pipeline (trace with symbolic sizes, autograd's backward call, expand,
    rebuild, passes) on ``meta`` tensors, compile only: a sequence-split batch gathers
    key and value once (backward reuses the forward's gathers) and the backward kernel
    gets this rank's 32 of 64 rows."""
    monkeypatch.setenv("SPMD_COMPILER_EXPLAIN", "1")  # compile, never run
    with torch.device("meta"):
        model = FlashAttention().half()
    x = torch.empty(4, 32, 32, device="meta", dtype=torch.float16)  # this rank's half of 64 rows
    def square_step(model, optimizer, x):  # mse_loss on meta warns about broadcast_tensors' autograd
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    step_fn = sc.compile(square_step, mesh=fake_mesh((2,), ("sp",)), plan=sc.Plan(default_input=[Shard(1)]))
    step_fn(model, torch.optim.SGD(model.parameters(), lr=0.1), x)
    gathered = sorted(n.meta["spmd_comm"]["reason"].split(" of ")[0] for n in step_fn.last.collectives()
                      if "scaled_dot_product" in n.meta["spmd_comm"]["reason"])
    assert gathered == ["key", "value"]
    (bwd,) = [n for n in step_fn.last.gm.graph.nodes if n.target is FLASH_BACKWARD]
    assert bwd.args[1].meta["val"].shape == (4, 4, 32, 8) and bwd.args[8] == 32  # query rows, max_q
