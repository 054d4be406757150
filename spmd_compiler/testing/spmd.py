"""``assert_spmd_matches``: does a function give the same answer sharded as on one device?

The function is traced, expanded over the mesh with the given input placements, run on
every rank (simulated in this process, see :mod:`.simulate`), and its outputs are
assembled and compared with the single-device result. On a mismatch the error names the
first graph node whose assembled value differs from the single-device value, with its
placements and shapes, so a wrong sharding rule can be pinned to one op.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..driver import Options, build_program
from ..expand import ExpansionCache
from ..expand.values import placements_text
from ..plan import Plan
from .simulate import assemble, group_axes_of, rank_coordinates, run_lockstep, shard_tensor

__all__ = ["assert_spmd_matches", "SpmdMismatch", "SpmdRun", "run_spmd"]


class SpmdMismatch(AssertionError):
    """The sharded program disagrees with the single-device one."""


class _NoState(torch.nn.Module):
    pass


@dataclass
class SpmdRun:
    """Outputs of a simulated run: ``outputs`` assembled (global), ``reference`` from one
    device, ``steps`` the ExpandedStep per coordinate."""

    outputs: list[torch.Tensor]
    reference: list[torch.Tensor]
    steps: dict[tuple[int, ...], Any]
    traced: Any
    envs: dict[tuple[int, ...], dict[str, Any]]


def run_spmd(
    fn: Callable[..., Any],
    args: Sequence[Any],
    mesh: Any,
    placements: Sequence[Any] | None = None,
    *,
    fallback: str = "replicate",
    symbolic: str = "batch",
    cache: ExpansionCache | None = None,
    passes: Any = None,
    rng: str = "exact",
    context_parallel: Any = None,
) -> SpmdRun:
    """Trace ``fn(*args)``, expand it with ``placements`` (one per tensor argument, in
    order; default Replicate) and optimize it as ``compile()`` does (``passes``: default
    the same passes), run all ranks and return assembled and reference outputs.

    The reference (``fn(*args)`` on one device) starts from the generator state the
    simulated ranks started from, so random ops draw the same numbers under
    ``rng="exact"``. ``context_parallel``: the plan's :class:`~spmd_compiler.ContextParallel`
    (inputs split on its axis are fed in its layout)."""
    args = list(args)
    mesh_shape = tuple(mesh.shape)
    tensor_args = [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
    if placements is None:
        placements = [[torch.distributed.tensor.Replicate()] * len(mesh_shape)] * len(tensor_args)
    if len(placements) != len(tensor_args):
        raise ValueError(f"got {len(placements)} placements for {len(tensor_args)} tensor arguments; expected one per tensor argument")

    def step(model: Any, optimizer: Any, *a: Any) -> Any:
        return fn(*a)

    plan = Plan(inputs=list(placements), default_param=None, context_parallel=context_parallel)
    options = Options(fallback=fallback, symbolic=symbolic, passes=passes, rng=rng)
    cache = cache or ExpansionCache()
    coords = rank_coordinates(mesh_shape)
    first = build_program(step, _NoState(), None, tuple(args), {}, mesh, plan, options, coordinate=coords[0], cache=cache)
    traced = first.traced
    steps = {coords[0]: first}
    for c in coords[1:]:
        steps[c] = first if first.rank_independent else build_program(
            step, _NoState(), None, tuple(args), {}, mesh, plan, options, coordinate=c, cache=cache, traced=traced
        )
    leaves = [x for x in pytree.tree_leaves((tuple(args), {})) if isinstance(x, torch.Tensor)]
    cp = first.mctx.cp
    inputs = {c: [shard_tensor(t, s.placements, mesh_shape, c, cp) for t, s in zip(leaves, first.input_specs)] for c in coords}
    envs: dict[tuple[int, ...], dict[str, Any]] = {}
    start = torch.get_rng_state()
    outs = run_lockstep({c: s.gm for c, s in steps.items()}, inputs, mesh_shape, group_axes=group_axes_of(first), record=envs)
    outputs = []
    for j, slot in enumerate(first.outputs):
        outputs.append(assemble(slot.spec.placements, slot.spec.shape, {c: outs[c][j] for c in coords}, mesh_shape, cp))
    torch.set_rng_state(start)
    with torch.no_grad():
        ref = fn(*args)
    reference = [x for x in pytree.tree_leaves(ref) if isinstance(x, torch.Tensor)]
    return SpmdRun(outputs, reference, steps, traced, envs)


def _first_difference(run: SpmdRun, args: Sequence[Any], mesh_shape: tuple[int, ...], atol: float, rtol: float) -> str:
    """Describe the first traced node whose assembled per-rank value differs."""
    leaves = [x for x in pytree.tree_leaves((tuple(args), {})) if isinstance(x, torch.Tensor)]
    values: dict[str, Any] = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            out = super().run_node(n)
            values[n.name] = out
            return out

    try:
        with torch.no_grad():
            Recorder(run.traced.gm).run(*leaves)
    except Exception as e:  # the traced graph itself failed to run: report that
        return f"(could not replay the traced graph: {e})"
    step = next(iter(run.steps.values()))
    nodes = {n.name: n for n in step.gm.graph.nodes}
    for tnode in run.traced.gm.graph.nodes:
        node = nodes.get(tnode.name)
        if node is None or "spmd_spec" not in node.meta or tnode.name not in values:
            continue
        want = values[tnode.name]
        if not isinstance(want, torch.Tensor):
            continue
        spec = node.meta["spmd_spec"]
        try:
            got = assemble(spec.placements, spec.shape, {c: env[tnode.name] for c, env in run.envs.items()}, mesh_shape,
                           next(iter(run.steps.values())).mctx.cp)
        except KeyError:
            continue
        if got.shape != want.shape or not torch.allclose(got.to(want.dtype), want, atol=atol, rtol=rtol, equal_nan=True):
            diff = (got.double() - want.double()).abs().max().item() if got.shape == want.shape else float("nan")
            return (
                f"first differing node: {node.format_node()} (traced: {tnode.format_node()})\n"
                f"  placements {placements_text(spec.placements)}, global shape {list(spec.shape)}, "
                f"local shape on rank 0 {list(node.meta['val'].shape)}; max abs difference {diff:.3g}"
            )
    return "no intermediate node differs; the difference is in the output handling"


def assert_spmd_matches(
    fn: Callable[..., Any],
    args: Sequence[Any],
    mesh: Any,
    placements: Sequence[Any] | None = None,
    *,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    fallback: str = "replicate",
    symbolic: str = "batch",
    cache: ExpansionCache | None = None,
    passes: Any = None,
    context_parallel: Any = None,
) -> SpmdRun:
    """Assert that ``fn(*args)`` sharded over ``mesh`` equals ``fn(*args)`` on one device.

    ``placements`` gives, per tensor argument, one placement per mesh axis (uneven shards
    allowed). Raises :class:`SpmdMismatch` naming the first differing graph node.
    """
    run = run_spmd(fn, args, mesh, placements, fallback=fallback, symbolic=symbolic, cache=cache, passes=passes,
                   context_parallel=context_parallel)
    if len(run.outputs) != len(run.reference):
        raise SpmdMismatch(f"the sharded program returned {len(run.outputs)} tensors, the single-device one {len(run.reference)}")
    for i, (got, want) in enumerate(zip(run.outputs, run.reference)):
        ok = got.shape == want.shape and torch.allclose(got.to(want.dtype), want, atol=atol, rtol=rtol, equal_nan=True)
        if not ok:
            where = _first_difference(run, args, tuple(mesh.shape), atol, rtol)
            raise SpmdMismatch(
                f"output {i} differs from the single-device result (shape {list(got.shape)} vs {list(want.shape)}; "
                f"placements {[placements_text(p) for p in (placements or [])]})\n{where}"
            )
    return run
