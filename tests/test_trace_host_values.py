"""Values crossing between tensors and Python in the step (trace/host_values.py):
data-dependent code is one clear error, numbers stored on the model are refused and
restored, a returned learning rate is the current one at every call (as on one device)."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.testing import SimulatedTraining, assert_training_matches, fake_mesh
from spmd_compiler.testing.models import MLP


def _line(fn, text: str) -> str:
    """``file:line`` of the first line of ``fn`` containing ``text``."""
    lines, start = inspect.getsourcelines(fn)
    offset = next(i for i, line in enumerate(lines) if text in line)
    return f"{inspect.getsourcefile(fn)}:{start + offset}"


def _batches(n=2, rows=4):
    return [(torch.randn(rows, 16, dtype=torch.float64), torch.randn(rows, 16, dtype=torch.float64)) for _ in range(n)]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@pytest.fixture
def dp2():
    return fake_mesh((2,), ("dp",))


# ------------------------------------------------------------ data-dependent code
def branch_step(model, optimizer, x, y):
    loss = F.mse_loss(model(x), y)
    if loss.isfinite():  # a Python branch on a tensor's value
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def mask_step(model, optimizer, x, y):
    out = model(x)
    mask = y > 0
    loss = (out[mask] - y[mask]).pow(2).mean()  # boolean-mask index: data-dependent shape
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def weighted_mask_step(model, optimizer, x, y):
    """What the error suggests instead of ``x[mask]``: fixed shapes, a 0/1 weight."""
    out = model(x)
    mask = (y > 0).to(out.dtype)
    loss = ((out - y).pow(2) * mask).sum() / mask.sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_branch_on_tensor_is_one_clear_error(dp2):
    with pytest.raises(sc.DataDependentError) as info:
        assert_training_matches(branch_step, MLP().double(), _sgd, _batches(1), dp2)
    msg = str(info.value)
    assert _line(branch_step, "if loss.isfinite()") in msg
    assert "if loss.isfinite():" in msg and "torch.where" in msg and "fix:" in msg
    assert "GuardOnDataDependentSymNode" not in msg
    assert isinstance(info.value, sc.SpmdError) and info.value.source is not None


_SCALER = torch.amp.GradScaler("cpu", init_scale=16.0)


def scaler_step(model, optimizer, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.mse_loss(model(x).float(), y.float())
    _SCALER.scale(loss).backward()
    _SCALER.step(optimizer)  # skips the update with a Python `if` on found-inf
    _SCALER.update()
    optimizer.zero_grad()
    return loss


def test_grad_scaler_is_one_clear_error_with_its_own_fix(dp2):
    with pytest.raises(sc.DataDependentError) as info:
        assert_training_matches(scaler_step, MLP(), _sgd, [(x.float(), y.float()) for x, y in _batches(1)], dp2)
    msg = str(info.value)
    assert _line(scaler_step, "_SCALER.step(optimizer)") in msg
    assert "GradScaler.step()" in msg and "bfloat16 autocast" in msg and "fixed loss scale" in msg, msg


def test_boolean_mask_loss_is_one_clear_error(dp2):
    m = MLP()
    for run in (
        lambda: sc.trace(mask_step, m, torch.optim.SGD(m.parameters(), lr=0.1), torch.randn(4, 16), torch.randn(4, 16)),
        lambda: assert_training_matches(mask_step, MLP().double(), _sgd, _batches(1), dp2),
    ):
        with pytest.raises(sc.DataDependentError) as info:
            run()
        msg = str(info.value)
        assert _line(mask_step, "out[mask]") in msg
        assert "aten.index.Tensor" in msg and "ignore_index" in msg and "fix:" in msg
        assert "DynamicOutputShapeException" not in msg


def _loss_step(loss_of):
    def step(model, optimizer, x, y):
        loss = loss_of(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step


def nonzero_loss(out, y):
    return out[torch.nonzero(y > 0, as_tuple=True)].sum()


def unique_loss(out, y):
    return (out * torch.unique(y.round()).sum()).sum()


def masked_select_loss(out, y):
    return torch.masked_select(out, y > 0).sum()


def item_size_loss(out, y):
    return out.sum() + torch.zeros(int((y > 0).sum().item())).sum()


@pytest.mark.parametrize("loss_of,op,fix", [
    (nonzero_loss, "aten.nonzero", "ignore_index"),
    (unique_loss, "aten._unique2", "keep shapes fixed"),
    (masked_select_loss, "aten.masked_select", "torch.where(mask, x, 0)"),
    (item_size_loss, "aten._local_scalar_dense", "sizes may come from tensor shapes"),
])
def test_data_dependent_shapes_are_one_clear_error(loss_of, op, fix):
    m = MLP()
    with pytest.raises(sc.DataDependentError) as info:
        sc.trace(_loss_step(loss_of), m, torch.optim.SGD(m.parameters(), lr=0.1), torch.randn(4, 16), torch.randn(4, 16))
    msg = str(info.value)
    assert op in msg and fix in msg and "fix:" in msg
    assert "user code:" in msg  # the line that computes the loss


def test_suggested_mask_fix_matches_one_device(dp2):
    assert_training_matches(weighted_mask_step, MLP().double(), _sgd, _batches(3), dp2)


# ------------------------------------------------------------ host values on the model
def item_step(model, optimizer, x, y):
    loss = F.mse_loss(model(x), y)
    model.last_loss = loss.item()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def history_step(model, optimizer, x, y):
    loss = F.mse_loss(model(x), y)
    model.l1.history.append(loss.item())
    optimizer.param_groups[0]["seen"] = x.sum().item()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_number_stored_on_the_model_is_set_after_each_call(dp2):
    """``model.last_loss = loss.item()`` in the step: the compiled step returns the number
    and sets the attribute after every call, as on one device; tracing leaves no symbol."""
    model = MLP().double()
    model.last_loss = 1.5
    ref = copy.deepcopy(model)
    opt, ref_opt = _sgd(model.parameters()), _sgd(ref.parameters())
    sim = SimulatedTraining(item_step, model, opt, dp2)
    for x, y in _batches(3):
        sim.step(x, y)
        item_step(ref, ref_opt, x, y)
        assert type(model.last_loss) is float and model.last_loss == pytest.approx(ref.last_loss, rel=1e-12)
    assert sim.compiles == 1

    fresh = MLP()  # tracing alone computes nothing: an attribute the step creates is removed again
    traced = sc.trace(item_step, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), torch.randn(4, 16), torch.randn(4, 16))
    assert not hasattr(fresh, "last_loss") and list(traced.host_attributes.values()) == [("model", "last_loss")]


def test_values_appended_in_place_are_refused_with_the_line_and_a_fix():
    model = MLP()
    model.l1.history = [0.25]
    with pytest.raises(sc.HostValueError) as info:
        sc.trace(history_step, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 16), torch.randn(4, 16))
    msg = str(info.value)
    assert _line(history_step, "model.l1.history.append") in msg
    assert "return the value from the step" in msg and "fix:" in msg


def test_values_appended_in_place_and_param_group_entries_are_restored():
    model = MLP()
    model.l1.history = [0.25]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(sc.HostValueError) as info:
        sc.trace(history_step, model, opt, torch.randn(4, 16), torch.randn(4, 16))
    assert info.value.attributes == ["model.l1.history", "optimizer.param_groups[0]['seen']"]
    assert model.l1.history == [0.25]
    assert "seen" not in opt.param_groups[0]
    assert opt.param_groups[0]["lr"] == 0.1 and type(opt.param_groups[0]["lr"]) is float


# ------------------------------------------------------------ returned learning rate
def lr_step(model, optimizer, x, y):
    loss = F.mse_loss(model(x), y)
    before = optimizer.param_groups[0]["lr"]  # a plain float before optimizer.step()
    loss.backward()
    optimizer.step()  # from here on the lifted lr, read with .item() in the graph
    optimizer.zero_grad()
    return {"loss": loss, "lr": optimizer.param_groups[0]["lr"], "lr_before": before, "steps": 1}


def test_returned_lr_follows_scheduler_like_one_device(dp2):
    model = MLP().double()
    ref = copy.deepcopy(model)
    opt, ref_opt = _sgd(model.parameters()), _sgd(ref.parameters())
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt, ref_opt)]
    sim = SimulatedTraining(lr_step, model, opt, dp2)
    seen = []
    for x, y in _batches(3):
        out, ref_out = sim.step(x, y), lr_step(ref, ref_opt, x, y)
        for s in scheds:
            s.step()
        torch.testing.assert_close(out["loss"], ref_out["loss"].detach())
        assert {k: out[k] for k in ("lr", "lr_before", "steps")} == {k: ref_out[k] for k in ("lr", "lr_before", "steps")}
        seen.append(out["lr"])
    assert seen == [0.1, 0.05, 0.025]
    assert sim.compiles == 1  # the lr is an input: no recompile when the scheduler changes it
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


def test_returned_lr_through_compile(mesh4):
    step = sc.compile(lr_step, mesh=mesh4)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    got = []
    for _ in range(3):
        out = step(model, opt, torch.randn(2, 16), torch.randn(2, 16))
        got.append((out["lr"], out["lr_before"]))
        sched.step()
    assert got == [(0.1, 0.1), (0.05, 0.05), (0.025, 0.025)]
    assert step.compiles == 1


def number_step(model, optimizer, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return {"loss": loss.item(), "rows": x.size(0), "lr2": optimizer.param_groups[0]["lr"] * 2}


def test_numbers_computed_in_the_step_come_back_as_numbers(dp2):
    """``loss.item()``, ``x.size(0)`` and ``lr * 2`` returned by the step are graph outputs
    handed back as Python numbers after each call, equal to one device."""
    model = MLP().double()
    ref = copy.deepcopy(model)
    opt, ref_opt = _sgd(model.parameters()), _sgd(ref.parameters())
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt, ref_opt)]
    sim = SimulatedTraining(number_step, model, opt, dp2)
    for x, y in _batches(3):
        out, want = sim.step(x, y), number_step(ref, ref_opt, x, y)
        for s in scheds:
            s.step()
        assert [type(out[k]) for k in ("loss", "rows", "lr2")] == [float, int, float]
        assert out["rows"] == 4 and out["lr2"] == want["lr2"]  # the global batch size, the current lr
        assert out["loss"] == pytest.approx(want["loss"], rel=1e-12)
    assert sim.compiles == 1


def test_numbers_through_compile(mesh4):
    def step_fn(model, optimizer, x, y):
        loss = F.mse_loss(model(x), y)
        model.last_loss = loss.item()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return {"loss": loss.item(), "rows": x.size(0)}

    step = sc.compile(step_fn, mesh=mesh4)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        out = step(model, opt, torch.randn(2, 16), torch.randn(2, 16))
        assert type(out["loss"]) is float and out["rows"] == 8  # the global batch: 4 ranks x 2 rows
        assert model.last_loss == out["loss"]
    assert step.compiles == 1


# ------------------------------------------------------------ settings changed inside the step
SCHEDULERS: dict[int, object] = {}


def scheduler_inside_step(model, optimizer, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    SCHEDULERS[id(optimizer)].step()  # once, at the trace: the compiled step would never step it again
    optimizer.zero_grad()
    return loss


def lr_assigned_step(model, optimizer, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * 0.5  # a warmup by hand: read over by the lifted lr input
    optimizer.step()
    optimizer.zero_grad()
    return loss


def decay_assigned_step(model, optimizer, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.param_groups[0]["weight_decay"] += 0.01  # a decay schedule by hand
    optimizer.param_groups[0]["wd_seen"] = True
    optimizer.zero_grad()
    return loss


@pytest.mark.parametrize("make", [
    lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda i: 1.0 / (1 + i)),
    lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.5, total_steps=10),
], ids=["LambdaLR", "OneCycleLR"])
def test_scheduler_stepped_inside_the_step_is_refused_with_its_line(dp2, make):
    """Stepped inside, a scheduler ran once (at the trace) and later calls trained with a
    stale learning rate: losses differed from one device from the second step on."""
    model = MLP().double()
    opt = _sgd(model.parameters())
    sched = SCHEDULERS[id(opt)] = make(opt)
    lr, epoch = opt.param_groups[0]["lr"], sched.last_epoch
    with pytest.raises(sc.HostSettingError) as info:
        SimulatedTraining(scheduler_inside_step, model, opt, dp2).step(*_batches(1)[0])
    msg = str(info.value)
    assert _line(scheduler_inside_step, "SCHEDULERS[id(optimizer)].step()") in msg
    assert type(sched).__name__ + ".step() inside the step" in msg and "scheduler.step()" in msg.split("fix:")[1]
    assert opt.param_groups[0]["lr"] == lr and sched.last_epoch == epoch  # nothing stepped
    sched.step()  # the scheduler's own step() is back after the trace
    assert sched.last_epoch == epoch + 1


def test_param_group_setting_assigned_inside_the_step_is_refused(dp2):
    model = MLP().double()
    opt = _sgd(model.parameters())
    with pytest.raises(sc.HostSettingError) as info:
        SimulatedTraining(lr_assigned_step, model, opt, dp2).step(*_batches(1)[0])
    assert info.value.settings == ["optimizer.param_groups[0]['lr']"]
    assert opt.param_groups[0]["lr"] == 0.1 and type(opt.param_groups[0]["lr"]) is float
    with pytest.raises(sc.HostSettingError) as info:  # a setting compiled in, assigned after optimizer.step()
        SimulatedTraining(decay_assigned_step, model, opt, dp2).step(*_batches(1)[0])
    assert info.value.settings == ["optimizer.param_groups[0]['wd_seen']", "optimizer.param_groups[0]['weight_decay']"]
    assert opt.param_groups[0]["weight_decay"] == 0 and "wd_seen" not in opt.param_groups[0]  # put back


def test_scheduler_stepped_between_calls_matches_one_device_with_one_program(dp2):
    """The supported way: a scheduler stepped between calls, one program for every lr."""
    model = MLP().double()
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=0.05), torch.optim.AdamW(ref.parameters(), lr=0.05)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda i: 1.0 / (1 + i)) for o in (opt, ref_opt)]
    sim = SimulatedTraining(lr_step, model, opt, dp2)
    for x, y in _batches(4):
        out, ref_out = sim.step(x, y), lr_step(ref, ref_opt, x, y)
        for s in scheds:
            s.step()
        torch.testing.assert_close(out["loss"], ref_out["loss"].detach(), atol=1e-12, rtol=1e-12)
    assert sim.compiles == 1  # AdamW's state created before the first call's trace: one program


def nonfinite_clip_step(model, optimizer, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True, error_if_nonfinite=True)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def test_clip_grad_norm_error_if_nonfinite_is_one_clear_error_with_its_own_fix(dp2):
    model = MLP().double()
    with pytest.raises(sc.DataDependentError) as info:
        SimulatedTraining(nonfinite_clip_step, model, _sgd(model.parameters()), dp2).step(*_batches(1)[0])
    msg = str(info.value)
    assert _line(nonfinite_clip_step, "error_if_nonfinite=True") in msg
    assert "Leave error_if_nonfinite out" in msg and "torch.isfinite(out['grad_norm'])" in msg


def counted_accumulation_step(model, optimizer, x, y):
    model.micro_steps = getattr(model, "micro_steps", 0) + 1  # a trainer's counter, kept on the model
    loss = F.mse_loss(model(x), y) / 4
    loss.backward()
    if model.micro_steps % 4 == 0:  # traced once: every later call would replay this call's branch
        optimizer.step()
        optimizer.zero_grad()
    return loss


def test_counter_on_the_model_changed_inside_the_step_is_refused_and_restored(dp2):
    """Unrefused, the counter was incremented at the traces only, and a call whose
    signature matched an earlier one replayed that call's branch: with 4 micro-steps the
    fourth reused the third's program and the optimizer never stepped."""
    model = MLP().double()
    model.micro_steps = 0
    with pytest.raises(sc.HostSettingError) as info:
        SimulatedTraining(counted_accumulation_step, model, _sgd(model.parameters()), dp2).step(*_batches(1)[0])
    assert info.value.settings == ["model.micro_steps"]
    assert "do_step=" in str(info.value).split("fix:")[1]
    assert model.micro_steps == 0
    fresh = MLP().double()  # an attribute the step creates is removed again
    with pytest.raises(sc.HostSettingError):
        SimulatedTraining(counted_accumulation_step, fresh, _sgd(fresh.parameters()), dp2).step(*_batches(1)[0])
    assert not hasattr(fresh, "micro_steps")
