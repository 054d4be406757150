"""Checks that a per-rank program is distributed as its plan says.

A test that compares a sharded run with one device passes just as well when nothing was
sharded: the one-device program, run on every rank, gives the one-device answer.
:func:`assert_distributed` closes that gap in one line::

    run = assert_spmd_matches(fn, args, mesh, placements)
    assert_distributed(run, collectives={"all_reduce/dp": 1})

Terms:

* *program*: what the numerics APIs produce - an ``ExpandedStep``, a ``CompiledStep``
  (its ``last`` step), a ``SimulatedTraining`` (its ``expansions``), a
  ``TrainingComparison`` (its ``sim``), an ``SpmdRun`` (its ``steps``), a dict of mesh
  coordinate to ExpandedStep, or a bare per-rank ``fx.GraphModule``.
* *local shape*: the shape of an input placeholder's ``meta["val"]``; it must be the
  global shape split by the input's placements at that rank's coordinate, chunked as
  ``torch.chunk`` chunks (DTensor's uneven shards: ``ceil(n / ranks)`` rows per rank,
  the last ranks smaller or empty).
* *sharded input*: one whose placements split a dim of global size >= 2 over a mesh
  axis of size > 1, so no rank holds all of it.
* *collective key*: ``"kind"``, ``"axis"``, ``"phase"`` or any of them joined by ``/``
  (``"all_reduce/dp"``, ``"forward/all_gather"``); a collective matches a key when it
  matches every part. Kinds, axes and phases are those of
  :func:`spmd_compiler.dump.summary.comm_summary`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from .. import _private_torch as pt
from ..dump.summary import PHASE_ORDER, CommSummary, comm_summary
from ..expand.redistribute import COLLECTIVE_OPS
from ..expand.values import placements_text
from .symbolic_checks import check_run, default_batch_sizes, is_symbolic, mesh_shape_of, served_sizes, size_contexts

__all__ = ["Distribution", "assert_distributed", "distribution_of"]

KINDS = tuple(sorted(set(COLLECTIVE_OPS.values())))
_SHOWN = 8  # inputs listed in an error message


@dataclass(frozen=True)
class Distribution:
    """How a per-rank program is distributed, read from the plan it records.

    Attributes:
        mesh: mesh axis name -> size.
        coordinates: the mesh coordinates whose programs were checked.
        placements: input label (``l1.weight``, ``batch[0]``, ``l1.weight['exp_avg']``)
            -> placements text (``S(0)R``), in input order.
        sharded: labels of the sharded inputs (see the module docstring).
        comm: collectives per rank per step (the first checked coordinate's program;
            every other one was checked to have the same kinds and counts).
        batch_sizes: for a symbolic program (``dynamic=True``), the global batch sizes
            it was fed and checked at (placements and ``sharded`` are those of the largest).
    """

    mesh: dict[str, int]
    coordinates: tuple[tuple[int, ...], ...]
    placements: dict[str, str]
    sharded: tuple[str, ...]
    comm: CommSummary = field(repr=False)
    batch_sizes: tuple[int, ...] = ()  # a symbolic program (dynamic=True): the global batch sizes it was checked at

    @property
    def num_collectives(self) -> int:
        return self.comm.total_count

    @property
    def collectives(self) -> dict[str, int]:
        """``"phase/kind/axis"`` -> count."""
        return {f"{r.phase}/{r.kind}/{r.axis}": r.count for r in self.comm.rows}

    def count(self, key: str) -> int:
        """How many collectives match ``key`` (``"all_reduce"``, ``"dp"``, ``"all_reduce/dp"``...)."""
        parts = _key_parts(key, tuple(self.mesh))
        return sum(r.count for r in self.comm.rows if all(p in (r.phase, r.kind, r.axis) for p in parts))

    def describe(self) -> str:
        """A few lines for error messages: mesh, inputs and their placements, collectives."""
        items = list(self.placements.items())
        shown = ", ".join(f"{k}: {v}" for k, v in items[:_SHOWN]) + (f", ... ({len(items)} inputs)" if len(items) > _SHOWN else "")
        sharded = ", ".join(self.sharded[:_SHOWN]) + (f", ... ({len(self.sharded)} sharded)" if len(self.sharded) > _SHOWN else "")
        comm = ", ".join(f"{k} x{v}" for k, v in self.collectives.items()) or "none"
        return f"mesh {self.mesh}; inputs {shown}; sharded inputs [{sharded}]; collectives {comm}"


def distribution_of(program: Any, *, batch_sizes: Sequence[int] | None = None) -> Distribution:
    """Check every input's local shape against the plan the program records; report how
    it is distributed.

    Raises AssertionError when a placeholder's local shape is not its global shape split
    by its placements at its rank's coordinate, when the recorded specs disagree, or when
    two ranks' programs have different collectives. Raises TypeError for an argument
    that is not a program (see the module docstring for what is accepted).

    A symbolic program (``dynamic=True``: batch sizes are inputs) is checked at each of
    ``batch_sizes`` (default: even and uneven sizes for the mesh, fewer rows than ranks
    included), fed like a call of that size, and run on fake tensors
    (:mod:`.symbolic_checks`).
    """
    programs = _programs(program)
    if not any(is_symbolic(gm) for _, gm, _ in programs):
        if batch_sizes is not None:
            raise ValueError(f"batch_sizes={list(batch_sizes)!r} is for symbolic programs (dynamic=True); this program "
                             f"was compiled for one batch shape")
        return _distribution(programs)
    if batch_sizes is not None:
        batch_sizes = list(batch_sizes)
        if not batch_sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in batch_sizes):
            raise ValueError(f"batch_sizes={batch_sizes!r}: expected a non-empty list of global batch sizes >= 0")
    sizes = served_sizes(programs, batch_sizes if batch_sizes is not None else default_batch_sizes(mesh_shape_of(programs)),
                         explicit=batch_sizes is not None)
    for b in sorted(sizes):
        contexts = size_contexts(programs, b)
        found = _distribution(programs, contexts, b)
        check_run(programs, contexts, b)
    return dataclasses.replace(found, batch_sizes=tuple(sorted(sizes)))


def _distribution(programs: list[tuple[tuple[int, ...], fx.GraphModule, Any]], contexts: Mapping[Any, Any] | None = None,
                  size: int | None = None) -> Distribution:
    """distribution_of for ``programs`` (symbolic ones: at the sizes of ``contexts``, per coordinate)."""
    placements: dict[str, str] = {}
    sharded: list[str] = []
    summaries: dict[int, tuple[tuple[int, ...], CommSummary]] = {}
    mesh: dict[str, int] = {}
    for i, (coord, gm, expected) in enumerate(programs):
        mesh_shape, axis_names, inputs = _inputs_of(gm, expected)
        mesh = dict(zip(axis_names, mesh_shape))
        if len(coord) != len(mesh_shape):
            raise AssertionError(f"coordinate {coord} has {len(coord)} entries; expected one per axis of mesh {mesh}")
        value = contexts[coord].value if contexts is not None else int
        for label, kind, spec, node in inputs:
            global_shape = tuple(value(s) for s in spec.shape)
            want = local_shape(global_shape, spec.placements, mesh_shape, coord)
            got = tuple(value(s) for s in node.meta["val"].shape)
            if got != want:
                at = f" at global batch size {size} (local {list(node.meta['val'].shape)})" if size is not None else ""
                raise AssertionError(
                    f"{kind} input {label!r} on the rank at coordinate {coord}{at}: local shape {list(got)}, expected "
                    f"{list(want)} (global {list(global_shape)} split by {placements_text(spec.placements)} over mesh "
                    f"{mesh}); the per-rank program does not hold the shard its plan says"
                )
            if i == 0:
                placements[label] = placements_text(spec.placements)
                if _is_sharded(global_shape, spec.placements, mesh_shape):
                    sharded.append(label)
        if id(gm) not in summaries:
            summaries[id(gm)] = (coord, comm_summary(gm))
    (first_coord, first), *others = summaries.values()
    for coord, other in others:
        a, b = _counts(first), _counts(other)
        if a != b:
            raise AssertionError(
                f"the programs of coordinates {first_coord} and {coord} have different collectives: "
                f"{a} vs {b}; expected every rank to issue the same collectives (it would hang)"
            )
    return Distribution(mesh, tuple(c for c, _, _ in programs), placements, tuple(sharded), first)


def assert_distributed(
    program: Any,
    *,
    collectives: int | Mapping[str, int] | None = None,
    sharded: Collection[str] | None = None,
    dynamic: bool | None = None,
    batch_sizes: Sequence[int] | None = None,
) -> Distribution:
    """Assert that ``program`` is really distributed, as its plan says.

    Checks (AssertionError naming what was expected and what was found):

    * every input's local shape is its global shape split by its placements at the
      rank's coordinate (:func:`distribution_of`);
    * something is distributed: at least one input is sharded over a mesh axis of size
      > 1, or the program has at least one collective;
    * ``collectives``: an int is the least number of collectives per rank; a mapping
      gives the exact count for each collective key (``{"all_reduce/dp": 4,
      "all_gather": 0}``, see the module docstring);
    * ``sharded``: labels of inputs that must be sharded (``["l1.weight", "batch[0]"]``).
    * a symbolic program (``dynamic=True``, batch sizes are inputs; detected): all of the
      above at each of ``batch_sizes`` (default: even and uneven global sizes for the mesh,
      fewer rows than ranks included), fed as a call of that size, plus a run on fake
      tensors where every shape and integer size the program computes must be what it
      records for that size and every collective's buffer the same shape on every rank
      of its group (:mod:`.symbolic_checks`). ``dynamic=True`` also requires the program
      to be symbolic (a step that fell back to one program per shape fails), ``False``
      requires one compiled for one shape.

    Returns the :class:`Distribution` for further checks.
    """
    if collectives is not None and not isinstance(collectives, Mapping):
        if isinstance(collectives, bool) or not isinstance(collectives, int) or collectives < 1:
            raise ValueError(
                f"collectives={collectives!r}: expected None, a least count >= 1, or a mapping of collective key "
                f"to exact count (e.g. {{'all_reduce': 0}} to require none)"
            )
    if isinstance(sharded, str):
        raise TypeError(f"sharded={sharded!r}: expected a collection of input labels, got a str (write [{sharded!r}])")
    if dynamic is not None:
        symbolic = any(is_symbolic(gm) for _, gm, _ in _programs(program))
        if symbolic != bool(dynamic):
            raise AssertionError(
                "dynamic=True: expected a symbolic program (the global batch sizes as inputs, one program for every "
                "size), got one compiled for one batch shape (see the INFO log of the compile for why it fell back)"
                if dynamic else
                "dynamic=False: expected a program compiled for one batch shape, got a symbolic one (batch sizes as inputs)"
            )
    dist = distribution_of(program, batch_sizes=batch_sizes)
    if not dist.sharded and dist.num_collectives == 0:
        raise AssertionError(
            "nothing was distributed: expected at least one input sharded over a mesh axis of size > 1 or at "
            f"least one collective, got neither ({dist.describe()}); every rank runs the single-device program"
        )
    if isinstance(collectives, Mapping):
        wrong = []
        for key, want in collectives.items():
            if isinstance(want, bool) or not isinstance(want, int) or want < 0:
                raise ValueError(f"collectives[{key!r}] = {want!r}: expected a count >= 0")
            got = dist.count(key)
            if got != want:
                wrong.append(f"{key!r}: expected {want}, found {got}")
        if wrong:
            raise AssertionError(f"collectives per rank: {'; '.join(wrong)}\n{dist.comm.table()}")
    elif collectives is not None and dist.num_collectives < collectives:
        raise AssertionError(
            f"expected at least {collectives} collective(s) per rank, found {dist.num_collectives}\n{dist.comm.table()}"
        )
    if sharded is not None:
        unknown = [s for s in sharded if s not in dist.placements]
        if unknown:
            raise ValueError(f"sharded names {unknown}, which are not inputs of the program; inputs are {list(dist.placements)}")
        missing = [f"{s} ({dist.placements[s]})" for s in sharded if s not in dist.sharded]
        if missing:
            raise AssertionError(
                f"expected sharded over a mesh axis of size > 1: {missing}; sharded inputs are {list(dist.sharded)} "
                f"(mesh {dist.mesh})"
            )
    return dist


# ----------------------------------------------------------------------------- shapes


def chunk_sizes(size: int, n: int) -> list[int]:
    """Sizes of ``torch.chunk`` of ``size`` rows into ``n`` parts, padded with empty parts."""
    full = -(-size // n) if size else 0
    return [max(0, min(size, (j + 1) * full) - j * full) for j in range(n)]


def local_shape(global_shape: Sequence[int], placements: Sequence[Any], mesh_shape: Sequence[int], coord: Sequence[int]) -> tuple[int, ...]:
    """The shape the rank at ``coord`` holds: placements apply left to right (mesh axis 0
    splits first); ``Shard(d)`` keeps chunk ``coord[axis]`` of dim ``d``,
    ``_StridedShard(d, sf)`` that chunk of each of ``sf`` blocks; other placements keep all."""
    shape = [int(s) for s in global_shape]
    for axis, p in enumerate(placements):
        n, j = int(mesh_shape[axis]), int(coord[axis])
        if isinstance(p, pt.StridedShard):
            shape[p.dim] = sum(chunk_sizes(b, n)[j] for b in chunk_sizes(shape[p.dim], int(p.split_factor)))
        elif p.is_shard():
            shape[p.dim] = chunk_sizes(shape[p.dim], n)[j]
    return tuple(shape)


def _is_sharded(global_shape: Sequence[int], placements: Sequence[Any], mesh_shape: Sequence[int]) -> bool:
    return any((p.is_shard() or isinstance(p, pt.StridedShard)) and mesh_shape[a] > 1 and global_shape[p.dim] >= 2 for a, p in enumerate(placements))


# ----------------------------------------------------------------------------- programs


def _programs(program: Any) -> list[tuple[tuple[int, ...], fx.GraphModule, Any]]:
    """``(coordinate, per-rank gm, ExpandedStep or None)`` for every rank ``program`` has."""
    what = type(program).__name__
    if isinstance(program, fx.GraphModule):
        return [(_coordinate_of(program), program, None)]
    if hasattr(program, "sim") and hasattr(program.sim, "expansions"):  # TrainingComparison
        program = program.sim
    if hasattr(program, "expansions"):  # SimulatedTraining
        steps = program.expansions
        if not steps:
            raise ValueError(f"the {what} has no compiled program yet: call step() first")
        return _from_dict(steps, what)
    if isinstance(getattr(program, "steps", None), Mapping):  # SpmdRun
        return _from_dict(program.steps, what)
    if isinstance(program, Mapping):
        if not program:
            raise ValueError("got an empty dict; expected mesh coordinate -> ExpandedStep")
        return _from_dict(program, what)
    if _is_expanded(program):
        return [(tuple(program.mctx.coordinate), program.gm, program)]
    if hasattr(program, "last"):  # CompiledStep
        if program.last is None:
            raise ValueError(f"the {what} has not compiled a step yet: call it once first")
        return _programs(program.last)
    raise TypeError(
        f"expected a program: ExpandedStep, CompiledStep, SimulatedTraining, TrainingComparison, SpmdRun, a dict "
        f"of mesh coordinate to ExpandedStep, or a per-rank fx.GraphModule; got {what}"
    )


def _is_expanded(x: Any) -> bool:
    return all(hasattr(x, a) for a in ("gm", "input_specs", "mctx", "traced"))


def _from_dict(steps: Mapping[Any, Any], what: str) -> list[tuple[tuple[int, ...], fx.GraphModule, Any]]:
    out = []
    for coord, step in steps.items():
        if not _is_expanded(step):
            raise TypeError(f"{what}: the program of coordinate {coord} is a {type(step).__name__}; expected an ExpandedStep")
        out.append((tuple(int(c) for c in coord), step.gm, step))
    return out


def _coordinate_of(gm: fx.GraphModule) -> tuple[int, ...]:
    return tuple(int(n.meta["val"]) for n in gm.graph.find_nodes(op="placeholder") if "spmd_coord" in n.meta)


def _inputs_of(gm: fx.GraphModule, step: Any) -> tuple[tuple[int, ...], tuple[str, ...], list[tuple[str, str, Any, fx.Node]]]:
    """Mesh shape, axis names and ``(label, kind, spec, placeholder)`` of every input.

    With an ExpandedStep, the placeholders are matched to ``traced.inputs`` and
    ``input_specs`` in order, and their recorded specs must agree with those."""
    nodes = [n for n in gm.graph.find_nodes(op="placeholder") if "spmd_coord" not in n.meta and "spmd_size" not in n.meta]
    missing = [n.name for n in nodes if "spmd_spec" not in n.meta or not isinstance(n.meta.get("val"), torch.Tensor)]
    if missing:
        raise AssertionError(f"placeholders {missing} have no meta['spmd_spec'] or local tensor meta['val']; expected every input of a per-rank program to record both")
    if step is None:
        if not nodes:
            raise AssertionError("the program has no input placeholders; expected a per-rank program with inputs")
        mesh = nodes[0].meta["spmd_spec"].mesh
        names = tuple(mesh.mesh_dim_names or [f"axis{i}" for i in range(mesh.ndim)])
        rows = []
        for n in nodes:
            inp = n.meta.get("spmd_input")
            rows.append((inp.label if inp is not None else n.name, inp.kind if inp is not None else "?", n.meta["spmd_spec"], n))
        return tuple(int(s) for s in mesh.shape), names, rows
    inputs, specs = list(step.traced.inputs), list(step.input_specs)
    if not len(nodes) == len(inputs) == len(specs):
        raise AssertionError(
            f"the per-rank program has {len(nodes)} input placeholders, its step {len(inputs)} traced inputs and "
            f"{len(specs)} input specs; expected one placeholder per traced input"
        )
    rows = []
    for n, inp, spec in zip(nodes, inputs, specs):
        rec = n.meta["spmd_spec"]
        if tuple(rec.placements) != tuple(spec.placements) or _dims(rec.shape) != _dims(spec.shape):
            raise AssertionError(
                f"{inp.kind} input {inp.label!r}: placeholder {n.name} records {placements_text(rec.placements)} "
                f"{list(rec.shape)}, the step's input_specs {placements_text(spec.placements)} {list(spec.shape)}; "
                f"expected the same spec (inputs are sharded by input_specs)"
            )
        # a symbolic dim (dynamic=True) against the trace's example size: never compared (== on a SymInt is a guard)
        if len(spec.shape) != len(inp.shape) or any(not pt.is_symbolic(a) and int(a) != int(b) for a, b in zip(spec.shape, inp.shape)):
            raise AssertionError(f"{inp.kind} input {inp.label!r}: spec global shape {list(spec.shape)}, traced shape {list(inp.shape)}; expected equal")
        rows.append((inp.label, inp.kind, spec, n))
    return tuple(step.mctx.shape), tuple(step.mctx.axis_names), rows


def _dims(shape: Any) -> tuple[str, ...]:
    """A shape as text: sizes and size expressions compared without guarding on a SymInt."""
    return tuple(str(d) for d in shape)


# ----------------------------------------------------------------------------- collectives


def _counts(summary: CommSummary) -> dict[str, int]:
    return {f"{r.phase}/{r.kind}/{r.axis}": r.count for r in summary.rows}


def _key_parts(key: str, axis_names: tuple[str, ...]) -> list[str]:
    if not isinstance(key, str) or not key:
        raise TypeError(f"collective key {key!r}: expected a non-empty str such as 'all_reduce' or 'all_reduce/dp'")
    parts = key.split("/")
    valid = set(KINDS) | set(axis_names) | set(PHASE_ORDER)
    bad = [p for p in parts if p not in valid]
    if bad:
        raise ValueError(
            f"collective key {key!r}: {bad} is not a collective kind, mesh axis or phase; expected parts of "
            f"kinds {list(KINDS)}, axes {list(axis_names)}, phases {list(PHASE_ORDER)}"
        )
    return parts
