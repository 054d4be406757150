"""No stage hard-codes a device: compile with every parameter, buffer and batch tensor on
the ``meta`` device and check that every value of every produced graph is on it.

A stage that made a tensor on the CPU by default (``torch.empty(shape)``) or by name
(``device="cpu"``) shows up here as a CPU value, or as a fake-tensor device error; on a
GPU the same bug mixes cuda and cpu tensors. The one exception is a host scalar: the
learning rate and other hyperparameters are 0-d float64 CPU tensors read with ``.item()``
(as torch's own optimizers allow), and so is the step count torch's optimizers keep on the
CPU (``torch.tensor(0.0)`` for a non-capturable Adam): 0-d host numbers, never device data.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

import spmd_compiler as sc
from spmd_compiler.testing.mesh import fake_mesh
from spmd_compiler.testing.models import GPT, gpt_2d_plan, gpt_fsdp_plan, gpt_tp_plan, train_step

DEVICE = torch.device("meta")


def _off_device(gm) -> list[str]:
    bad = []
    for node in gm.graph.nodes:
        inp = node.meta.get("spmd_input")
        if node.op == "placeholder" and inp is not None and inp.kind == "hparam":
            continue  # host scalar (lr): CPU by design
        for v in pytree.tree_leaves(node.meta.get("val")):
            if isinstance(v, torch.Tensor) and v.device != DEVICE and not (v.device.type == "cpu" and v.dim() == 0):
                bad.append(f"{node.format_node()} on {v.device}")
    return bad


def _model(fused: bool = False):
    with DEVICE:
        model = GPT(vocab=64, seq=8, dim=32, heads=4, layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused or None)
    ids = torch.randint(0, 64, (8, 8), device=DEVICE)
    return model, opt, ids


PLANS = {
    "dp": ((4,), ("dp",), lambda: sc.Plan()),
    "fsdp": ((4,), ("dp",), gpt_fsdp_plan),
    "tp": ((4,), ("tp",), gpt_tp_plan),
    "2d": ((2, 2), ("dp", "tp"), gpt_2d_plan),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_every_graph_value_stays_on_the_model_device(name, monkeypatch):
    monkeypatch.setenv("SPMD_COMPILER_EXPLAIN", "1")  # compile, never run
    shape, names, plan = PLANS[name]
    model, opt, ids = _model()
    step = sc.compile(train_step, mesh=fake_mesh(shape, names), plan=plan())
    loss = step(model, opt, ids[: 8 // shape[0]], ids[: 8 // shape[0]])
    assert loss.device == DEVICE
    assert step.last.collectives(), "nothing was distributed"
    assert _off_device(step.last.traced.gm) == []
    assert _off_device(step.last.gm) == []
    assert all(p.device_mesh == step.mesh for p in model.parameters())
    assert all(p.to_local().device == DEVICE for p in model.parameters())


def test_pipeline_stages_stay_on_the_model_device(monkeypatch):
    monkeypatch.setenv("SPMD_COMPILER_EXPLAIN", "1")
    model, opt, ids = _model()
    step = sc.compile(train_step, mesh=fake_mesh((2, 2), ["pp", "tp"]), plan=gpt_tp_plan(),
                      pipeline=sc.Pipeline(chunks=2, schedule="1F1B", split={"blocks.1": sc.SplitPoint.BEGINNING}))
    loss = step(model, opt, ids, ids)
    assert loss.device == DEVICE
    assert _off_device(step.last.gm) == []
    for piece in step.last.pipeline.program.pieces.values():
        assert _off_device(piece.gm) == [], (piece.stage, piece.kind)


def _ops(traced) -> list[tuple[str, str]]:
    return [(str(n.target), n.meta["spmd_phase"]) for n in traced.gm.graph.nodes if n.op == "call_function"]


def _clipped_step(model, optimizer, ids, targets):
    """train_step with torchtitan's foreach clipping (torch refuses foreach=True on meta)."""
    loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0, foreach=True)
    optimizer.step()
    optimizer.zero_grad()
    return loss


@pytest.mark.parametrize("step_fn", [train_step, _clipped_step], ids=["cross_entropy", "foreach_clip"])
def test_a_meta_trace_is_the_cpu_trace(step_fn):
    """On meta, torch's Python meta kernel of aten.nll_loss used to hide its autograd
    (backward only warned, no gradient, AdamW updated nothing): the same step on meta and
    on CPU trace the same ops, phase by phase, backward and update included."""
    traces = []
    for device in ("cpu", "meta"):
        torch.manual_seed(0)
        with torch.device(device):
            model = GPT(vocab=64, seq=8, dim=32, heads=4, layers=2)
        ids = torch.randint(0, 64, (8, 8)).to(device)
        traces.append(_ops(sc.trace(step_fn, model, torch.optim.AdamW(model.parameters(), lr=1e-3), ids, ids)))
    cpu, meta = traces
    assert {p for _, p in cpu} >= {"forward", "backward", "optimizer"}
    assert meta == cpu


def _no_autograd_op():
    lib = torch.library.Library("spmd_test_devices", "FRAGMENT")
    lib.define("scaled(Tensor x) -> Tensor")
    lib.impl("scaled", lambda x: x * 2, "CPU")
    lib.impl("scaled", lambda x: torch.empty_like(x), "Meta")
    return lib, torch.ops.spmd_test_devices.scaled.default


def test_a_backward_through_an_op_without_autograd_is_an_error():
    """torch skips such an op's gradient and only warns: the compiled step would not train."""
    lib, scaled = _no_autograd_op()
    model = torch.nn.Linear(4, 4)

    def step(model, optimizer, x):
        loss = scaled(model(x)).sum()
        loss.backward()
        optimizer.step()
        return loss

    with pytest.raises(sc.IncompleteStepError, match=r"spmd_test_devices::scaled.*no autograd kernel") as e:
        sc.trace(step, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 4))
    assert "loss.backward()" in str(e.value) and "fix:" in str(e.value)
    del lib


def test_an_update_without_gradients_is_an_error():
    model = torch.nn.Linear(4, 4)

    def step(model, optimizer, x):
        loss = model(x).sum()
        optimizer.step()  # no backward()
        return loss

    with pytest.raises(sc.IncompleteStepError, match=r"optimizer.step\(\) found no gradient on any of its 2 parameters") as e:
        sc.trace(step, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(2, 4))
    assert "optimizer.step()  # no backward()" in str(e.value)


class _Attention(torch.nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4, mask: bool = False) -> None:
        super().__init__()
        self.heads, self.qkv, self.out = heads, torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mask = mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        m = torch.ones(s, s, dtype=torch.bool, device=x.device).tril() if self.mask else None
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=not self.mask)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


def _mse_step(model, optimizer, x):
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _attention_ops(device, dtype=torch.float32, mask=False, device_type=None):
    torch.manual_seed(0)
    with torch.device(device):
        model = _Attention(mask=mask).to(dtype)
    x = torch.randn(2, 16, 64, dtype=dtype).to(device)
    return _ops(sc.trace(_mse_step, model, torch.optim.SGD(model.parameters(), lr=0.1), x, device_type=device_type))


@pytest.mark.parametrize("mask", [False, True])
def test_sdpa_on_meta_for_cpu_is_the_cpu_kernel(mask):
    def no_sizes(ops):  # where the C++ composite reads a size differs; the sizes do not
        return [op for op in ops if op[0] != "aten.sym_size.int"]

    assert no_sizes(_attention_ops("meta", mask=mask, device_type="cpu")) == no_sizes(_attention_ops("cpu", mask=mask))
    assert ("aten._scaled_dot_product_flash_attention_for_cpu.default", "forward") in _attention_ops("cpu", mask=mask)


@pytest.mark.parametrize("dtype,mask,kernel", [
    (torch.float32, False, "_scaled_dot_product_efficient_attention"),
    (torch.float32, True, "_scaled_dot_product_efficient_attention"),
    (torch.bfloat16, False, "_scaled_dot_product_flash_attention"),
    (torch.float64, False, None),  # CUDA runs float64 on the math path
])
def test_sdpa_on_meta_for_cuda_is_the_cuda_kernel(dtype, mask, kernel):
    """Not the math path meta takes by itself (sequence x sequence scores, which no fused
    kernel holds): the kernel a sm80+ GPU runs, forward and backward."""
    ops = {op for op, _ in _attention_ops("meta", dtype, mask, device_type="cuda")}
    if kernel is None:
        assert "aten.bmm.default" in ops and not any("_scaled_dot_product" in op for op in ops)
    else:
        assert {f"aten.{kernel}.default", f"aten.{kernel}_backward.default"} <= ops
        assert "aten.bmm.default" not in ops
    assert _attention_ops("meta", dtype, mask) == _attention_ops("meta", dtype, mask, device_type="meta")  # no target: as before


def test_compile_on_meta_for_cuda_plans_the_cuda_kernel(monkeypatch):
    """compile(device_type="cuda") on a fake CPU mesh: the per-rank program and its memory
    are those of the CUDA kernel (the scores of the math path are gone)."""
    monkeypatch.setenv("SPMD_COMPILER_EXPLAIN", "1")
    peaks = {}
    for target in ("cuda", "meta"):  # "meta": no target, the math path meta takes by itself
        with DEVICE:
            model = _Attention(dim=64, heads=4)
        x = torch.randn(8, 256, 64, device=DEVICE)
        step = sc.compile(_mse_step, mesh=fake_mesh((2,), ("dp",)), plan=sc.Plan(), device_type=target)
        step(model, torch.optim.SGD(model.parameters(), lr=0.1), x[:4])
        ops = {str(n.target) for n in step.last.gm.graph.nodes}
        assert ("aten._scaled_dot_product_efficient_attention.default" in ops) == (target == "cuda")
        peaks[target] = step.memory_trace().peak_bytes
        assert _off_device(step.last.gm) == []
    assert peaks["cuda"] < peaks["meta"] - 4 * 4 * 256 * 256 * 4  # one (local batch 4, 4 heads, 256 x 256) float32 score
