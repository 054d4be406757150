"""The reasons a dump gives on single nodes: replicate fallbacks and scheduling notes.

Expansion marks a node run on gathered inputs (``meta["spmd_fallback"]``: why it had no
sharding strategy); the optimization passes mark what they moved or recomputed
(``spmd_schedule``, ``spmd_prefetch_budget``: ``moved``; ``spmd_remat``: ``recomputed``).
The annotated graphs print them in the node's comment (``replicate fallback: ...``,
``moved: ...``, ``recomputed: ...``); the HTML report lists them all, grouped by reason.
Both read them here, so they give the same reasons.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from .format import target_name

__all__ = ["NOTE_KEYS", "Note", "node_notes", "graph_notes"]

# meta key -> the label the dump prints before it
NOTE_KEYS = (("spmd_fallback", "replicate fallback"), ("spmd_schedule", "moved"), ("spmd_prefetch_budget", "moved"),
             ("spmd_remat", "recomputed"))


@dataclass(frozen=True)
class Note:
    """One reason on one node: ``label`` (``replicate fallback``, ``moved``, ``recomputed``),
    ``text`` (the reason), the node's name, its op, and where it was seen (``graph``:
    ``expanded`` or the pass whose output holds it)."""

    label: str
    text: str
    node: str
    op: str
    graph: str = ""


def node_notes(node: fx.Node) -> list[tuple[str, str]]:
    """``(label, reason)`` of every note on ``node``, in the order the dump prints them."""
    return [(label, str(node.meta[key])) for key, label in NOTE_KEYS if key in node.meta]


def graph_notes(gm: fx.GraphModule, graph: str = "") -> list[Note]:
    """Every note of ``gm``, in program order."""
    out = []
    for n in gm.graph.nodes:
        for label, text in node_notes(n):
            out.append(Note(label, text, n.name, target_name(n.target) if n.op == "call_function" else n.op, graph))
    return out
