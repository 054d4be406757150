"""Stage 2: expand a traced step over a DeviceMesh (see :func:`expand_graph`).

The expansion (per-rank graph with every recipe spliced, values per traced node) is
handed to :func:`spmd_compiler.rebuild.finalize`; :func:`spmd_compiler.expand` (in
:mod:`spmd_compiler.driver`) runs both.
"""

from __future__ import annotations

from . import rules  # noqa: F401  (registers the per-op rules)
from .cache import ExpansionCache
from .args import ExpandContext, TensorArg
from .dispatch import generic_expand
from .fallback import replicate_fallback
from .expander import Expansion, expand_graph
from .registry import register_rule
from .values import DSymInt, DValue, MeshContext

__all__ = [
    "expand_graph",
    "Expansion",
    "DSymInt",
    "DValue",
    "MeshContext",
    "ExpansionCache",
    "register_rule",
    "generic_expand",
    "replicate_fallback",
    "ExpandContext",
    "TensorArg",
]
