"""Plans: where each parameter, buffer, optimizer state and batch input lives on the mesh.

A plan maps FQN patterns to placements (one per mesh axis, torch's ``Shard``,
``Replicate``, ``Partial``) or to a ``torch.distributed.tensor.parallel`` style keyed by
module FQN. Optimizer state follows its parameter. Batch inputs are each rank's local
shard, as in DDP, and default to ``Shard(0)`` on the first mesh axis.

Examples (1-D mesh)::

    Plan(params={"l1.*": [Shard(0)], "l2.weight": [Shard(1)]}, default_input=[Replicate()])  # Megatron MLP
    Plan(params={"*": [Shard(0)]}, fsdp_axes=("dp",))  # FSDP: stored sharded, gathered for compute
    Plan(params={"*": [Shard(0)]}, fsdp_axes=("dp",), reshard_after_forward=False)  # gathered once, kept for backward
"""

from __future__ import annotations

import difflib
import fnmatch
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from . import _private_torch as pt

__all__ = ["Plan", "ResolvedPlan", "normalize_placements"]

log = logging.getLogger(__name__)

PlacementsLike = Any  # Placement | Sequence[Placement]


def normalize_placements(value: PlacementsLike, ndim: int, what: str) -> tuple[Placement, ...]:
    """Validate ``value`` as placements for a mesh of ``ndim`` axes.

    A single Placement is accepted for a 1-D mesh only.
    """
    if isinstance(value, Placement):
        if ndim != 1:
            raise ValueError(
                f"{what}: got a single placement {value!r} for a {ndim}-D mesh; expected a list of {ndim} "
                f"placements, one per mesh axis. fix: write a list, e.g. {[value] + [Replicate()] * (ndim - 1)!r}"
            )
        return (value,)
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise TypeError(
            f"{what}: expected a Placement or a list of {ndim} placements, got {type(value).__name__} {value!r}. "
            f"fix: use torch.distributed.tensor placements, e.g. {[Shard(0)] + [Replicate()] * (ndim - 1)!r}"
        )
    out = tuple(value)
    if len(out) != ndim:
        raise ValueError(
            f"{what}: got {len(out)} placements {list(out)} for a mesh with {ndim} axes; expected exactly "
            f"one placement per mesh axis. fix: give {ndim} placements (Replicate() on the axes that do not split it)"
        )
    for p in out:
        if not isinstance(p, Placement):
            raise TypeError(
                f"{what}: {p!r} in {list(out)} is not a Placement; expected Shard(d), Replicate() or Partial(). "
                f"fix: use the objects from torch.distributed.tensor (Shard(0), not the string 'Shard(0)')"
            )
    return out


def _is_style(value: Any) -> bool:
    try:
        from torch.distributed.tensor.parallel import ParallelStyle
    except ImportError:  # pragma: no cover
        return False
    return isinstance(value, ParallelStyle)


@dataclass(frozen=True)
class Plan:
    """Placements for a training step.

    Attributes:
        params: FQN glob pattern (``"layers.*.w1.weight"``; ``*`` also matches dots) to
            placements, for parameters and buffers. An exact FQN beats a pattern; among
            patterns the first listed wins. A pattern (and ``default_param``) shards only
            what can be split: on a tensor without the dim it names (a 0-d buffer such as
            BatchNorm's ``num_batches_tracked``) it gives Replicate on that mesh axis
            (logged at DEBUG); an exact FQN entry that does so is a ValueError, as is a
            pattern whose dim none of the tensors it matches has. A value may instead be a ParallelStyle
            (``ColwiseParallel()``, ``RowwiseParallel()``, ``SequenceParallel()``) keyed
            by module FQN pattern, meaning what it means in ``parallelize_module``,
            applied on mesh axis ``style_axis``.
        inputs: placements for the batch leaves, by leaf index (a list) or by path
            (``{"batch[0]": ...}``). Missing leaves get ``default_input``.
        default_param: placements for unmatched parameters and buffers (Replicate).
        default_input: placements for batch leaves (Shard(0) on the first mesh axis,
            Replicate on the others).
        style_axis: mesh axis name or index the ParallelStyles apply to (default: the
            axis named "tp", else the last axis).
        strict: raise when a pattern matches no parameter or buffer.
        fsdp_axes: mesh axes (names or indices) with FSDP semantics: a parameter sharded
            on one of them is stored sharded but all-gathered (Replicate on that axis)
            before its use in forward and again in backward, and its gradient is
            reduce-scattered into the shard, as ``fully_shard`` does. Without it a sharded
            parameter is an operand like any other: it stays sharded for compute and
            DTensor redistributes the other operands to match it, so on an axis where the
            batch is split along dim 0 the batch and activations are gathered instead of
            the parameters. That is exact but rarely what is meant, and the compile logs
            one WARNING naming the axis, the bytes and this option (FSDP:
            ``Plan(params={"*": [Shard(0)]}, fsdp_axes=("dp",))``). On these axes a
            pattern or ``default_param`` shards parameters only, as ``fully_shard``:
            the buffers it matches (BatchNorm statistics, masks, rotary frequencies)
            are Replicate there; an exact FQN entry shards a buffer as it says: stored
            sharded and gathered for use like a parameter (once per phase), or, when the
            step writes it in place (BatchNorm's running statistics), kept a sharded
            operand that each rank updates on its own slice.
        reshard_after_forward: under ``fsdp_axes``, what ``fully_shard``'s option of the
            same name does (and its default). ``True``: the full parameter gathered for
            forward is dropped after its last forward use and gathered again for backward
            (the views of it that autograd saved, such as ``t(weight)``, are taken again
            from the backward gather), so between a unit's forward and its backward only
            its shard is resident: one more all_gather per parameter per step, less
            memory. ``False``: backward reuses the forward's gather, which stays resident
            from its forward use to its last backward use.
        activation_sharding: how an op's strategy is chosen among DTensor's candidates.
            ``"follow"`` (default): an op's result is sharded on a mesh axis only where
            one of its inputs already is, so shards start at the plan and propagate (a
            Megatron plan then communicates exactly as Megatron does, in backward too).
            ``"greedy"``: DTensor's cheapest strategy for each op on its own, which may
            start new shards (sequence-parallel-like splits) that later ops pay to undo.
    """

    params: Mapping[str, Any] = field(default_factory=dict)
    inputs: Sequence[Any] | Mapping[str, Any] | None = None
    default_param: Any = None
    default_input: Any = None
    style_axis: str | int | None = None
    strict: bool = True
    fsdp_axes: Sequence[str | int] = ()
    activation_sharding: str = "follow"
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.reshard_after_forward, bool):
            raise TypeError(
                f"Plan(reshard_after_forward={self.reshard_after_forward!r}): expected True (gather FSDP parameters "
                f"again for backward, as fully_shard's default) or False (keep the forward's gather for backward), "
                f"got a {type(self.reshard_after_forward).__name__}. fix: pass a bool"
            )
        if self.activation_sharding not in ("follow", "greedy"):
            raise ValueError(
                f"Plan(activation_sharding={self.activation_sharding!r}): expected 'follow' (shards start at the "
                f"plan and propagate) or 'greedy' (DTensor's cheapest strategy per op)"
            )

    def fsdp_axis_indices(self, mesh: Any) -> tuple[int, ...]:
        """``fsdp_axes`` as mesh axis indices (ValueError for unknown names)."""
        names = list(mesh.mesh_dim_names or [])
        out = []
        for a in self.fsdp_axes:
            if isinstance(a, int):
                if not 0 <= a < mesh.ndim:
                    raise ValueError(
                        f"fsdp axis {a} is out of range for a {mesh.ndim}-D mesh. fix: use an index in "
                        f"[0, {mesh.ndim - 1}] or a mesh axis name {names}"
                    )
                out.append(a)
            elif a in names:
                out.append(names.index(a))
            else:
                raise ValueError(f"fsdp axis {a!r} is not a mesh axis name; mesh axes are {names}. fix: name one of them")
        return tuple(out)

    def resolve(self, traced: Any, mesh: Any) -> "ResolvedPlan":
        """Placements for every input of ``traced`` (a TracedStep) on ``mesh``."""
        return _resolve(self, traced, mesh)

    def batch_placements(self, batch_inputs: Sequence[Any], ndim: int) -> list[tuple[tuple[Placement, ...], str]]:
        """``(placements, source)`` for each batch tensor (GraphInputs of kind "batch")."""
        return _batch_placements(self, list(batch_inputs), ndim)


@dataclass(frozen=True)
class ResolvedPlan:
    """One placements tuple per graph input, plus where each came from."""

    placements: tuple[tuple[Placement, ...], ...]
    sources: tuple[str, ...]

    def __iter__(self):
        return iter(self.placements)


def _style_axis(plan: Plan, mesh: Any) -> int:
    names = list(mesh.mesh_dim_names or [])
    ax = plan.style_axis
    if ax is None:
        return names.index("tp") if "tp" in names else mesh.ndim - 1
    if isinstance(ax, int):
        if not 0 <= ax < mesh.ndim:
            raise ValueError(f"style_axis {ax} is out of range for a {mesh.ndim}-D mesh")
        return ax
    if ax not in names:
        raise ValueError(f"style_axis {ax!r} is not a mesh axis name; mesh axes are {names}")
    return names.index(ax)


def _style_params(style: Any, module: Any, prefix: str) -> dict[str, Placement]:
    """The parameter placements (on the style axis) a ParallelStyle gives ``module``."""
    import torch.nn as nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    out: dict[str, Placement] = {}
    names = [n for n, _ in module.named_parameters(recurse=False)]
    if isinstance(style, ColwiseParallel):
        if isinstance(module, nn.Embedding):
            out["weight"] = Shard(1)
        else:
            out.update({n: Shard(0) for n in names})
    elif isinstance(style, RowwiseParallel):
        if isinstance(module, nn.Embedding):
            out["weight"] = Shard(0)
        else:
            out.update({n: (Shard(1) if n == "weight" else Replicate()) for n in names})
    elif isinstance(style, SequenceParallel):
        out.update({n: Replicate() for n in names})
    else:
        raise TypeError(
            f"plan entry {prefix!r}: {type(style).__name__} is not supported; expected ColwiseParallel, "
            f"RowwiseParallel or SequenceParallel"
        )
    if not isinstance(module, (nn.Linear, nn.Embedding)) and not isinstance(style, SequenceParallel):
        raise TypeError(
            f"plan entry {prefix!r}: {type(style).__name__} applies to nn.Linear or nn.Embedding modules, "
            f"but {prefix!r} is a {type(module).__name__}"
        )
    return {f"{prefix}.{k}" if prefix else k: v for k, v in out.items()}


def _near(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.5)
    return f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""


def _resolve(plan: Plan, traced: Any, mesh: Any) -> ResolvedPlan:
    ndim = mesh.ndim
    replicate = (Replicate(),) * ndim
    default_param = normalize_placements(plan.default_param, ndim, "default_param") if plan.default_param is not None else replicate

    state = traced.state
    named = list(state.params) + list(state.buffers) + list(state.aliases)
    canonical = {**{n: n for n in list(state.params) + list(state.buffers)}, **state.aliases}

    # expand ParallelStyles into per-parameter placements on the style axis
    exact: dict[str, tuple[Placement, ...]] = {}
    patterns: list[tuple[str, tuple[Placement, ...]]] = []
    model = getattr(traced, "model", None)
    for key, value in plan.params.items():
        if _is_style(value):
            if model is None:
                raise ValueError("ParallelStyle plans need the model; compile through spmd_compiler.compile or pass model=")
            axis = _style_axis(plan, mesh)
            modules = [n for n, _ in model.named_modules() if n and fnmatch.fnmatchcase(n, key)]
            if not modules and plan.strict:
                raise ValueError(
                    f"plan entry {key!r} ({type(value).__name__}) matches no module FQN."
                    + _near(key, [n for n, _ in model.named_modules() if n])
                )
            for mod_name in modules:
                for fqn, p in _style_params(value, model.get_submodule(mod_name), mod_name).items():
                    pl = list(default_param)
                    pl[axis] = p
                    exact[fqn] = tuple(pl)
            continue
        pl = normalize_placements(value, ndim, f"plan entry {key!r}")
        if any(c in key for c in "*?["):
            patterns.append((key, pl))
        else:
            if key not in canonical and plan.strict:
                raise ValueError(
                    f"plan entry {key!r} names no parameter or buffer of the model (it gives {list(pl)!r})."
                    + _near(key, named)
                    + " fix: use the FQN from model.named_parameters() / named_buffers(), or a glob pattern, "
                    "or pass Plan(strict=False) to ignore it."
                )
            exact[canonical.get(key, key)] = pl
    if plan.strict:
        for pat, pl in patterns:
            if not any(fnmatch.fnmatchcase(n, pat) for n in named):
                raise ValueError(
                    f"plan pattern {pat!r} matches no parameter or buffer of the model (it gives {list(pl)!r})."
                    + _near(pat, named)
                    + " fix: match the names of model.named_parameters() / named_buffers() ('*' also matches dots), "
                    "or pass Plan(strict=False) to allow patterns that match nothing."
                )

    def for_fqn(fqn: str) -> tuple[tuple[Placement, ...], str, bool]:
        """(placements, source, whether they come from a pattern or default_param)."""
        if fqn in exact:
            return exact[fqn], f"plan[{fqn!r}]", False
        aliases = [a for a, c in state.aliases.items() if c == fqn]
        for a in aliases:
            if a in exact:
                return exact[a], f"plan[{a!r}]", False
        for pat, pl in patterns:
            if fnmatch.fnmatchcase(fqn, pat) or any(fnmatch.fnmatchcase(a, pat) for a in aliases):
                return pl, f"plan[{pat!r}]", True
        return default_param, "default_param", True

    batch = iter(plan.batch_placements([i for i in traced.inputs if i.kind == "batch"], ndim))
    placements, sources = [], []
    # a pattern shards, on each mesh axis, the tensors it matches that have the dim it
    # names; one whose dim no tensor it matches has is an error, not a silent Replicate
    splits: dict[str, set[int]] = {}
    for inp in traced.inputs:
        if inp.kind in ("param", "buffer"):
            pl, src, wild = for_fqn(inp.name)
            if wild:
                splits.setdefault(src, set()).update(a for a, p in enumerate(pl) if _has_dim(inp, p))
    fitted: list[str] = []
    fsdp = plan.fsdp_axis_indices(mesh)
    for inp in traced.inputs:
        if inp.kind in ("param", "buffer"):
            pl, src, wild = for_fqn(inp.name)
            if wild:
                pl, src = _fit_wildcard(inp, pl, src, splits.get(src, set()), fitted)
                if inp.kind == "buffer" and fsdp:
                    pl, src = _fsdp_buffer(pl, src, fsdp)
        elif inp.kind == "grad":  # stored like its parameter (FSDP: sharded, as after a reduce-scatter)
            pl, src, wild = for_fqn(inp.name)
            if wild:
                pl, src = _fit_wildcard(inp, pl, src, splits.get(src, set()), [])
            src = f"follows param {inp.name!r}"
        elif inp.kind == "optim":
            pl, src, wild = for_fqn(inp.name)
            if wild:
                pl, src = _fit_wildcard(inp, pl, src, splits.get(src, set()), [])
            param_shape = next(i.shape for i in traced.inputs if i.kind == "param" and i.name == inp.name)
            if tuple(inp.shape) != tuple(param_shape):
                pl, src = replicate, f"replicated (optimizer state of shape {list(inp.shape)})"
            else:
                src = f"follows param {inp.name!r}"
        elif inp.kind == "hparam":
            pl, src = replicate, "replicated (optimizer hyperparameter)"
        else:
            pl, src = next(batch)
        placements.append(_check_dims(inp, tuple(pl), src))
        sources.append(src)
    if fitted:
        log.debug("plan patterns left %d tensors Replicate where they have no dim to split: %s", len(fitted), "; ".join(fitted))
    return ResolvedPlan(tuple(placements), tuple(sources))


def _has_dim(inp: Any, p: Placement) -> bool:
    """Whether ``p`` is a shard of a dim ``inp`` has."""
    d = getattr(p, "dim", None)
    ndim = len(inp.shape)
    return isinstance(p, (Shard, pt.StridedShard)) and d is not None and -ndim <= d < ndim


def _fsdp_buffer(placements: tuple[Placement, ...], source: str, fsdp: tuple[int, ...]) -> tuple[tuple[Placement, ...], str]:
    """Under ``fsdp_axes`` a pattern or ``default_param`` shards parameters only, as
    ``fully_shard`` does: a buffer it matches (BatchNorm statistics, a causal mask,
    rotary frequencies, position ids) is Replicate on the FSDP axes, whole on every rank
    and never gathered. An exact FQN entry still shards a buffer where it says (the
    expansion gathers it once per phase, as a parameter, unless the step writes it)."""
    axes = [a for a in fsdp if not placements[a].is_replicate()]
    if not axes:
        return placements, source
    out = tuple(Replicate() if a in axes else p for a, p in enumerate(placements))
    return out, f"{source}, Replicate on FSDP axes {axes} (a buffer: FSDP shards parameters)"


def _fit_wildcard(
    inp: Any, placements: tuple[Placement, ...], source: str, splits: set[int], fitted: list[str]
) -> tuple[tuple[Placement, ...], str]:
    """A pattern (``"*"``, a glob) or ``default_param`` shards only what can be sharded:
    ``Shard(d)`` on a tensor without dim ``d`` (a 0-d buffer such as BatchNorm's
    ``num_batches_tracked``, a bias under ``Shard(1)``) becomes Replicate on that mesh
    axis, recorded in ``fitted`` for a DEBUG log, provided the pattern splits some other
    tensor it matches on that axis (``splits``). An exact FQN entry is never changed:
    one that names a dim the tensor lacks is an error (:func:`_check_dims`)."""
    ndim = len(inp.shape)
    out, axes = [], []
    for axis, p in enumerate(placements):
        if isinstance(p, (Shard, pt.StridedShard)) and not _has_dim(inp, p) and axis in splits:
            out.append(Replicate())
            axes.append(axis)
        else:
            out.append(p)
    if not axes:
        return placements, source
    why = "a 0-d tensor" if ndim == 0 else f"a {ndim}-d tensor"
    fitted.append(f"{inp.label} {list(inp.shape)} on mesh axes {axes} ({why})")
    return tuple(out), f"{source}, Replicate on mesh axes {axes} ({why} has no dim to split there)"


def _batch_placements(plan: Plan, batch_inputs: list[Any], ndim: int) -> list[tuple[tuple[Placement, ...], str]]:
    replicate = (Replicate(),) * ndim
    if plan.default_input is not None:
        default_input = normalize_placements(plan.default_input, ndim, "default_input")
    else:
        default_input = (Shard(0),) + (Replicate(),) * (ndim - 1)
    inputs_by_index: dict[int, Any] = {}
    inputs_by_path: dict[str, Any] = {}
    if isinstance(plan.inputs, Mapping):
        inputs_by_path = dict(plan.inputs)
    elif plan.inputs is not None:
        inputs_by_index = dict(enumerate(plan.inputs))
    known_paths = {i.name for i in batch_inputs}
    for path in inputs_by_path:
        if path not in known_paths:
            raise ValueError(f"plan input {path!r} names no batch tensor; batch tensors are {sorted(known_paths)}")
    out = []
    for pos, inp in enumerate(batch_inputs):
        if inp.name in inputs_by_path:
            pl, src = normalize_placements(inputs_by_path[inp.name], ndim, f"plan input {inp.name!r}"), f"inputs[{inp.name!r}]"
        elif pos in inputs_by_index:
            pl, src = normalize_placements(inputs_by_index[pos], ndim, f"plan input {pos}"), f"inputs[{pos}]"
        else:
            pl, src = default_input, "default_input"
        if len(inp.shape) == 0:
            pl, src = replicate, "replicated (0-d tensor)"
        out.append((_check_dims(inp, tuple(pl), src), src))
    return out


def _check_dims(inp: Any, placements: tuple[Placement, ...], source: str = "the plan") -> tuple[Placement, ...]:
    """Validate shard dims against the tensor's rank and make them non-negative.

    ``source`` says where the placements came from (``plan['l1.*']``), for the message.
    """
    ndim = len(inp.shape)
    what = f"{inp.label} (shape {list(inp.shape)}) gets placements {list(placements)!r} from {source}"
    out = []
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            if not -ndim <= p.dim < ndim:
                dims = f"a dim in [0, {ndim - 1}] (or [{-ndim}, -1])" if ndim else "none (a 0-d tensor has no dim to split)"
                where = (
                    f"Plan(inputs={{{inp.name!r}: ...}}) sets it" if inp.kind == "batch"
                    else f"in {source}" if source.startswith(f"plan[{inp.name!r}]")
                    else f"{source}: no tensor it matches has that dim"
                )
                raise ValueError(
                    f"{what}: Shard({p.dim}) on mesh axis {axis} is out of range for a {ndim}-d tensor; expected "
                    f"{dims}. fix: shard a dim the tensor has, or use Replicate() on mesh axis {axis} ({where})"
                )
            p = Shard(p.dim % ndim)
        elif isinstance(p, Partial) and inp.kind != "batch":
            raise ValueError(
                f"{what}: {p!r} on mesh axis {axis} is only meaningful for batch inputs, not for a {inp.kind} "
                f"(its one value would be split into per-rank terms of a sum). fix: use Shard(d) or Replicate() "
                f"for {inp.kind}s; gradients become Partial by themselves where the program needs it"
            )
        out.append(p)
    return tuple(out)
