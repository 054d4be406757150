"""Run every rank of a per-rank graph in one process, in lockstep.

The per-rank graph is executed node by node for all ranks at once; a functional
collective is computed from the values of every member of its group. No process group,
threads or real communication are involved, so all ranks of an 8-way program run on one
core and a wrong collective shows up as a wrong number, not a hang.

The simulation is no kinder than a real backend (gloo, NCCL):

* **Groups come from the program.** A collective runs on the group its ``group_name``
  argument names, resolved to a mesh axis as the runtime resolves it (through the mesh's
  process groups), never from the node's metadata; ``group_size`` must match it.
* **Nothing is ready before its wait.** Issuing a collective gives a poisoned tensor
  (NaN, or the integer minimum); ``wait_tensor`` fills it in place. A use of the
  result before its wait reads poison.
* **Inputs are read until the wait.** ``all_gather_into_tensor``, ``reduce_scatter_tensor``
  and ``all_to_all_single`` read their input when they are waited on, so a write into
  the input while the collective is in flight changes the result, as it can on gloo.
  ``all_reduce`` copies its input when issued (torch's functional all_reduce clones it
  before the in-place collective), and is simulated that way.
* **Each rank's share is summed in its own order.** A ``reduce_scatter_tensor`` gives rank
  ``j`` its chunk summed in ring order, from rank ``j + 1`` round to ``j`` itself, as
  NCCL's ring does; the ranks' chunks are then rounded differently, so a value meant to be
  the same on every rank that was taken from each rank's own chunk shows up (the harness
  compares Replicate outputs bit for bit). An ``all_reduce`` gives every rank the same bits.

Graphs may differ per rank (uneven shards give per-rank sizes) but must have the same
nodes in the same order; that is how expansion builds them.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .. import _private_torch as pt
from ..expand.chunks import local_offset, local_size
from ..expand.rules.random import is_random
from ..plan.context import head_tail_index

__all__ = [
    "rank_coordinates",
    "shard_tensor",
    "assemble",
    "run_lockstep",
    "group_axes_of",
    "check_replicas",
    "example_inputs",
]

c10d = torch.ops._c10d_functional


def rank_coordinates(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    """Mesh coordinate of every rank, in rank order (row-major, as ``init_device_mesh``)."""
    return list(itertools.product(*[range(s) for s in mesh_shape]))


def index_lists(shape: Sequence[int], placements: Sequence[Any], mesh_shape: Sequence[int], coord: Sequence[int],
                cp: Any = None) -> list[list[int]]:
    """For each dim, the global indices the rank at ``coord`` holds, in local order.

    Placements apply left to right: ``Shard(d)`` keeps chunk ``coord[axis]`` (torch.chunk
    sizes) of the current indices; ``_StridedShard(d, sf)`` splits them into ``sf`` blocks
    and keeps that chunk of every block. On the context-parallel axis of ``cp`` (a
    ``CPLayout``) with load balancing, a split keeps the rank's head and tail chunks
    (``plan.context.head_tail_index``) instead of one chunk.
    """
    idx = [list(range(n)) for n in shape]
    for axis, p in enumerate(placements):
        n, j = mesh_shape[axis], coord[axis]
        pick = _head_tail if cp is not None and cp.head_tail(axis) else _chunks
        if isinstance(p, pt.StridedShard):
            blocks = _chunks(idx[p.dim], int(p.split_factor))
            idx[p.dim] = [i for blk in blocks for i in pick(blk, n)[j]]
        elif isinstance(p, pt.Shard):
            idx[p.dim] = pick(idx[p.dim], n)[j]
    return idx


def _head_tail(items: list[int], n: int) -> list[list[int]]:
    return [[items[i] for i in head_tail_index(len(items), n, j)] for j in range(n)]


def _chunks(items: list[int], n: int) -> list[list[int]]:
    starts = [local_offset(len(items), n, j) for j in range(n)]
    return [items[s : s + local_size(len(items), n, j)] for j, s in enumerate(starts)]


def shard_tensor(t: torch.Tensor, placements: Sequence[Any], mesh_shape: Sequence[int], coord: Sequence[int], cp: Any = None) -> torch.Tensor:
    """The local tensor of the rank at ``coord`` for global ``t`` laid out as ``placements``.

    A Partial placement puts the whole value on coordinate 0 of that axis and the identity
    of its reduction elsewhere (zeros for a sum, ones for a product); avg, max and min
    keep the value on every coordinate (which they reduce back to it).
    """
    out = t
    for d, ix in enumerate(index_lists(tuple(t.shape), placements, mesh_shape, coord, cp)):
        if ix != list(range(t.shape[d])):
            out = out.index_select(d, torch.tensor(ix, dtype=torch.long, device=t.device))
    out = out.clone()
    for axis, p in enumerate(placements):
        if p.is_partial() and coord[axis] != 0:
            op = getattr(p, "reduce_op", "sum")
            if op == "sum":
                out.zero_()
            elif op == "product":
                out.fill_(1)
    return out


def assemble(placements: Sequence[Any], global_shape: Sequence[int], locals_by_coord: dict[tuple[int, ...], torch.Tensor], mesh_shape: Sequence[int],
             cp: Any = None) -> torch.Tensor:
    """Rebuild the global tensor from every rank's local tensor (sums Partial axes)."""
    first = next(iter(locals_by_coord.values()))
    out = torch.zeros(tuple(global_shape), dtype=first.dtype, device=first.device)
    partial_axes = [a for a, p in enumerate(placements) if p.is_partial()]
    for coord, local in locals_by_coord.items():
        if any(coord[a] != 0 for a, p in enumerate(placements) if p.is_replicate()):
            continue  # replicated copies: take coordinate 0 only
        ix = index_lists(tuple(global_shape), placements, mesh_shape, coord, cp)
        if any(len(i) == 0 for i in ix):
            continue
        grid = torch.meshgrid(*[torch.tensor(i, dtype=torch.long, device=first.device) for i in ix], indexing="ij") if ix else ()
        if partial_axes:
            out.index_put_(grid, local, accumulate=True) if ix else out.add_(local)
        else:
            out.index_put_(grid, local) if ix else out.copy_(local)
    return out


def _group_members(coord: tuple[int, ...], axis: int, mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    return [coord[:axis] + (j,) + coord[axis + 1 :] for j in range(mesh_shape[axis])]


def _reduce(values: list[torch.Tensor], op: str) -> torch.Tensor:
    acc = values[0].clone()
    for v in values[1:]:
        if op in ("sum", "avg"):
            acc = acc + v
        elif op == "max":
            acc = torch.maximum(acc, v)
        elif op == "min":
            acc = torch.minimum(acc, v)
        elif op == "product":
            acc = acc * v
        else:
            raise ValueError(f"unknown reduce op {op}")
    if op == "avg":
        acc = acc / len(values)
    return acc


_GROUP_SIZE_ARG = {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 2}


def _group_axis(node: fx.Node, args: tuple, group_axes: dict[str, int] | None, mesh_shape: Sequence[int]) -> int:
    """The mesh axis of the group a collective's arguments name."""
    name = args[-1]
    if group_axes is None:
        raise ValueError(
            f"run_lockstep met collective {node.name} on group {name!r} but was given no group_axes; fix: pass "
            f"group_axes={{group_name: mesh axis}} (e.g. from ExpandedStep.mctx.group_names)"
        )
    if name not in group_axes:
        raise RuntimeError(f"collective {node.name} names process group {name!r}, which is no axis of the mesh {dict(group_axes)}")
    axis = group_axes[name]
    op = node.target._opname if hasattr(node.target, "_opname") else str(node.target)
    if op in _GROUP_SIZE_ARG and int(args[_GROUP_SIZE_ARG[op]]) != mesh_shape[axis]:
        raise RuntimeError(f"collective {node.name} passes group_size {args[_GROUP_SIZE_ARG[op]]} for group {name!r} of {mesh_shape[axis]} ranks")
    return axis


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point() or t.is_complex():
        return torch.full_like(t, float("nan"))
    if t.dtype == torch.bool:
        return torch.ones_like(t)
    return torch.full_like(t, torch.iinfo(t.dtype).min)


def _collective(node: fx.Node, vals: dict[tuple, Any], mesh_shape: Sequence[int], axis: int) -> dict[tuple, Any]:
    """Compute a functional collective for every rank from every rank's input."""
    out: dict[tuple, Any] = {}
    for coord in vals:
        members = _group_members(coord, axis, mesh_shape)
        mine = members.index(coord)
        inputs = [vals[m][0] for m in members]
        if node.target is c10d.all_reduce.default:
            out[coord] = _reduce(inputs, vals[coord][1])
        elif node.target is c10d.all_gather_into_tensor.default:
            out[coord] = torch.cat([x.contiguous() for x in inputs], dim=0)
        elif node.target is c10d.reduce_scatter_tensor.default:
            ring = [inputs[(mine + 1 + k) % len(members)].chunk(len(members), dim=0)[mine] for k in range(len(members))]
            out[coord] = _reduce(ring, vals[coord][1]).clone()
        elif node.target is c10d.all_to_all_single.default:
            pieces = []
            for m, x in zip(members, inputs):
                in_splits = vals[m][2]
                start = sum(in_splits[:mine])
                pieces.append(x.narrow(0, start, in_splits[mine]))
            out[coord] = torch.cat(pieces, dim=0)
        else:
            raise NotImplementedError(f"simulation of {node.target}")
    return out


def group_axes_of(step: Any) -> dict[str, int]:
    """``{process group name: mesh axis}`` of an ExpandedStep's mesh, as the runtime
    resolves the names its collectives pass."""
    return {name: axis for axis, name in enumerate(step.mctx.group_names)}


def run_lockstep(
    graphs: dict[tuple[int, ...], fx.GraphModule],
    inputs: dict[tuple[int, ...], list[Any]],
    mesh_shape: Sequence[int],
    *,
    group_axes: dict[str, int] | None = None,
    record: dict[tuple[int, ...], dict[str, Any]] | None = None,
) -> dict[tuple[int, ...], list[Any]]:
    """Run the per-rank graphs of all ranks together; returns each rank's outputs.

    ``graphs`` and ``inputs`` are keyed by mesh coordinate; ``inputs[c]`` excludes the
    coordinate arguments (they are supplied here). ``group_axes`` maps each process
    group name the graphs pass to collectives to its mesh axis (``{name: axis for axis,
    name in enumerate(step.mctx.group_names)}``). If ``record`` is a dict, it receives
    every rank's value of every node, by node name (values later mutated in place are
    recorded as they end up).
    """
    coords = list(graphs)
    node_lists = {c: list(graphs[c].graph.nodes) for c in coords}
    lengths = {len(v) for v in node_lists.values()}
    if len(lengths) != 1:
        raise ValueError(f"per-rank graphs differ in node count {sorted(lengths)}; cannot run them in lockstep")
    envs: dict[tuple, dict[fx.Node, Any]] = {c: {} for c in coords}
    feeds = {c: iter(list(c) + list(inputs[c])) for c in coords}
    results: dict[tuple, list[Any]] = {}
    # collectives in flight, by the issuing node's name: (node, every rank's args, axis)
    in_flight: dict[str, tuple[fx.Node, dict[tuple, Any], int]] = {}
    for i in range(len(node_lists[coords[0]])):
        nodes = {c: node_lists[c][i] for c in coords}
        ref = nodes[coords[0]]
        if ref.op == "placeholder":
            for c in coords:
                envs[c][nodes[c]] = next(feeds[c])
            continue
        if ref.op == "get_attr":
            for c in coords:
                envs[c][nodes[c]] = getattr(graphs[c], nodes[c].target)
            continue
        if ref.op == "output":
            for c in coords:
                results[c] = pytree.tree_map_only(fx.Node, lambda n: envs[c][n], nodes[c].args[0])
            if record is not None:
                for c in coords:
                    record[c] = {n.name: v for n, v in envs[c].items()}
            break
        args = {c: pytree.tree_map_only(fx.Node, lambda n, c=c: envs[c][n], (nodes[c].args, nodes[c].kwargs)) for c in coords}
        if ref.target is pt.ALL_TO_ALL_ROWS:  # expert parallelism's exchange: synchronous, no wait
            axis = _group_axis(ref, args[coords[0]][0], group_axes, mesh_shape)
            for c in coords:
                members = _group_members(c, axis, mesh_shape)
                if members[0] != c:
                    continue
                a = [args[m][0] for m in members]
                outs = pt.rows_exchange_inputs([x[0] for x in a], [x[1] for x in a], [x[2] for x in a], a[0][3],
                                                [args[m][1].get("most") for m in members])
                for m, o in zip(members, outs):
                    envs[m][nodes[m]] = o
        elif isinstance(ref.target, torch._ops.OpOverload) and ref.target.namespace == "_c10d_functional" and ref.target is not c10d.wait_tensor.default:
            axis = _group_axis(ref, args[coords[0]][0], group_axes, mesh_shape)
            vals = {c: args[c][0] for c in coords}
            if ref.target is c10d.all_reduce.default:  # cloned at issue, as torch does
                vals = {c: (v[0].clone(), *v[1:]) for c, v in vals.items()}
            issued = _collective(ref, vals, mesh_shape, axis)  # for shapes; recomputed at the wait
            for c in coords:
                envs[c][nodes[c]] = _poison(issued[c])
            in_flight[ref.name] = (ref, vals, axis)
        elif ref.target is c10d.wait_tensor.default:
            src = ref.args[0]
            pending = in_flight.pop(src.name, None) if isinstance(src, fx.Node) else None
            if pending is not None:
                done = _collective(pending[0], pending[1], mesh_shape, pending[2])  # inputs read now
                for c in coords:
                    args[c][0][0].copy_(done[c])
            for c in coords:
                envs[c][nodes[c]] = args[c][0][0]
        elif is_random(ref):
            _draw_on_every_rank(nodes, args, envs)
        else:
            for c in coords:
                a, k = args[c]
                envs[c][nodes[c]] = nodes[c].target(*a, **k)
    return results


def _draw_on_every_rank(nodes: dict[tuple, fx.Node], args: dict[tuple, Any], envs: dict[tuple, dict]) -> None:
    """A random node: every simulated rank draws from the same generator state (as real
    ranks do from their agreed generators), which then advances once. A program whose
    ranks draw different amounts would leave real ranks' generators apart: an error."""
    devices = {a.device for c in nodes for a in pytree.tree_leaves(args[c]) if isinstance(a, torch.Tensor)}
    cuda = [d for d in devices if d.type == "cuda"]
    start = torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in cuda]
    ends = []
    for c, node in nodes.items():
        torch.set_rng_state(start[0])
        for d, st in zip(cuda, start[1]):
            torch.cuda.set_rng_state(st, d)
        a, k = args[c]
        envs[c][node] = node.target(*a, **k)
        ends.append((torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in cuda]))
    first = ends[0]
    for (cpu, gpu), c in zip(ends, nodes):
        if not torch.equal(cpu, first[0]) or any(not torch.equal(x, y) for x, y in zip(gpu, first[1])):
            raise RuntimeError(
                f"random node {nodes[c].name} advances the generator of rank {c} by another amount than rank "
                f"{next(iter(nodes))}'s: real ranks' generators would drift apart. This is a bug in spmd-compiler"
            )


def check_replicas(name: str, placements: Sequence[Any], values: dict[tuple[int, ...], Any], mesh_shape: Sequence[int]) -> None:
    """Assert that a value laid out as ``placements`` is identical (bit for bit) on the
    ranks that should hold the same copy: ranks that differ only in coordinates of mesh
    axes where it is Replicate. Random draws that differ per rank show up here."""
    axes = [a for a, p in enumerate(placements) if p.is_replicate() and mesh_shape[a] > 1]
    for coord, v in values.items():
        if not isinstance(v, torch.Tensor) or any(coord[a] != 0 for a in axes):
            continue
        for a in axes:
            for j in range(1, mesh_shape[a]):
                other = values[coord[:a] + (j,) + coord[a + 1 :]]
                if not torch.equal(v, other) and not (v.is_floating_point() and torch.equal(v.isnan(), other.isnan())
                                                      and torch.equal(v.nan_to_num(), other.nan_to_num())):
                    raise AssertionError(
                        f"{name} is Replicate on mesh axis {a} but rank {coord[:a] + (j,) + coord[a + 1 :]} holds another "
                        f"value than rank {coord} (max difference {(v.double() - other.double()).abs().max().item():.3g})"
                    )


def example_inputs(gm: fx.GraphModule, seed: int = 0) -> list[Any]:
    """Made-up inputs for a per-rank graph's placeholders, from their fake values: floats
    in [0.5, 1.5), hyperparameters (lr, betas, momentum) and 0-d floats in [0.1, 0.9),
    small ints, lower-triangular bool masks, plain values as they are (the mesh coordinate)."""
    g = torch.Generator().manual_seed(seed)
    out: list[Any] = []
    for n in gm.graph.find_nodes(op="placeholder"):
        v = n.meta["val"]
        if not isinstance(v, torch.Tensor):
            out.append(v)
        elif v.dtype.is_floating_point:
            r = torch.rand(v.shape, generator=g, dtype=v.dtype)
            hparam = getattr(n.meta.get("spmd_input"), "kind", None) == "hparam"
            out.append(r * 0.8 + 0.1 if hparam or v.dim() == 0 else r + 0.5)
        elif v.dtype == torch.bool:  # attention masks
            out.append(torch.ones(v.shape, dtype=torch.bool).tril())
        else:
            out.append(torch.randint(0, 8, v.shape, generator=g, dtype=v.dtype))
    return out
