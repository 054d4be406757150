"""Compare a distributed training run with the single-device run of the same step."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..plan import Plan
from .harness import SimulatedTraining

__all__ = ["TrainingComparison", "assert_training_matches"]


@dataclass
class TrainingComparison:
    """What :func:`assert_training_matches` measured."""

    losses: list[float]
    reference_losses: list[float]
    max_param_error: float
    worst_param: str
    sim: SimulatedTraining


def assert_training_matches(
    step_fn: Callable[..., Any],
    model: torch.nn.Module,
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    batches: Sequence[tuple],
    mesh: Any,
    plan: Plan | None = None,
    *,
    atol: float = 1e-9,
    rtol: float = 1e-7,
    fallback: str = "replicate",
    passes: Any = None,
    make_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
    rng: str = "exact",
    **options: Any,
) -> TrainingComparison:
    """Train a copy of ``model`` on one device and on all ranks of ``mesh`` (simulated in
    this process) over ``batches``; assert losses, parameters and the gradients the
    steps leave (``.grad``, None on both or close) agree within tolerance.

    ``batches`` are global; each rank gets its shard as the plan says. ``passes`` and
    ``options`` are ``compile()``'s (default: the same passes compile() runs). ``make_scheduler``
    builds an LR scheduler for an optimizer; it steps after every training step on both
    sides. Use float64 models for tight tolerances: Adam amplifies reduction-order
    rounding in float32.

    Random ops (dropout...): both sides start every step from the same generator state.
    ``rng="exact"`` (compile()'s default) asserts the single-device numbers: equal
    losses and parameters, and the generator left where one device leaves it.
    ``rng="fast"`` draws other numbers by design, so the one-device comparison is
    skipped; what is checked is the contract's part (a), in every simulated step: each
    Replicate value is identical on every rank, and every rank's generator ends in the
    same state.
    """
    ref = copy.deepcopy(model)
    dist_model = copy.deepcopy(model)
    ref_opt = make_optimizer(ref.parameters())
    dist_opt = make_optimizer(dist_model.parameters())
    schedulers = [make_scheduler(ref_opt), make_scheduler(dist_opt)] if make_scheduler else []
    sim = SimulatedTraining(step_fn, dist_model, dist_opt, mesh, plan, fallback=fallback, passes=passes, rng=rng, **options)
    losses, ref_losses = [], []
    for batch in batches:
        start = torch.get_rng_state()
        out = sim.step(*batch)
        after = torch.get_rng_state()
        if rng == "fast":
            losses.append(float(out.detach()))
            for sched in schedulers[1:]:
                sched.step()
            continue
        torch.set_rng_state(start)
        ref_out = step_fn(ref, ref_opt, *batch)
        if not torch.equal(after, torch.get_rng_state()):
            raise AssertionError(f"step {len(losses) + 1}: the compiled step left the random generator in another state than one device does")
        for sched in schedulers:
            sched.step()
        losses.append(float(out.detach()))
        ref_losses.append(float(ref_out.detach()))
        torch.testing.assert_close(out.detach(), ref_out.detach(), atol=atol, rtol=rtol, msg=lambda m: f"loss differs at step {len(losses)}: {m}")
    if rng == "fast":
        return TrainingComparison(losses, [], float("nan"), "", sim)
    worst, worst_name = 0.0, ""
    for (name, p), q in zip(dist_model.named_parameters(), ref.parameters()):
        err = (p.detach() - q.detach()).abs().max().item() if p.numel() else 0.0
        if err > worst:
            worst, worst_name = err, name
        torch.testing.assert_close(p.detach(), q.detach(), atol=atol, rtol=rtol, msg=lambda m, n=name: f"parameter {n} differs after {len(batches)} steps: {m}")
        # gradients the step leaves (accumulation across calls) are state too
        if (p.grad is None) != (q.grad is None):
            raise AssertionError(f"parameter {name}: .grad is {'None' if p.grad is None else 'set'} after the distributed steps but "
                                 f"{'None' if q.grad is None else 'set'} on one device")
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=atol, rtol=rtol, msg=lambda m, n=name: f"gradient of {n} differs after {len(batches)} steps: {m}")
    for (name, b), rb in zip(dist_model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, rb, atol=atol, rtol=rtol, msg=lambda m, n=name: f"buffer {n} differs: {m}")
    return TrainingComparison(losses, ref_losses, worst, worst_name, sim)
