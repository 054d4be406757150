"""Deferred initialization: a model built on ``meta``, given values shard by shard.

A model built under ``torch.device("meta")`` has shapes and no values. With
``compile(..., init_weights=...)`` the first call gives it values as FSDP2 and
torchtitan do (``fully_shard`` on meta, ``to_empty``, ``init_weights()``), and no rank
ever holds a whole parameter: :func:`~.distribute.distribute_state` allocates only each
parameter's local shard, on the mesh's device, as a DTensor with the plan's placements
(:func:`empty_shard`), and :func:`run_init` runs the model's own init on those DTensors.
An init written for one device works unchanged: ``nn.init.*`` reads the global shape (the
fan-in) from the DTensor and writes every element through its shard.

**The contract** (why the values equal one device's). Constants and elementwise ops
(``ones_``, ``zeros_``, ``fill_``, ``mul_``, ``clamp_``...) are shard-independent by
themselves. Random numbers are not: torch's generator hands out a draw's elements in
sequence, and a shard cannot skip to its first element without drawing the ones before.
So while the init runs, :class:`ShardIndependentDraws` replaces every ``uniform_`` and
``normal_`` (and ``rand_like`` / ``randn_like``) by a counter-based stream: element ``i``
of the whole tensor (row-major) of the ``k``-th draw into tensor ``T`` is ``f(seed, name,
k, i)`` (a splitmix64 hash; normal by Box-Muller), where ``name`` is T's FQN when T is a
parameter or buffer (``k`` counts the draws into it) and ``""`` for a temporary such as
``trunc_normal_``'s resampling buffer (``k`` counts those, in program order). Each rank
computes only its shard's elements, at their global indices. The values therefore depend
on the seed, the names and the init code, not on the mesh, the placements or the order in
which parameters are initialized, and equal those of :func:`materialize`, which runs the
same init on one device under the same draws. They are *not* the numbers of
``torch.manual_seed(s); Model()``, whose draws depend on the global generator's order.

Refused with :class:`~spmd_compiler.errors.DeferredInitError` naming the op and a fix:
while sharding, a random op on a plain tensor (``torch.randn(shape)`` then ``copy_``: the
whole tensor drawn on every rank, or a shard's local tensor, drawn by position in the
shard), any draw with an explicit ``generator=``, a random op other than those above
(``bernoulli_``, ``randperm``, ``exponential_``...), a ``Partial`` target; after the init,
a parameter or buffer it never wrote (``to_empty`` leaves memory uninitialized) or a
parameter it replaced (a buffer it replaced, such as torchtitan's recomputed
``freqs_cis``, is distributed as the plan says).
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from .. import _private_torch as pt
from ..errors import DeferredInitError

__all__ = ["ShardIndependentDraws", "materialize", "run_init", "empty_shard", "init_callable", "target_device", "uniform01"]

log = logging.getLogger(__name__)
aten = torch.ops.aten

_FIX_INIT = ("compile(..., init_weights='reset_parameters') (every module's reset_parameters(), as FSDP2 documents) or "
             "init_weights=lambda model: model.init_weights() (torchtitan); each rank then allocates and initializes only "
             "its own shards (docs/tutorial.md, 'Deferred initialization')")
_CHUNK = 1 << 22  # elements drawn at once: the counters and their float64 values stay a few tens of MB


# ---------------------------------------------------------------------------- counter-based draws
def _signed(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _M1, _M2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 (products wrap modulo 2**64)."""
    x = x ^ _srl(x, 30)
    x = x * _M1
    x = x ^ _srl(x, 27)
    x = x * _M2
    return x ^ _srl(x, 31)


def uniform01(key: int, counter: torch.Tensor) -> torch.Tensor:
    """float64 numbers in [0, 1), one per int64 ``counter``, a pure function of (key, counter)."""
    return _srl(_mix(counter * _GOLDEN + key), 11).to(torch.float64) * 2.0**-53


def _key(seed: int, name: str, k: int) -> int:
    return _signed(int.from_bytes(hashlib.sha256(f"{seed}/{name}/{k}".encode()).digest()[:8], "little"))


def _global_index(global_shape: tuple[int, ...], local_shape: tuple[int, ...], offset: tuple[int, ...],
                  start: int, end: int) -> torch.Tensor:
    """Row-major indices in the whole tensor of the local elements ``start:end`` (row-major in the shard)."""
    j = torch.arange(start, end, dtype=torch.int64)
    out = torch.zeros_like(j)
    stride = 1
    for d in reversed(range(len(global_shape))):
        out += (j % local_shape[d] + offset[d]) * stride
        j = j // local_shape[d]
        stride *= global_shape[d]
    return out


def _values(op: Any, key: int, index: torch.Tensor, args: tuple) -> torch.Tensor:
    if op is aten.uniform_.default:
        low, high = (list(args) + [0.0, 1.0])[:2]
        return low + (high - low) * uniform01(key, index)
    mean, std = (list(args) + [0.0, 1.0])[:2]
    u1, u2 = uniform01(key, 2 * index), uniform01(key, 2 * index + 1)
    return mean + std * (torch.sqrt(-2.0 * torch.log1p(-u1)) * torch.cos(2.0 * math.pi * u2))


def _fill(local: torch.Tensor, op: Any, key: int, args: tuple, global_shape: tuple[int, ...], offset: tuple[int, ...]) -> None:
    """Write the draw into ``local`` (a whole tensor, or one rank's shard at ``offset``)."""
    shape, n = tuple(local.shape), local.numel()
    if n == 0:
        return
    if local.is_contiguous():
        flat = local.view(-1)
        for start in range(0, n, _CHUNK):
            end = min(n, start + _CHUNK)
            flat[start:end].copy_(_values(op, key, _global_index(global_shape, shape, offset, start, end), args))
    else:
        local.copy_(_values(op, key, _global_index(global_shape, shape, offset, 0, n), args).view(shape))


def _strided_blocks(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: Any,
                    placements: tuple) -> list[tuple[Any, int, int, tuple[int, ...]]] | None:
    """This rank's shard as blocks ``(dim, local start, size, global offset)``: one block
    (``dim`` None) for Shard/Replicate placements; for a ``fused_shard(d, sf)`` on one mesh
    axis (no other splitting ``d``) one block per piece, rank ``j`` of ``n`` holding rows
    ``[i L/sf + j c, + c)`` of piece ``i`` (``c = L / (sf n)``); None for other layouts."""
    strided = [(a, p) for a, p in enumerate(placements) if isinstance(p, pt.StridedShard)]
    if not strided:
        _, offset = pt.local_shape_and_offset(shape, mesh_shape, coordinate, placements)
        return [(None, 0, 0, tuple(offset))]
    if len(strided) > 1:
        return None
    axis, p = strided[0]
    d, sf, n = p.dim % len(shape), int(p.split_factor), mesh_shape[axis]
    if any(getattr(q, "dim", None) == d for a, q in enumerate(placements) if a != axis) or shape[d] % (sf * n):
        return None
    rest = list(placements)
    rest[axis] = pt.Replicate()
    _, offset = pt.local_shape_and_offset(shape, mesh_shape, coordinate, rest)
    c = shape[d] // (sf * n)
    out = []
    for i in range(sf):
        at = list(offset)
        at[d] = i * (shape[d] // sf) + coordinate[axis] * c
        out.append((d, i * c, c, tuple(at)))
    return out


def _storage(t: torch.Tensor) -> int:
    local = pt.local_tensor(t)
    return local.untyped_storage().data_ptr() if local.numel() else 0


class ShardIndependentDraws(TorchDispatchMode):
    """While an init runs: draws from the counter-based streams of the module docstring,
    refusals of what would depend on the sharding, and a record of what was written.

    Attributes: ``written`` (storage pointers of every tensor an op wrote), ``draws``
    (draws per name), ``largest`` (elements of the largest local tensor an op made:
    while sharding, never a whole sharded parameter).
    """

    _DRAWS = (aten.uniform_.default, aten.normal_.default)
    _LIKE = {aten.rand_like.default: aten.uniform_.default, aten.randn_like.default: aten.normal_.default}

    def __init__(self, seed: int, named: dict[str, torch.Tensor], *, sharded: bool) -> None:
        super().__init__()
        self.seed, self.sharded = int(seed), sharded
        self.ids = {id(t): n for n, t in named.items()}  # the parameter objects themselves (an empty shard has no storage)
        self.names = {_storage(t): (n, pt.local_tensor(t).numel()) for n, t in named.items() if pt.local_tensor(t).numel()}
        self.draws: Counter[str] = Counter()
        self.written: set[int] = set()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in self._LIKE:
            if kwargs.get("generator") is not None:
                self._refuse(func, "with an explicit generator")
            like = {k: v for k, v in kwargs.items() if k != "generator"}
            out = aten.empty_like.default(args[0], **like)
            return self._draw(self._LIKE[func], out, ())
        if func in self._DRAWS:
            if kwargs.get("generator") is not None:
                self._refuse(func, "with an explicit generator")
            return self._draw(func, args[0], tuple(args[1:]) + tuple(kwargs[k] for k in ("from", "to", "mean", "std") if k in kwargs))
        if torch.Tag.nondeterministic_seeded in func.tags:
            self._refuse(func, "(only uniform_, normal_, rand_like and randn_like draw shard-independent numbers)")
        out = func(*args, **kwargs)
        for arg, value in zip(func._schema.arguments, list(args) + [kwargs.get(a.name) for a in func._schema.arguments[len(args):]]):
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, torch.Tensor):
                self.written.add(_storage(value))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, pt.local_tensor(t).numel())
        return out

    def _draw(self, op: Any, target: torch.Tensor, args: tuple) -> torch.Tensor:
        if isinstance(target, DTensor):
            placements = tuple(target.placements)
            if any(p.is_partial() for p in placements):
                self._refuse(op, f"into a DTensor placed {list(placements)} (only Shard, fused_shard and Replicate)")
            mesh = target.device_mesh
            local = pt.local_tensor(target)
            blocks = _strided_blocks(tuple(target.shape), tuple(mesh.shape), mesh.get_coordinate(), placements)
            if blocks is None:
                self._refuse(op, f"into a DTensor placed {list(placements)} (a fused_shard dim split by one mesh axis, "
                                 f"in equal blocks, only)")
        elif self.sharded:
            owner = self.names.get(_storage(target))
            what = f"into the local shard of {owner[0]!r}" if owner else f"into a plain tensor of shape {list(target.shape)}"
            self._refuse(op, f"{what}: a plain tensor is drawn whole on every rank, or by position within one shard")
        else:
            local, blocks = target, [(None, 0, 0, (0,) * target.dim())]
        whole = self.names.get(_storage(target))
        name = self.ids.get(id(target)) or (whole[0] if whole is not None and whole[1] == pt.local_tensor(target).numel() else "")
        k = self.draws[name]
        self.draws[name] += 1
        for dim, start, size, at in blocks:  # one block, or a fused_shard's pieces, each at its global offset
            _fill(local if dim is None else local.narrow(dim, start, size), op, _key(self.seed, name, k), args,
                  tuple(target.shape), at)
        self.written.add(_storage(target))
        return target

    @staticmethod
    def _refuse(op: Any, what: str) -> None:
        raise DeferredInitError(
            f"the init drew random numbers with {op} {what}, which would depend on how the model is sharded",
            "initialize each parameter in place with uniform_ / normal_ or the nn.init functions built on them "
            "(nn.init.normal_(p), trunc_normal_, kaiming_uniform_, xavier_normal_...), with no generator= argument; "
            "constants and elementwise ops are fine (docs/tutorial.md, 'Deferred initialization')")


def init_callable(init_weights: Any) -> Callable[[torch.nn.Module], Any]:
    """``init_weights`` as a callable of the model: ``"reset_parameters"`` calls every
    submodule's ``reset_parameters()`` (in ``model.modules()`` order), a callable is itself."""
    if callable(init_weights):
        return init_weights
    if init_weights == "reset_parameters":
        def reset(model: torch.nn.Module) -> None:
            for m in model.modules():
                if callable(getattr(m, "reset_parameters", None)):
                    m.reset_parameters()

        return reset
    raise TypeError(f"init_weights={init_weights!r}: expected 'reset_parameters', a callable init_weights(model), or None")


def _named_tensors(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, bool]]:
    out = {n: (p, False) for n, p in model.named_parameters()}
    out.update({n: (b, True) for n, b in model.named_buffers()})
    return out


def run_init(model: torch.nn.Module, init_weights: Any, *, seed: int, sharded: bool) -> tuple[ShardIndependentDraws, dict[str, torch.Tensor]]:
    """Run ``init_weights`` on ``model`` (materialized: DTensor shards when ``sharded``,
    plain tensors otherwise) under :class:`ShardIndependentDraws`; check that every
    parameter and buffer was written and no parameter replaced. Returns the draws and the
    buffers the init replaced (by FQN, to be distributed)."""
    fn = init_callable(init_weights)
    before = _named_tensors(model)
    draws = ShardIndependentDraws(seed, {n: t for n, (t, _) in before.items()}, sharded=sharded)
    with torch.no_grad(), draws:
        fn(model)
    after = _named_tensors(model)
    replaced = {n: t for n, (t, buffer) in after.items() if n in before and t is not before[n][0]}
    params = sorted(n for n in replaced if not after[n][1])
    if params:
        raise DeferredInitError(
            f"the init replaced parameter(s) {params[:4]}{' ...' if len(params) > 4 else ''} with new tensors",
            "write into the existing parameters in place (nn.init.*_, p.copy_(...), p.fill_(...)) instead of assigning "
            "new nn.Parameters in init_weights", params)
    missing = sorted(n for n, (t, _) in after.items()
                     if n not in replaced and pt.local_tensor(t).numel() and _storage(t) not in draws.written)
    if missing:
        raise DeferredInitError(
            f"{len(missing)} parameter(s)/buffer(s) were left uninitialized by the init ({', '.join(missing[:4])}"
            f"{', ...' if len(missing) > 4 else ''}); a model built on meta holds no values, and its memory after "
            f"materializing is garbage",
            "initialize them in init_weights (buffers computed in __init__, such as RoPE tables or causal masks, are "
            "meta too: assign them again there, e.g. self.freqs_cis = precompute_freqs_cis(...))", missing)
    log.info("initialized %d tensors (%s draws)", len(after), sum(draws.draws.values()))
    return draws, {n: t for n, t in replaced.items()}


def target_device(device_type: str) -> torch.device:
    """The device a mesh of ``device_type`` computes on (its current CUDA device)."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def empty_shard(t: torch.Tensor, mesh: Any, placements: Any, device: torch.device) -> DTensor:
    """A DTensor placed as ``placements`` over ``mesh`` whose local tensor is this rank's
    shard of ``t`` (a meta tensor), allocated on ``device`` and uninitialized."""
    placements = list(placements)
    shape, _ = pt.local_shape_and_offset(tuple(t.shape), tuple(mesh.shape), mesh.get_coordinate(), placements)
    local = torch.empty(shape, dtype=t.dtype, device=device)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=t.shape, stride=t.stride())


def materialize(model: torch.nn.Module, init_weights: Any = "reset_parameters", *, seed: int = 0,
                device: Any = "cpu") -> torch.nn.Module:
    """Give a model built on ``meta`` values on one ``device``: ``model.to_empty(device=...)``
    then ``init_weights`` (``"reset_parameters"`` or a callable of the model) under the same
    shard-independent draws a compiled step's deferred init uses, so the result equals what
    ``compile(..., init_weights=init_weights, init_seed=seed)`` gives on any mesh. Parameters
    keep their identity (an optimizer built on the meta model stays valid). Returns the model."""
    model.to_empty(device=device)
    run_init(model, init_weights, seed=seed, sharded=False)
    return model
