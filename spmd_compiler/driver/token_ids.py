"""Token ids outside an embedding's table: our error instead of torch's IndexError.

On one device an id outside ``[0, num_embeddings)`` raises ``IndexError: index out of
range in self`` from deep inside ``F.embedding``. A per-rank program raises the same
when the table is whole on the rank (data parallel, FSDP's gather), on that rank only,
and, when its rows are sharded (vocab-parallel), masks the id out: a zero row, no error.
:class:`IdCheck` tells which embedding of the traced step reads an id out of range from
the batch, computing the ids from this rank's batch tensors (the ops between the batch
and the embedding, such as ``ids[:, :-1]``, run again on them; the nodes to run are
found once per traced step). It runs on every call, before the program starts: at a
compile inside the compile's agreement, on later calls by the step driver, whose rank
with a bad id raises the per-step flag so that every rank raises together
(``StepDriver.__call__``). The per-call cost is one ``aminmax`` per ids tensor (on CUDA
ids, one synchronization with the device). A run that still fails with an index error
(ids the batch alone does not determine) is explained by :func:`explain_index_error`.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from .. import _private_torch as pt
from ..errors import describe_node
from ..trace.tracer import flatten_batch

__all__ = ["IdCheck", "embedding_ids_error", "explain_index_error", "ranks_ids_error"]

log = logging.getLogger(__name__)

_EMBEDDING = torch.ops.aten.embedding.default


class IdCheck:
    """The ids check of one traced step: its embeddings (with their tables' rows) and the
    nodes that compute their ids from the batch, in graph order. Call it with a batch."""

    def __init__(self, traced: Any) -> None:
        self.traced = traced
        gm = traced.gm
        self.embeddings: list[tuple[fx.Node, int, str]] = []
        for node in gm.graph.find_nodes(op="call_function", target=_EMBEDDING):
            rows, table = _table(node.args[0])
            if rows is not None and isinstance(node.args[1], fx.Node):
                self.embeddings.append((node, rows, table))
        needed: set[fx.Node] = set()
        todo = [e.args[1] for e, _, _ in self.embeddings]
        while todo:
            n = todo.pop()
            if n not in needed:
                needed.add(n)
                todo.extend(n.all_input_nodes)
        self.nodes: list[tuple[fx.Node, int | None]] = []  # (node, batch leaf index or None: an op to run)
        for n in gm.graph.nodes:
            if n not in needed:
                continue
            inp = n.meta.get("spmd_input")
            if n.op == "placeholder" and inp is not None and inp.kind == "batch":
                self.nodes.append((n, inp.index))
            elif n.op == "call_function" and _pure(n.target):
                self.nodes.append((n, None))

    @classmethod
    def of(cls, traced: Any) -> IdCheck:
        """The check of ``traced``, built once and kept on it."""
        check = getattr(traced, "_spmd_id_check", None)
        if check is None or check.traced is not traced:
            check = cls(traced)
            traced._spmd_id_check = check
        return check

    def __call__(self, batch: tuple, kwargs: dict) -> ValueError | None:
        """The error for the first embedding whose ids, computed from ``(batch, kwargs)``,
        fall outside its table; None when every id is in range or no embedding reads ids
        computed from the batch alone (a meta batch has no values to check)."""
        if not self.embeddings:
            return None
        leaves, _, paths = flatten_batch(batch, kwargs)
        values = self._values(leaves)
        ranges: dict[fx.Node, tuple[int, int]] = {}
        for node, rows, table in self.embeddings:
            src = node.args[1]
            ids = values.get(src)
            if not isinstance(ids, torch.Tensor) or ids.numel() == 0 or ids.is_floating_point() or ids.device.type == "meta":
                continue
            if src not in ranges:
                lo, hi = torch.aminmax(ids)
                ranges[src] = tuple(torch.stack((lo, hi)).tolist())  # one synchronization on CUDA
            lo, hi = ranges[src]
            if lo >= 0 and hi < rows:
                continue
            return ValueError(_message(self.traced, node, table, rows, lo, hi, ids, _sources(src, paths)))
        return None

    def _values(self, leaves: list[Any]) -> dict[fx.Node, Any]:
        """The values of the nodes that the batch alone determines, computed from
        ``leaves`` (pure, deterministic ops only: the user's batch is never written). A
        node that reads state, or whose op fails on this rank's batch (a size traced as a
        constant), is left out."""
        values: dict[fx.Node, Any] = {}
        with torch.no_grad():
            for n, leaf in self.nodes:
                if leaf is not None:
                    values[n] = leaves[leaf]
                    continue
                if any(a not in values for a in n.all_input_nodes):
                    continue
                args, kwargs = fx.map_arg((n.args, n.kwargs), lambda a: values[a])
                try:
                    values[n] = n.target(*args, **kwargs)
                except Exception:  # e.g. a view to a global size on a rank's shard
                    continue
        return values


def embedding_ids_error(traced: Any, batch: tuple, kwargs: dict) -> ValueError | None:
    """The error for the first embedding of ``traced`` (a TracedStep) whose ids, computed
    from the batch ``(batch, kwargs)``, fall outside its table; None when every id is in
    range or no embedding reads ids computed from the batch alone."""
    return IdCheck.of(traced)(batch, kwargs)


def ranks_ids_error(texts: list[str | None]) -> ValueError | None:
    """The error every rank raises when the ranks' token-id checks, gathered (``texts``:
    each rank's message or None), found a bad id on some rank; None if on none."""
    bad = [(r, text) for r, text in enumerate(texts) if text is not None]
    if not bad:
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    ranks = ", ".join(str(r) for r, _ in bad)
    return ValueError(f"the batch of rank{'s' * (len(bad) > 1)} {ranks} (every rank stops here, this is rank {rank}; "
                      f"nothing ran): rank {bad[0][0]}'s error: {bad[0][1]}")


def explain_index_error(error: BaseException, traced: Any, batch: tuple, kwargs: dict) -> ValueError | None:
    """Our error for a run that failed with ``error`` if it is an index out of range
    (IndexError on the eager path, a bounds check of inductor's code) that an embedding's
    ids explain; None otherwise."""
    if not isinstance(error, IndexError) and "index out of" not in str(error):
        return None
    try:
        return embedding_ids_error(traced, batch, kwargs)
    except Exception:  # explaining must never hide the original error
        log.debug("could not explain %r by the embeddings' ids", error, exc_info=True)
        return None


def _table(weight: Any) -> tuple[int | None, str]:
    """Rows of an embedding's table (global) and the table's name."""
    inp = weight.meta.get("spmd_input") if isinstance(weight, fx.Node) else None
    if inp is not None and inp.kind in ("param", "buffer") and inp.shape:
        return int(inp.shape[0]), inp.name
    val = weight.meta.get("val") if isinstance(weight, fx.Node) else None
    try:
        return int(val.shape[0]), getattr(weight, "name", "?")
    except (AttributeError, IndexError, TypeError, RuntimeError):
        return None, "?"


def _sources(ids: fx.Node, paths: list[str]) -> str:
    """The batch leaves the ids are computed from (``batch[0]``)."""
    seen, todo, out = set(), [ids], []
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        inp = n.meta.get("spmd_input")
        if n.op == "placeholder" and inp is not None and inp.kind == "batch":
            out.append(paths[inp.index])
        todo.extend(n.all_input_nodes)
    return ", ".join(sorted(out)) or "the batch"


def _message(traced: Any, node: fx.Node, table: str, rows: int, lo: int, hi: int, ids: torch.Tensor, source: str) -> str:
    mod_path = table.rpartition(".")[0]
    what = f"the embedding {mod_path or table!r}"
    model = getattr(traced, "model", None)
    try:
        module = model.get_submodule(mod_path) if model is not None else None
    except AttributeError:
        module = None
    if module is not None:
        what = f"the {type(module).__name__} {mod_path!r}" if mod_path else f"the model's {type(module).__name__}"
    where = ((ids < 0) | (ids >= rows)).nonzero()[0].tolist()  # the first bad id's position
    bad = int(ids[tuple(where)])
    at = f"{source}[{', '.join(map(str, where))}]"
    if not _is_batch_leaf(node.args[1]):
        at = f"index [{', '.join(map(str, where))}] of the ids the embedding reads"
    return (
        f"token ids out of range for {what} (table {table} with {rows} rows): {source} holds ids from {lo} to {hi} "
        f"(e.g. {bad} at {at}); expected every id in [0, {rows}){describe_node(node)}\n"
        f"  fix: keep the ids below num_embeddings={rows} (a tokenizer whose vocabulary, with its added special or "
        f"pad tokens, is larger than the model's: build the model with the tokenizer's vocabulary size or resize "
        f"the embedding), and map ignore labels such as -100 to a valid id before the embedding"
    )


def _is_batch_leaf(n: Any) -> bool:
    inp = n.meta.get("spmd_input") if isinstance(n, fx.Node) else None
    return n.op == "placeholder" and inp is not None and inp.kind == "batch"


def _pure(target: Any) -> bool:
    """An op that neither writes its inputs nor draws random numbers."""
    if isinstance(target, torch._ops.OpOverload):
        return not pt.written_args(target) and torch.Tag.nondeterministic_seeded not in target.tags
    return getattr(target, "__module__", None) in (operator.__name__, "_operator")
