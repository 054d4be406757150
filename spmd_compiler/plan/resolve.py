"""Resolving a Plan: FQN patterns and ParallelStyles matched against a traced step's
inputs, giving one placements tuple (and where it came from) per graph input."""

from __future__ import annotations

import difflib
import fnmatch
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from .. import _private_torch as pt
from .placements import ResolvedPlan, _check_dims, normalize_placements
from .problems import Problems

if TYPE_CHECKING:
    from .spec import Plan

log = logging.getLogger(__name__)


def _is_style(value: Any) -> bool:
    try:
        from torch.distributed.tensor.parallel import ParallelStyle
    except ImportError:  # pragma: no cover
        return False
    return isinstance(value, ParallelStyle)


def _style_axis(plan: Plan, mesh: Any) -> int:
    names = list(mesh.mesh_dim_names or [])
    ax = plan.style_axis
    if ax is None:
        return names.index("tp") if "tp" in names else mesh.ndim - 1
    if isinstance(ax, int):
        if not 0 <= ax < mesh.ndim:
            raise ValueError(f"style_axis {ax} is out of range for a {mesh.ndim}-D mesh; expected an index in "
                             f"[0, {mesh.ndim - 1}] or a mesh axis name {names}. fix: Plan(style_axis=...) one of them")
        return ax
    if ax not in names:
        raise ValueError(f"style_axis {ax!r} is not a mesh axis name; mesh axes are {names}. "
                         f"fix: Plan(style_axis=...) one of them, or an index in [0, {mesh.ndim - 1}]")
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
    """Every input's placements; every bad entry of the plan in one error (:class:`Problems`)."""
    problems = Problems()
    ndim = mesh.ndim
    replicate = (Replicate(),) * ndim
    default_param = replicate
    with problems.entry():
        if plan.default_param is not None:
            default_param = normalize_placements(plan.default_param, ndim, "default_param")

    state = traced.state
    named = list(state.params) + list(state.buffers) + list(state.aliases)
    canonical = {**{n: n for n in list(state.params) + list(state.buffers)}, **state.aliases}

    # expand ParallelStyles into per-parameter placements on the style axis
    exact: dict[str, tuple[Placement, ...]] = {}
    patterns: list[tuple[str, tuple[Placement, ...]]] = []
    model = getattr(traced, "model", None)
    for key, value in plan.params.items():
        with problems.entry():
            _param_entry(plan, key, value, mesh, model, default_param, canonical, named, exact, patterns)
    if plan.strict:
        for pat, pl in patterns:
            if not any(fnmatch.fnmatchcase(n, pat) for n in named):
                problems.add(ValueError(
                    f"plan pattern {pat!r} matches no parameter or buffer of the model (it gives {list(pl)!r})."
                    + _near(pat, named)
                    + " fix: match the names of model.named_parameters() / named_buffers() ('*' also matches dots), "
                    "or pass Plan(strict=False) to allow patterns that match nothing."
                ))
    return _placements(plan, traced, mesh, problems, exact, patterns, default_param)


def _param_entry(plan: Plan, key: str, value: Any, mesh: Any, model: Any, default_param: tuple, canonical: dict,
                 named: list[str], exact: dict, patterns: list) -> None:
    """Check one ``plan.params`` entry and record it in ``exact`` or ``patterns`` (a
    ParallelStyle: the parameters it gives placements, in ``exact``)."""
    ndim = mesh.ndim
    if _is_style(value):
        if model is None:
            raise ValueError("ParallelStyle plans need the model; compile through spmd_compiler.compile or pass model=")
        axis = _style_axis(plan, mesh)
        modules = [n for n, _ in model.named_modules() if n and fnmatch.fnmatchcase(n, key)]
        if not modules and plan.strict:
            raise ValueError(
                f"plan entry {key!r} ({type(value).__name__}) matches no module FQN."
                + _near(key, [n for n, _ in model.named_modules() if n])
                + " fix: use a module name from model.named_modules() (or a glob over them), or pass Plan(strict=False)"
            )
        for mod_name in modules:
            for fqn, p in _style_params(value, model.get_submodule(mod_name), mod_name).items():
                pl = list(default_param)
                pl[axis] = p
                exact[fqn] = tuple(pl)
        return
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


def _placements(plan: Plan, traced: Any, mesh: Any, problems: Problems, exact: dict, patterns: list,
                default_param: tuple) -> ResolvedPlan:
    """The placements of every input of ``traced`` from the checked entries (then every
    problem found, raised in one error)."""
    ndim = mesh.ndim
    replicate = (Replicate(),) * ndim
    state = traced.state

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

    batch = iter(_batch_placements(plan, [i for i in traced.inputs if i.kind == "batch"], ndim, problems))
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
    fsdp: tuple[int, ...] = ()
    with problems.entry():
        fsdp = plan.fsdp_axis_indices(mesh)
    for inp in traced.inputs:
        entry = None  # the plan entry behind its placements: one problem per entry (a parameter, its grad and state)
        if inp.kind in ("param", "buffer"):
            pl, src, wild = for_fqn(inp.name)
            entry = src
            if wild:
                pl, src = _fit_wildcard(inp, pl, src, splits.get(src, set()), fitted)
                if inp.kind == "buffer" and fsdp:
                    pl, src = _fsdp_buffer(pl, src, fsdp)
        elif inp.kind == "grad":  # stored like its parameter (FSDP: sharded, as after a reduce-scatter)
            pl, src, wild = for_fqn(inp.name)
            entry = src
            if wild:
                pl, src = _fit_wildcard(inp, pl, src, splits.get(src, set()), [])
            src = f"follows param {inp.name!r}"
        elif inp.kind == "optim":
            pl, src, wild = for_fqn(inp.name)
            entry = src
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
        checked = tuple(pl)
        with problems.entry(entry):
            checked = _check_dims(inp, checked, src)
        placements.append(checked)
        sources.append(src)
    problems.raise_all()
    if fitted:
        log.debug("plan patterns left %d tensors Replicate where they have no dim to split: %s", len(fitted), "; ".join(fitted))
    grads = {inp.name: tuple(pl) for inp, pl in zip(traced.inputs, placements) if inp.kind == "param"}
    if plan.defer_grad_sync:
        axes = _data_axes(traced.inputs, placements, fsdp)
        grads = {name: _deferred(pl, axes, fsdp) for name, pl in grads.items()}
        for i, inp in enumerate(traced.inputs):
            if inp.kind == "grad":
                placements[i] = grads[inp.name]
                sources[i] = f"follows param {inp.name!r}, Partial on data axes {list(axes)} (defer_grad_sync=True)"
    return ResolvedPlan(tuple(placements), tuple(sources), grads)


def _data_axes(inputs: Any, placements: list[tuple[Placement, ...]], fsdp: tuple[int, ...]) -> tuple[int, ...]:
    """The mesh axes on which the plan splits a batch input, and the FSDP axes: those over
    which a gradient is a sum of per-rank terms."""
    axes = set(fsdp)
    for inp, pl in zip(inputs, placements):
        if inp.kind == "batch":
            axes.update(a for a, p in enumerate(pl) if not p.is_replicate())
    return tuple(sorted(axes))


def _deferred(placements: tuple[Placement, ...], axes: tuple[int, ...], fsdp: tuple[int, ...]) -> tuple[Placement, ...]:
    """A kept gradient under ``defer_grad_sync``: unreduced (``Partial``) on the data axes
    where its parameter is whole on every rank, or a shard on an FSDP axis (the gradient
    is then full size on every rank, as FSDP2's without gradient sync); elsewhere laid out
    like its parameter."""
    return tuple(
        Partial() if a in axes and (p.is_replicate() or (a in fsdp and p.is_shard())) else p for a, p in enumerate(placements)
    )


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


def _batch_placements(plan: Plan, batch_inputs: list[Any], ndim: int,
                      problems: Problems | None = None) -> list[tuple[tuple[Placement, ...], str]]:
    """``(placements, source)`` per batch input; its bad entries recorded in ``problems``
    (then each gets Replicate), or raised in one error when none is given."""
    own = problems is None
    problems = Problems() if problems is None else problems
    replicate = (Replicate(),) * ndim
    default_input = (Shard(0),) + (Replicate(),) * (ndim - 1)
    with problems.entry():
        if plan.default_input is not None:
            default_input = normalize_placements(plan.default_input, ndim, "default_input")
    inputs_by_index: dict[int, Any] = {}
    inputs_by_path: dict[str, Any] = {}
    if isinstance(plan.inputs, Mapping):
        inputs_by_path = dict(plan.inputs)
    elif plan.inputs is not None:
        inputs_by_index = dict(enumerate(plan.inputs))
    known_paths = {i.name for i in batch_inputs}
    for path in inputs_by_path:
        if path not in known_paths:
            problems.add(ValueError(
                f"plan input {path!r} names no batch tensor; batch tensors are {sorted(known_paths)}."
                + _near(path, sorted(known_paths))
                + " fix: key Plan(inputs=...) by one of those paths (batch[i] for the i-th positional batch argument)"))
    out = []
    for pos, inp in enumerate(batch_inputs):
        pl, src = replicate, "default_input"
        with problems.entry():
            if inp.name in inputs_by_path:
                pl, src = normalize_placements(inputs_by_path[inp.name], ndim, f"plan input {inp.name!r}"), f"inputs[{inp.name!r}]"
            elif pos in inputs_by_index:
                pl, src = normalize_placements(inputs_by_index[pos], ndim, f"plan input {pos}"), f"inputs[{pos}]"
            else:
                pl, src = default_input, "default_input"
        if len(inp.shape) == 0:
            pl, src = replicate, "replicated (0-d tensor)"
        checked = tuple(pl)
        with problems.entry("default_input" if src == "default_input" else None):
            checked = _check_dims(inp, checked, src)
        out.append((checked, src))
    if own:
        problems.raise_all()
    return out
