"""Values that cross between tensors and Python during the traced step.

A compiled step is one graph; Python code of the step runs once, while tracing. Three
things follow, each handled here:

* **data-dependent code** (``if loss > 0:``, ``x[mask]``): Python control flow or an
  op's output shape that depends on tensor values cannot be one graph. Tracing raises
  torch's raw errors, or leaves ops whose output size is a data-dependent ("unbacked")
  symbol; both become one :class:`~spmd_compiler.errors.DataDependentError` naming the
  user's line and what to write instead.
* **host values stored on the model** (``self.last_loss = loss.item()``): during the
  trace the number is a symbol. :class:`HostSnapshot` records the model's and the
  optimizer's plain attributes before the trace and restores any that now hold a
  symbol. A module attribute holding one number becomes an output of the step, and the
  driver sets the attribute to the real number after every call (as on one device);
  anything else (a list appended to, an optimizer setting) raises
  :class:`~spmd_compiler.errors.HostValueError`.
* **numbers the step returns** (``return {"loss": loss.item(), "rows": x.size(0)}``)
  are outputs too, handed back as Python numbers.
* **a hyperparameter returned by the step** (``return {"lr": opt.param_groups[0]["lr"]}``):
  the returned leaf is recorded as :class:`HparamValue` and read from the optimizer
  after every call, so an LR scheduler's value comes back as on one device.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from .. import _private_torch as pt
from ..errors import DataDependentError, HostSettingError, HostValueError, user_frame_of, user_source_line

__all__ = ["HparamValue", "HostSnapshot", "as_data_dependent_error", "check_data_dependent_shapes", "resolve_constant", "user_outputs", "with_batch_sizes_named"]

SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)

_BRANCH_FIX = (
    "compute both sides and select with torch.where(cond, a, b) (or multiply by a 0/1 mask) "
    "instead of `if` on a tensor; read .item() / float() / bool() only outside the step, on "
    "what the compiled step returns."
)
_READ = "aten._local_scalar_dense: .item() / float() / int() / bool() / .tolist(); u0, zuf0... name such numbers"
_SHAPE_FIX = (
    "keep shapes fixed: instead of a boolean-mask index x[mask] (or nonzero / masked_select), "
    "use ignore_index (F.cross_entropy(..., ignore_index=-100)), per-element weights "
    "((loss * mask).sum() / mask.sum()) or torch.where(mask, x, 0); sizes may come from "
    "tensor shapes, never from tensor values (.item())."
)


_SCALER_FIX = (
    "torch.amp.GradScaler.step() decides whether to update with a Python `if` on its found-inf "
    "flag, which a compiled step cannot trace. Use bfloat16 autocast "
    "(torch.autocast(device, dtype=torch.bfloat16)), which needs no loss scaling, or a fixed "
    "loss scale: (loss * S).backward(), then divide the gradients by S (or torch.where on a "
    "finiteness check to zero a step) before optimizer.step()."
)


_NONFINITE_FIX = (
    "clip_grad_norm_(..., error_if_nonfinite=True) raises with a Python `if` on the total norm, "
    "which a compiled step cannot trace. Leave error_if_nonfinite out (the default, False) and "
    "check the norm clip_grad_norm_ returns outside the step: return it from the step "
    "(`return {'loss': loss, 'grad_norm': norm}`) and raise when "
    "`not torch.isfinite(out['grad_norm'])` after the call."
)


def _raised_in(exc: BaseException, path_suffix: str) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith(path_suffix):
            return True
        tb = tb.tb_next
    return False


def _branch_fix(exc: BaseException) -> str:
    if _raised_in(exc, "amp/grad_scaler.py"):
        return _SCALER_FIX
    if _raised_in(exc, "nn/utils/clip_grad.py"):
        return _NONFINITE_FIX
    return _BRANCH_FIX


def as_data_dependent_error(exc: BaseException) -> DataDependentError:
    """The DataDependentError for one of torch's data-dependent tracing errors."""
    source = user_frame_of(exc)
    func = getattr(exc, "func", None)
    if func is not None:  # DynamicOutputShapeException / DataDependentOutputException
        return DataDependentError(f"{func} has an output shape (or value) that depends on tensor values", source, _SHAPE_FIX)
    text = str(exc).split("(unhinted")[0].strip().split("\n")[0]
    if "specialized" in text:  # int(x.item()) as a size, range(), an index
        expr = text.split("expression")[-1].strip()
        what = (
            f"a number read from a tensor ({_READ}) is used where a plain Python number is needed "
            f"(a size, range() or an index), so its value `{expr}` would be fixed in the compiled step"
        )
        return DataDependentError(what, source, _SHAPE_FIX)
    expr = text.removeprefix("Could not guard on data-dependent expression ")
    what = (
        f"Python control flow on a tensor's value: `if` / bool() / a comparison needs `{expr}`, "
        f"a number read from a tensor ({_READ}), to decide what the step does"
    )
    return DataDependentError(what, source, _branch_fix(exc))


def check_data_dependent_shapes(gm: fx.GraphModule) -> None:
    """Raise DataDependentError at the first op whose output tensor has a size that
    depends on tensor values (``x[mask]``, ``nonzero``); numbers read with ``.item()``
    are fine as long as no size is made of them."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        val = node.meta.get("val")
        tensors = [v for v in (val if isinstance(val, (tuple, list)) else [val]) if isinstance(v, torch.Tensor)]
        if any(pt.unbacked_symbols(t) for t in tensors):
            what = f"{node.target} returns a tensor whose size depends on tensor values"
            raise DataDependentError(what, user_source_line(node), _SHAPE_FIX, node=node)


@dataclass(frozen=True)
class HparamValue:
    """A leaf of the step's return value that is optimizer hyperparameter ``key`` of
    param group ``group`` (``optimizer.param_groups[0]["lr"]``): read after every call."""

    group: int
    key: str
    index: int | None = None  # an element of a pair (``betas[0]``)

    def resolve(self, optimizer: Any) -> Any:
        value = optimizer.param_groups[self.group][self.key]
        if self.index is not None:
            value = value[self.index]
        return value.item() if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad else value


def resolve_constant(value: Any, optimizer: Any) -> Any:
    """A constant leaf of the step's return value as the user sees it this call."""
    return value.resolve(optimizer) if isinstance(value, HparamValue) else value


# a number computed in the step (loss.item()) travels as a 0-d tensor output
_NUMBER_DTYPES = {torch.SymFloat: torch.float64, torch.SymInt: torch.int64, torch.SymBool: torch.bool}
_NUMBER_TYPES = {torch.SymFloat: float, torch.SymInt: int, torch.SymBool: bool}


def user_outputs(
    leaves: list[Any], read: dict[tuple[int, str], Any], hparams: dict[tuple[int, str], Any], stored: list[tuple[str, str, Any]]
) -> tuple[list[torch.Tensor], list[int], dict[int, Any], dict[int, type], dict[int, tuple[str, str]]]:
    """What the traced step returns for the leaves of its return value and the numbers it
    ``stored`` on modules (:meth:`HostSnapshot.stored_numbers`, numbered after the leaves):
    ``(tensors, their leaf indices, constants, {index: Python type of a number}, {index:
    (module, attribute)})``. Tensors and numbers (``loss.item()``, ``x.size(0)``) are
    graph outputs; constants and returned hyperparameters (:class:`HparamValue`) are not."""
    outs: list[torch.Tensor] = []
    indices: list[int] = []
    constants: dict[int, Any] = {}
    numbers: dict[int, type] = {}
    for i, leaf in enumerate(leaves):
        # a fused optimizer reads a float lr as a tensor: returned, it is the float as on one device
        lr_key = next((k for k, v in read.items() if v is leaf and not isinstance(hparams[k], torch.Tensor)), None)
        if lr_key is not None:
            constants[i] = HparamValue(*lr_key)
        elif isinstance(leaf, torch.Tensor):
            outs.append(leaf)
            indices.append(i)
        else:
            constants[i] = _hparam_leaf(leaf, read, hparams)
            if isinstance(constants[i], SYM_TYPES):  # loss.item(), x.size(0), lr * 2
                kind = type(constants.pop(i))
                outs.append(torch.scalar_tensor(leaf, dtype=_NUMBER_DTYPES[kind]))
                indices.append(i)
                numbers[i] = _NUMBER_TYPES[kind]
    attrs: dict[int, tuple[str, str]] = {}
    for j, (owner, key, value) in enumerate(stored, start=len(leaves)):
        outs.append(torch.scalar_tensor(value, dtype=_NUMBER_DTYPES[type(value)]))
        indices.append(j)
        numbers[j] = _NUMBER_TYPES[type(value)]
        attrs[j] = (owner, key)
    return outs, indices, constants, numbers, attrs


def _hparam_leaf(leaf: Any, read: dict[tuple[int, str], Any], hparams: dict[tuple[int, str], Any]) -> Any:
    """A returned constant that is a lifted hyperparameter as the optimizer read it (or
    as it was before ``optimizer.step()``) becomes an :class:`HparamValue`, read again
    after every call; anything else stays a constant."""
    for key, value in read.items():
        if leaf is value:
            return HparamValue(*key)
        if isinstance(value, tuple) and any(leaf is v for v in value):  # betas[i]
            return HparamValue(*key, index=next(i for i, v in enumerate(value) if leaf is v))
    if isinstance(leaf, (int, float)) and not isinstance(leaf, bool):
        for key in read:
            before = hparams.get(key)
            if leaf is before:
                return HparamValue(*key)
            if isinstance(before, (tuple, list)) and any(leaf is v for v in before):
                return HparamValue(*key, index=next(i for i, v in enumerate(before) if leaf is v))
    return leaf


# -------------------------------------------------------------- host values on the model
_MODULE_INTERNALS = frozenset({"_parameters", "_buffers", "_modules", "training"})
_OPTIM_INTERNALS = frozenset({"state", "param_groups", "defaults"})


def _holds_symbol(value: Any, depth: int = 0) -> bool:
    if isinstance(value, SYM_TYPES):
        return True
    if depth < 3 and isinstance(value, (list, tuple)):
        return any(_holds_symbol(v, depth + 1) for v in value)
    if depth < 3 and isinstance(value, dict):
        return any(_holds_symbol(v, depth + 1) for v in value.values())
    return False


def _symbols_of(value: Any, depth: int = 0) -> list[Any]:
    if isinstance(value, SYM_TYPES):
        return [value]
    if depth < 3 and isinstance(value, (list, tuple, dict)):
        items = value.values() if isinstance(value, dict) else value
        return [s for v in items for s in _symbols_of(v, depth + 1)]
    return []


class HostSnapshot:
    """The plain attributes of a model's modules and of an optimizer (its own, its param
    groups' settings, its per-parameter state), recorded before a trace.

    :meth:`restore_symbols` puts back every attribute that now holds a SymInt /
    SymFloat / SymBool (or a list, tuple or dict holding one) as it was and returns their
    names; lists and dicts mutated in place get their old contents back.
    """

    def __init__(self, model: torch.nn.Module, optimizer: Any) -> None:
        self._owners: list[tuple[str, Any, frozenset]] = [
            (f"model.{name}" if name else "model", m.__dict__, _MODULE_INTERNALS) for name, m in model.named_modules()
        ]
        if optimizer is not None:
            self._owners.append(("optimizer", optimizer.__dict__, _OPTIM_INTERNALS))
            for g, group in enumerate(optimizer.param_groups):
                self._owners.append((f"optimizer.param_groups[{g}]", group, frozenset({"params"})))
        self._optimizer = optimizer
        self._saved = [{k: (v, _copy(v)) for k, v in d.items() if k not in skip} for _, d, skip in self._owners]

    def restore_symbols(self) -> list[tuple[str, list[Any]]]:
        """Restore attributes holding symbols; return ``(attribute, symbols)`` for each."""
        found: list[tuple[str, list[Any]]] = []
        for (label, d, skip), saved in zip(self._owners, self._saved):
            for key in [k for k in list(d) if k not in skip and _holds_symbol(d[k])]:
                found.append((f"{label}.{key}" if not label.startswith("optimizer.param_groups") else f"{label}[{key!r}]", _symbols_of(d[key])))
                if key not in saved:
                    del d[key]
                    continue
                obj, contents = saved[key]
                if isinstance(obj, list) and contents is not None:
                    obj[:] = contents
                elif isinstance(obj, dict) and contents is not None:
                    obj.clear()
                    obj.update(contents)
                d[key] = obj
        if self._optimizer is not None:  # per-parameter state of the real optimizer
            for p, entry in list(self._optimizer.state.items()):
                for key in [k for k, v in list(entry.items()) if _holds_symbol(v)]:
                    found.append((f"optimizer.state[<param>][{key!r}]", _symbols_of(entry.pop(key))))
        return found

    def restore_plain_writes(self) -> list[str]:
        """Put back every model attribute holding a plain Python value (bool, int, float,
        str) that the step assigned a different value or created (``self.micro_steps += 1``)
        and return their names: the step's Python runs once, at the trace, so such a
        write would happen once and never again. A bool the step *created* is a library's
        lazy one-time flag and is kept."""
        found = []
        for (label, d, skip), saved in zip(self._owners, self._saved):
            if not label.startswith("model"):
                continue
            for key in [k for k in list(d) if k not in skip and _plain_scalar(d[k])]:
                if key in saved:
                    old = saved[key][0]
                    if d[key] is old or (old is None or _plain_scalar(old)) and type(old) is type(d[key]) and old == d[key]:
                        continue
                    if not (old is None or _plain_scalar(old)):
                        continue
                    d[key] = old
                elif isinstance(d[key], bool):
                    # a flag created once, lazily, by a library's first forward (transformers'
                    # ``_output_capturing_hooks_installed``): not a counter; it stays set, and
                    # a later trace that flips it is a change like any other
                    continue
                else:
                    del d[key]
                found.append(f"{label}.{key}")
        return found

    def stored_numbers(self) -> list[tuple[str, str, Any]]:
        """``(module, attribute, number)`` for each module attribute that now holds one
        number read from a tensor (``self.last_loss = loss.item()``): the compiled step
        returns it and the driver sets the attribute after every call."""
        return [
            (label, key, d[key]) for label, d, skip in self._owners if label.startswith("model")
            for key in list(d) if key not in skip and isinstance(d[key], SYM_TYPES)
        ]

    def check(self, gm: fx.GraphModule | None, stored: set[tuple[str, str]] = frozenset()) -> None:
        """Restore, then raise HostValueError if anything held a symbol (other than the
        ``stored`` ``(module, attribute)`` numbers, which the compiled step returns)."""
        done = {f"{label}.{key}" for label, key in stored}
        found = [(name, symbols) for name, symbols in self.restore_symbols() if name not in done]
        written = self.restore_plain_writes()
        if written and not found:
            raise HostSettingError(written, None, "an assignment to a model attribute", _COUNTER_FIX)
        if not found:
            return
        sources = []
        for _, symbols in found:
            for node in _nodes_defining(gm, symbols):
                line = user_source_line(node)
                if line and line not in sources:
                    sources.append(line)
        raise HostValueError([name for name, _ in found], sources)


_COUNTER_FIX = (
    "keep counters and flags outside the compiled step, in the training loop, and pass what the "
    "step needs as an argument: a Python bool or int argument selects a program of its own "
    "(`train_step(model, opt, x, y, do_step=(i % 2 == 1))`), a tensor argument is data; "
    "a number the step computes comes back if the step returns it."
)


def _plain_scalar(value: Any) -> bool:
    return isinstance(value, (bool, int, float, str))


def _copy(value: Any) -> Any:
    if isinstance(value, list):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    return None


def _nodes_defining(gm: fx.GraphModule | None, symbols: list[Any]) -> list[fx.Node]:
    """Graph nodes (``.item()`` reads) whose value is one of ``symbols`` or shares its
    data-dependent symbols."""
    if gm is None:
        return []
    wanted = set().union(*(pt.sym_free_symbols(s) for s in symbols)) if symbols else set()
    out = []
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, SYM_TYPES) and (any(val is s for s in symbols) or pt.sym_free_symbols(val) & wanted):
            out.append(node)
    return out


def with_batch_sizes_named(exc: BaseException, inputs: list[Any], fakes: list[Any], real: list[Any]) -> BaseException | None:
    """The user's step raised ``exc`` while traced (a builtin error, such as
    cross_entropy's "Expected input batch_size (8*s60) to match target batch_size
    (8*s3)" for inputs and targets of different lengths): the same error with the size
    symbols it names explained (``s60 = batch[0].size(0) = 6``), the step's line and a
    fix; None when it names none (raised unchanged)."""
    if type(exc) not in (ValueError, RuntimeError, IndexError, TypeError):
        return None
    text = str(exc)
    names = []
    for inp, fake, t in zip(inputs, fakes, real):
        if inp.kind != "batch" or not isinstance(fake, torch.Tensor):
            continue
        for d, size in enumerate(fake.shape):
            if pt.is_symbolic(size) and re.search(rf"\b{re.escape(str(pt.sym_expr(size)))}\b", text):
                names.append(f"{pt.sym_expr(size)} = {inp.label}.size({d}) = {t.shape[d]} in the traced (global) batch")
    if not names:
        return None
    where = user_frame_of(exc)
    return type(exc)(
        f"{text.strip()}\n(the training step raised this while spmd_compiler traced it"
        + (f", at {where}" if where else "")
        + f"; sizes are symbols there: {', '.join(names)}). It raises on one device with this batch too. "
        "fix: correct the step or the batch (a single-device call of the step shows the concrete sizes)"
    )

