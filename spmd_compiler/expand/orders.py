"""Token routing on sharded tokens: each rank sorts and computes its own tokens.

A mixture-of-experts layer sorts its tokens by expert (``argsort`` of the chosen expert
ids), gathers their rows in that order, runs each expert on its contiguous group
(``torch._grouped_mm`` with per-expert offsets from ``histc``/``bincount`` and
``cumsum``) and scatters the results back to the tokens' rows (``scatter_add``,
``index_put``, or an inverse permutation). With the tokens split over a mesh axis, the
*global* sort interleaves every rank's tokens, so DTensor gathers them all.

Every token's result depends on that token alone, so each rank can run the same code on
its own tokens: the **restricted program**, the single-device program applied to this
rank's shard. This module tracks which values of the per-rank program are restricted
values and how they relate to the global ones (the tag :class:`Rows`, in
``DValue.extra[ROWS]``):

* ``order``: the local rows are this rank's rows in a rank-local order made by a sort
  (the sorted keys, the rows gathered by the permutation, anything row-wise after them).
  Such a value has no global placement: it is a restricted value only.
* ``into``: the values are *local* row numbers into rows laid out in an order (the sort's
  indices point into the canonical shard; an inverse permutation points into the sorted
  order) of a dim of global ``size``; ``div``: into a tensor with ``1/div`` as many rows
  (``perm // top_k``).
* ``fresh``: a value-independent fill (``zeros_like``, ``empty``): it fits any order;
  ``zero`` too when the fill is zeros (counts added into it by each rank sum to the total:
  a fill of ones or any other value would be counted once per rank).
* ``identity``: row ``j`` holds ``j`` (a local ``arange``): row numbers into whatever
  order its rows are aligned with.
* ``restricted``: mesh axes on which the value is ``Partial(sum)`` *and* its local term is
  the restricted program's value (``histc`` of this rank's expert ids: its own counts).

A restricted value enters the global program only through an exact exit: rows put back
in the canonical order (a scatter or index by the sort's own numbers) are an ordinary
``Shard``; a sum over rows (a weight gradient, a count) is an ordinary ``Partial``. An op
that would *redistribute* anything on a token axis while a restricted value takes part
would mix a global value with a rank's own: :class:`OrderEscape` stops the expansion,
which restarts with those sorts done globally (gathered, as DTensor does), so a model
this module does not understand is still exact, only not local.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["Order", "Rows", "ROWS", "OrderEscape", "rows_of", "restricted_axes", "merge_origins", "transfer", "tag_fresh"]

ROWS = "rows"
# ops that start token routing (a sort of the tokens): rank-local unless the expansion
# was restarted with them global (their traced node's name in routing_global)
ENTRY_OPS: set = set()


@dataclass(frozen=True)
class Order:
    """A rank-local row order on mesh ``axes`` (the sorted dim's shard axes).

    ``key`` names the sort that made it ("" for the canonical order: the shard's own);
    ``dispatched``: the rows were sent to their experts' ranks over this mesh axis
    (expert parallelism), so they are other ranks' rows too.
    """

    axes: tuple[int, ...]
    key: str = ""
    dispatched: int | None = None

    @property
    def canonical(self) -> bool:
        return not self.key

    def text(self) -> str:
        if self.canonical:
            return "canonical rows"
        return f"rows sorted by {self.key}" + (f", dispatched over axis {self.dispatched}" if self.dispatched is not None else "")


@dataclass(frozen=True)
class Rows:
    """What is known of a restricted value (see the module docstring)."""

    order: Order | None = None
    into: Order | None = None
    size: Any = None
    div: int = 1
    fresh: bool = False
    zero: bool = False
    identity: bool = False
    restricted: tuple[int, ...] = ()
    origins: frozenset = frozenset()

    @property
    def local_only(self) -> bool:
        """A value with no global meaning: rows in a rank-local order, or local row numbers."""
        return (self.order is not None and not self.order.canonical) or self.into is not None or self.identity

    def axes(self) -> tuple[int, ...]:
        """The token axes this fact is about."""
        for o in (self.order, self.into):
            if o is not None:
                return o.axes
        return self.restricted

    def key(self) -> tuple:
        from .values import _key

        return (self.order, self.into, _key(self.size), self.div, self.fresh, self.zero, self.identity, self.restricted,
                tuple(sorted(self.origins)))

    def replace(self, **kw: Any) -> "Rows":
        return dataclasses.replace(self, **kw)


class OrderEscape(Exception):
    """A restricted value met an op that needs its global value: the sorts in
    ``origins`` must be expanded globally (the expansion restarts)."""

    def __init__(self, origins: frozenset, why: str) -> None:
        super().__init__(f"token routing of {sorted(origins)} is not local: {why}")
        self.origins = frozenset(origins)
        self.why = why


def rows_of(x: Any) -> Rows | None:
    """The :class:`Rows` fact of a DValue or TensorArg (None if it has none)."""
    extra = getattr(x, "extra", None)
    if isinstance(extra, dict):
        return extra.get(ROWS)
    return getattr(x, "rows", None)


def restricted_axes(x: Any) -> tuple[int, ...]:
    r = rows_of(x)
    return r.restricted if r is not None else ()


def merge_origins(*facts: Any) -> frozenset:
    out: frozenset = frozenset()
    for f in facts:
        r = f if isinstance(f, Rows) else rows_of(f)
        if r is not None:
            out |= r.origins
    return out


# ---------------------------------------------------------------- generic ops
# ops that keep "local row numbers" (``into``) and "row j holds j" (``identity``) facts
# as they are (the values pass through unchanged; only their layout may change)
_KEEP_INTO = {
    "aten::view", "aten::_unsafe_view", "aten::reshape", "aten::expand", "aten::unsqueeze", "aten::squeeze",
    "aten::clone", "aten::alias", "aten::detach", "aten::_to_copy", "aten::lift_fresh_copy", "aten::contiguous",
    "aten::slice", "aten::select", "aten::t", "aten::transpose", "aten::permute",
}
# ops linear in their Partial input: a rank's own term stays its own term
_KEEP_RESTRICTED = _KEEP_INTO | {"aten::cumsum", "aten::mul", "aten::div", "aten::neg", "aten::sum"}
# ops whose result does not depend on their input's values (only its size, dtype, device)
_FRESH = {
    "aten::zeros_like", "aten::empty_like", "aten::ones_like", "aten::full_like", "aten::new_zeros", "aten::new_empty",
    "aten::new_ones", "aten::new_full", "aten::zeros", "aten::empty", "aten::full", "aten::ones", "aten::empty_strided",
    "aten::new_empty_strided", "aten::scalar_tensor",
}


_ZERO_FILLS = {"aten::zeros_like", "aten::new_zeros", "aten::zeros"}
_FILL_VALUE_AT = {"aten::full": 1, "aten::full_like": 1, "aten::new_full": 2, "aten::scalar_tensor": 0}


def _zero_fill(name: str, node: Any) -> bool:
    """Whether the fill ``node`` (an op of ``_FRESH``) is zeros."""
    if name in _ZERO_FILLS:
        return True
    at = _FILL_VALUE_AT.get(name)
    if at is None or len(node.args) <= at:
        return False
    value = node.args[at]
    return isinstance(value, (int, float, bool)) and value == 0


def op_name(op: Any) -> str:
    schema = getattr(op, "_schema", None)
    return schema.name if schema is not None else str(op)


def _shard_axes(spec: Any, axes: tuple[int, ...]) -> bool:
    return all(spec.placements[a].is_shard() for a in axes)


def _replicated_on(spec: Any, axes: tuple[int, ...]) -> bool:
    return all(spec.placements[a].is_replicate() for a in axes)


def guard_axes(tensors: list[Any]) -> dict[int, frozenset]:
    """Token axes on which a restricted-only value takes part (-> the sorts it derives
    from): nothing may be redistributed on them inside this op's recipe."""
    out: dict[int, frozenset] = {}
    for t in tensors:
        r = rows_of(t)
        if r is not None and r.local_only:
            for a in r.axes():
                out[a] = out.get(a, frozenset()) | r.origins
    return out


def row_order(t: Any, axes: tuple[int, ...]) -> Order | None | str:
    """The order of ``t``'s rows on token ``axes``: an :class:`Order`, "any" (a fill, an
    identity), "none" (replicated there: it broadcasts), or None (the canonical shard)."""
    r = rows_of(t)
    if r is not None and (r.fresh or r.identity) and r.order is None:
        return "any"
    if r is not None and r.order is not None and not r.order.canonical:
        return r.order
    if _replicated_on(t.spec, axes):
        return "none"
    return None


def common_order(tensors: list[Any], axes: tuple[int, ...], origins: frozenset, what: str) -> Order | None:
    """The one rank-local order the ``tensors`` share on ``axes`` (None: canonical);
    :class:`OrderEscape` when two differ (a sorted value meets another order)."""
    found: list[Any] = []
    for t in tensors:
        o = row_order(t, axes)
        if o in ("any", "none"):
            continue
        if not any(o == f for f in found):
            found.append(o)
    if len(found) > 1:
        texts = ", ".join("canonical rows" if f is None else f.text() for f in found)
        raise OrderEscape(origins, f"{what} combines values in different row orders ({texts})")
    return found[0] if found else None


def transfer(op: Any, tensors: list[Any], result: Any) -> Any:
    """The facts of a generic op's results (an op no routing rule handles), from its
    inputs': rows stay in their order where the result is still split on the token axes;
    row numbers pass only through the ops of ``_KEEP_INTO``; a rank's own Partial term
    only through linear ops. :class:`OrderEscape` for an op that would turn row numbers
    or rank-local rows into anything else."""
    from torch.utils import _pytree as pytree

    from .builder import OutTensor

    facts = [(t, rows_of(t)) for t in tensors if rows_of(t) is not None]
    if not facts:
        return result
    name = op_name(op)
    origins = merge_origins(*[r for _, r in facts])
    if name in _FRESH:  # only the input's size, dtype and device: a fill fits any order
        zero = name in _ZERO_FILLS
        return pytree.tree_map(lambda o: dataclasses.replace(o, rows=Rows(fresh=True, zero=zero)) if isinstance(o, OutTensor) else o,
                               result, is_leaf=lambda x: isinstance(x, OutTensor))
    local = [(t, r) for t, r in facts if r.local_only]
    if local:
        axes = local[0][1].axes()
        order = common_order([t for t in tensors], axes, origins, name)
        into = [r for _, r in local if r.into is not None or r.identity]
        if into and name not in _KEEP_INTO:
            raise OrderEscape(origins, f"{name} computes with local row numbers (it is no index, gather or scatter)")

        def tag(o: Any) -> Any:
            if not isinstance(o, OutTensor):
                return o
            if not _shard_axes(o.spec, axes):
                if any(o.spec.placements[a].is_partial() for a in axes) and not into:
                    return o  # a sum over rows: an ordinary Partial, exact in any order
                raise OrderEscape(origins, f"{name} gives a {o.spec.placements} result from rank-local rows")
            keep = into[0] if into else None
            rows = Rows(order=order, into=keep.into if keep else None, size=keep.size if keep else None, div=keep.div if keep else 1,
                        identity=bool(keep and keep.identity), origins=origins)
            return dataclasses.replace(o, rows=rows)

        return pytree.tree_map(tag, result, is_leaf=lambda x: isinstance(x, OutTensor))
    # no local-only input: fills and a rank's own Partial terms
    fresh = all(r.fresh for _, r in facts) and all(
        rows_of(t) is not None or _replicated_on(t.spec, facts[0][1].axes() or ()) for t in tensors)
    restricted = set.intersection(*[set(r.restricted) for _, r in facts]) if name in _KEEP_RESTRICTED else set()

    def tag_plain(o: Any) -> Any:
        if not isinstance(o, OutTensor):
            return o
        keep_r = tuple(a for a in sorted(restricted) if o.spec.placements[a].is_partial())
        keep_f = fresh and name in _KEEP_INTO | _FRESH
        keep_z = keep_f and (name in _ZERO_FILLS or (name not in _FRESH and all(r.zero for _, r in facts)))
        if not keep_r and not keep_f:
            return o
        return dataclasses.replace(o, rows=Rows(fresh=keep_f, zero=keep_z, restricted=keep_r, origins=origins))

    return pytree.tree_map(tag_plain, result, is_leaf=lambda x: isinstance(x, OutTensor))


def tag_fresh(op: Any, node: Any, value: Any, written: set) -> None:
    """Tag the result of a value-independent fill (``zeros_like``, ``empty``, ``full``) as
    fitting any row order, unless its storage is written later by any op but its single
    user (an alias taken before such a write would keep a stale fact)."""
    from .. import _private_torch as pt
    from .values import DValue

    if op_name(op) not in _FRESH or not isinstance(value, DValue) or ROWS in value.extra:
        return
    if pt.storage_owner(node) in written:
        users = list(node.users)
        if len(users) != 1 or not pt.writes_first_arg(users[0].target) or users[0].args[0] is not node:
            return
    value.extra[ROWS] = Rows(fresh=True, zero=_zero_fill(op_name(op), node))
