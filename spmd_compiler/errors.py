"""Exception types and the helpers that make their messages actionable.

Bad user input raises the builtin ``ValueError`` / ``TypeError``. What the compiler
cannot do (an op with no sharding rule, a placement transition we cannot emit) raises a
subclass of :class:`SpmdError`, so callers can tell "you asked for something wrong" from
"we do not support this yet". Every message names the graph node and the user's source
line when a node is involved, and ends with a way out.
"""

from __future__ import annotations

import re
import traceback
from typing import Any

import torch.fx as fx

__all__ = [
    "SpmdError",
    "UnsupportedOpError",
    "UnsupportedPlacementError",
    "UnevenShardingError",
    "RankMismatchError",
    "DataDependentError",
    "HostValueError",
    "HostSettingError",
    "IncompleteStepError",
    "user_source_line",
    "user_frame_of",
    "describe_node",
    "add_context",
]

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)\n\s*(?P<code>[^\n]*)')
_INTERNAL = ("/torch/", "<frozen", "/contextlib.py", "/functools.py")
_OURS = "/spmd_compiler/"
_OURS_USER = ("/spmd_compiler/testing/models.py",)  # our example models count as user code


def _is_user_path(path: str) -> bool:
    if any(s in path for s in _INTERNAL):
        return False
    return _OURS not in path or any(path.endswith(u) for u in _OURS_USER)


def user_frame_of(exc: BaseException) -> str | None:
    """The innermost frame of ``exc``'s traceback that is user code (outside torch and
    spmd_compiler, our example models excepted), as ``"path.py:42 in step: if loss > 0:"``."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_user_path(f.filename.replace("\\", "/"))]
    if not frames:
        return None
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"


def user_frame_here() -> str | None:
    """The innermost user-code frame of the current call stack, formatted as :func:`user_frame_of`."""
    frames = [f for f in traceback.extract_stack() if _is_user_path(f.filename.replace("\\", "/"))]
    if not frames:
        return None
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"


def user_source_line(node: fx.Node | None) -> str | None:
    """The innermost frame of ``node``'s recorded stack trace that is user code.

    Returns ``"path/model.py:42 in forward: return self.l2(x)"`` or ``None`` when the
    node carries no stack trace (placeholders, nodes created by passes).
    """
    if node is None:
        return None
    trace = node.meta.get("stack_trace")
    if not trace:
        origin = node.meta.get("spmd_origin")
        return origin.get("source") if isinstance(origin, dict) else None
    frames = list(_FRAME.finditer(trace))
    user = [f for f in frames if _is_user_path(f.group("file"))]
    chosen = user[-1] if user else (frames[-1] if frames else None)
    if chosen is None:
        return None
    return f"{chosen.group('file')}:{chosen.group('line')} in {chosen.group('fn')}: {chosen.group('code').strip()}"


def describe_node(node: fx.Node | None) -> str:
    """Two lines for an error message: the node in fx syntax and the user's source line."""
    if node is None:
        return ""
    try:
        text = node.format_node()
    except Exception:  # format_node can fail on half-built graphs
        text = f"%{node.name} = {node.op}[target={node.target}]"
    line = user_source_line(node)
    out = f"\n  graph node: {text}"
    if line:
        out += f"\n  user code:  {line}"
    return out


def add_context(exc: BaseException, node: fx.Node | None, *, inputs: str = "", fix: str = "") -> BaseException:
    """Append to ``exc``'s message, once, what it lacks of: the graph node, the user's
    source line, the placements of the node's inputs (``inputs``) and a way out (``fix``).

    The exception keeps its type, attributes and traceback (its ``args`` are rewritten);
    the first call wins, so an error raised deep inside names the innermost node. The
    node is recorded as ``exc.spmd_node`` (and ``exc.node`` for our own errors without one).
    """
    if getattr(exc, "spmd_node", None) is not None or node is None:
        return exc
    msg = str(exc.args[0]) if exc.args else ""
    extra = ""
    if f"graph node: %{node.name} " not in msg:
        extra += describe_node(node)
    if inputs and "input placements:" not in msg:
        extra += f"\n  input placements: {inputs}"
    at = msg.rfind("\n  fix:")  # the context goes before a fix on its own line
    if at >= 0:
        msg = msg[:at] + extra + msg[at:]
    else:
        msg += extra
        if fix and "fix:" not in msg:
            msg += f"\n  fix: {fix}"
    exc.args = (msg,) + tuple(exc.args[1:])
    exc.spmd_node = node  # type: ignore[attr-defined]
    if isinstance(exc, SpmdError) and getattr(exc, "node", None) is None:
        exc.node = node  # type: ignore[attr-defined]
    return exc


class SpmdError(RuntimeError):
    """Base class for what the compiler cannot do (as opposed to bad input)."""


class UnsupportedOpError(SpmdError, NotImplementedError):
    """An aten op has no sharding rule for the given input placements.

    Attributes: ``op`` (the OpOverload), ``placements`` (per tensor input), ``node``.
    """

    def __init__(self, op: Any, placements: list[str], node: fx.Node | None, reason: str = "") -> None:
        self.op = op
        self.placements = placements
        self.node = node
        inputs = ", ".join(placements) if placements else "(no tensor inputs)"
        msg = (
            f"no sharding rule for {op} with input placements [{inputs}]"
            + (f": {reason}" if reason else "")
            + describe_node(node)
            + "\n  fix: change the plan so this op sees Replicate inputs, register a rule with "
            "spmd_compiler.expand.register_rule, or compile with fallback='replicate' to gather "
            "the inputs and run the op unsharded."
        )
        super().__init__(msg)


class UnsupportedPlacementError(SpmdError):
    """A placement transition (or placement) the expansion cannot emit."""

    def __init__(self, message: str, node: fx.Node | None = None) -> None:
        self.node = node
        super().__init__(message + describe_node(node))


class UnevenShardingError(UnsupportedPlacementError):
    """A tensor dim does not divide evenly over a mesh axis where that is not supported."""

    def __init__(
        self, tensor: str, dim: int, size: int, axis: str, axis_size: int, why: str, node: fx.Node | None = None
    ) -> None:
        self.tensor, self.dim, self.size, self.axis, self.axis_size = tensor, dim, size, axis, axis_size
        msg = (
            f"{tensor}: dim {dim} of size {size} is sharded unevenly over mesh axis "
            f"'{axis}' of size {axis_size} ({why}). fix: pad dim {dim} to a multiple of "
            f"{axis_size}, or shard a different dim."
        )
        super().__init__(msg, node)


class RankMismatchError(SpmdError):
    """Ranks compiled different graphs; raised on every rank at once."""


class CollectiveError(SpmdError):
    """A collective of the step failed (a timeout, a peer that died); raised on every
    surviving rank, naming the step, the collective's provenance and the ranks that did
    not report."""


__all__ += ["CollectiveError"]


class ExpertCapacityError(SpmdError):
    """Under expert parallelism with ``Plan(expert_capacity=...)``, a step routed more rows
    to some rank's experts than its receive buffer holds; raised on every rank of the
    group at the same exchange, before any row moves (no token is dropped)."""


__all__ += ["ExpertCapacityError"]


class IntentError(SpmdError):
    """The per-rank program lost part of what the step wrote (``compile(check_intent=True)``,
    on in the test harness; ``spmd_compiler/driver/intent.py``): a recomputation merged
    away, a host number computed from a NaN, a parameter update or a whole phase gone.
    Attributes: ``where`` (the trace, expansion or the pass that lost it), ``losses``."""

    def __init__(self, where: str, losses: list[str]) -> None:
        self.where, self.losses = where, list(losses)
        name = where.removeprefix("pass ")
        fix = (f"compile(..., passes_disabled=({name},)) compiles without that pass" if where.startswith("pass ")
               else "compile(..., check_intent=False) runs the program as it is (with the loss above)")
        shown = self.losses[:5] + ([f"... and {len(self.losses) - 5} more"] if len(self.losses) > 5 else [])
        lines = [f"the per-rank program lost what the step wrote, in {where}:"] + [f"  - {loss}" for loss in shown]
        lines += ["  this is a bug in spmd-compiler; please report it with this message", f"  fix for now: {fix}"]
        super().__init__("\n".join(line if len(line) <= 600 else line[:597] + "..." for line in lines))


__all__ += ["IntentError"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded whole (a damaged or missing shard file, a key,
    shape or dtype other than the model and plan expect). Raised by
    ``step.load_checkpoint`` before anything is written: the model and optimizer are left
    as they were. Attributes: ``path`` (the checkpoint folder), ``files`` (the damaged
    files, relative to it; empty when the files are fine but their content does not fit)."""

    def __init__(self, path: str, what: str, files: list[str] | None = None, fix: str | None = None) -> None:
        self.path, self.files = path, list(files or [])
        named = f" (damaged: {', '.join(self.files)})" if self.files else ""
        super().__init__(
            f"cannot load checkpoint {path}{named}: {what}. Nothing was loaded: the model and the optimizer are as "
            f"they were before the call.\n  fix: {fix or 'load an intact checkpoint (an earlier one, or save this one again)'}"
        )


__all__ += ["CheckpointError"]


class DataDependentError(SpmdError):
    """The step's Python control flow or an op's output shape depends on tensor values
    (``if loss > 0:``, ``x[mask]``, ``.item()`` used as a size), which one compiled
    program cannot express. Attributes: ``source`` (the user's line, or None), ``what``."""

    def __init__(self, what: str, source: str | None, fix: str, node: fx.Node | None = None) -> None:
        self.what, self.source, self.node = what, source, node
        msg = f"the training step depends on tensor values, which a compiled step cannot: {what}"
        if node is not None:
            msg += describe_node(node)
        elif source:
            msg += f"\n  user code:  {source}"
        super().__init__(msg + f"\n  fix: {fix}")


class HostValueError(SpmdError):
    """The step stored a Python number read from a tensor (``.item()``, ``.tolist()``)
    on the model or optimizer; inside a compiled step it is a symbol, not a number.
    The attribute is restored before this is raised. Attributes: ``attributes``."""

    def __init__(self, attributes: list[str], sources: list[str]) -> None:
        self.attributes = attributes
        lines = "".join(f"\n  user code:  {s}" for s in sources)
        super().__init__(
            f"the training step stored a value read from a tensor (.item() / .tolist()) in "
            f"{', '.join(attributes)}; expected only tensors or unchanged Python values on the "
            f"model and optimizer, got a symbolic number (the compiled step never runs this "
            f"Python code again, so the attribute would never be updated){lines}"
            "\n  fix: return the value from the step instead (e.g. return {'loss': loss, ...}); "
            "the compiled step returns it after each call, and you can store it outside the step."
        )


class HostSettingError(SpmdError):
    """The step changed an optimizer setting (``param_groups[g]["lr"]``...) or a plain
    Python attribute of the model (a counter, a flag) while it ran: an LR scheduler's
    ``step()`` or an assignment inside the step. A compiled step
    runs the step's Python code once, when it is traced, so the change would happen once
    and never again (later calls would train with other settings than one device).
    Attributes: ``settings`` (``"optimizer.param_groups[0]['lr']"``, ``"model.micro_steps"``...), ``source``."""

    def __init__(self, settings: list[str], source: str | None, what: str, fix: str | None = None) -> None:
        self.settings, self.source = settings, source
        where = f"\n  user code:  {source}" if source else ""
        super().__init__(
            f"the training step changed {', '.join(settings)} while it ran ({what}); expected optimizer "
            "settings and the model's Python attributes to change only between calls of the compiled step, got a change inside it (the "
            "compiled step runs the step's Python code only once, when it is traced, so the change would "
            f"never happen again and later calls would train differently than on one device){where}"
            f"\n  fix: {fix or _SETTING_FIX}"
        )


_SETTING_FIX = (
    "step the LR scheduler (or set param_group['lr'] / ['momentum'] / ['betas']) outside the "
    "compiled step, after each call: `loss = train_step(model, opt, *batch); scheduler.step()`. "
    "The compiled step reads these settings from the optimizer at every call without recompiling."
)


class IncompleteStepError(SpmdError):
    """The traced step would not train as the single-device step does: ``backward()``
    went through an op with no autograd kernel on the tracing device (its gradient would
    be missing), or ``optimizer.step()`` found no gradient and would update nothing.
    Never compiled silently into a forward-only program. Attributes: ``what``, ``source``
    (the user's line, or None)."""

    def __init__(self, what: str, source: str | None, fix: str) -> None:
        self.what, self.source = what, source
        where = f"\n  user code:  {source}" if source else ""
        super().__init__(f"the traced training step is incomplete: {what}{where}\n  fix: {fix}")


class DeferredInitError(ValueError):
    """A model built on ``meta`` that cannot be initialized shard by shard: no init path
    (``compile(init_weights=...)``), an init that draws random numbers in a way that
    depends on the sharding (a plain tensor, a generator, an op other than ``uniform_`` /
    ``normal_``), or a parameter or buffer the init left uninitialized or replaced.
    Attributes: ``names`` (the parameters or buffers concerned, may be empty)."""

    def __init__(self, what: str, fix: str, names: list[str] | None = None) -> None:
        self.names = list(names or [])
        super().__init__(f"deferred initialization: {what}\n  fix: {fix}")


__all__ += ["DeferredInitError"]


class MemoryBudgetError(SpmdError):
    """The compiled program's static peak per rank exceeds ``compile(memory_budget_gb=...)``:
    raised at compile time, on every rank, before anything ran. Attributes: ``peak_bytes``,
    ``budget_bytes``, ``contributors`` (what is alive at the peak, largest first: (what, bytes))."""

    def __init__(self, message: str, peak_bytes: int, budget_bytes: int, contributors: list[tuple[str, int]]) -> None:
        self.peak_bytes, self.budget_bytes, self.contributors = peak_bytes, budget_bytes, list(contributors)
        super().__init__(message)


__all__ += ["MemoryBudgetError"]
