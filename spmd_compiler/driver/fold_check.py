"""The folded step check at run time: what each rank sends in the folded collective,
what it reads back, and when it raises :class:`.guard.Resync`.

:class:`FoldPoint` is one collective that carries the check (its encoding of the
program id and the result every rank reads when all of them sent the same id),
:class:`FoldChain` one such collective per mesh axis, :func:`resync_if_flagged` the
check the guarded program calls after the folded collective's wait. Where the check
can ride and how the program is rewritten for it: :mod:`.fold` (its module docstring
has the design).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch_digest import digest_agrees, digest_elements
from .guard import GuardError, Resync

__all__ = ["FoldChain", "FoldPoint", "resync_if_flagged"]

c10d = torch.ops._c10d_functional
_OPS = ("sum", "avg", "max")  # reductions under which "some rank sent 1" reads as "> 0"


@dataclass(frozen=True)
class FoldPoint:
    """The collective a program's step check rides on (nodes by name: the guarded
    variant is a copy of the graph).

    Attributes:
        collective, wait: names of the collective node and of its ``wait_tensor``.
        kind: "all_reduce" or "all_gather" (``all_gather_into_tensor``).
        op: the all_reduce's reduce op ("" for a gather); ``group``: the group name;
        world_size: ranks in the group (all of them).
        shape, dtype: the payload's (this rank's part); ``out_shape``: the result's.
        ids: the largest program id the extra elements carry exactly (the driver's
            ``cache_size``: ids are slots in its program cache, :meth:`encode`).
        digest: the batch tensors Replicate on this collective's axis, whose values
            every rank of it must share: ``(batch leaf index, placeholder name)`` each
            (empty: no value check); ``bits``: the digest's bits
            (:mod:`.batch_digest`), carried after the ids.
    """

    collective: str
    wait: str
    kind: str
    op: str
    group: str
    world_size: int
    shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    dtype: torch.dtype
    ids: int = 1
    digest: tuple[tuple[int, str], ...] = ()
    bits: int = 0

    def __post_init__(self) -> None:
        if not (self.op in _OPS if self.kind == "all_reduce" else (self.kind == "all_gather" and self.op == "")):
            raise ValueError(f"FoldPoint kind={self.kind!r} op={self.op!r}: expected an all_reduce with op one of {list(_OPS)}, "
                             f"or an all_gather with op ''")

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def extra(self) -> int:
        """Elements added to each rank's part: two for an all_reduce, one for a gather
        (the program id), as many again for the batch digest (if any)."""
        return self.id_extra + (self.id_extra if self.digest else 0)

    @property
    def id_extra(self) -> int:
        return 2 if self.kind == "all_reduce" else 1

    @property
    def spec(self) -> tuple:
        """What ranks running different programs must share to meet in this collective
        (node names aside): kind, op, group, ranks, payload shape and dtype, id range,
        and which batch tensors the digest covers, in how many bits."""
        return (self.kind, self.op, self.group, self.world_size, self.shape, self.dtype, self.ids,
                tuple(i for i, _ in self.digest), self.bits)

    def digest_check(self) -> tuple | None:
        """What :func:`resync_if_flagged` needs to read the digest elements (None: none)."""
        return (self.kind, self.op, self.world_size, self.bits) if self.digest else None

    def digest_agrees(self, rows: list) -> bool:
        """Whether the digest elements of the result (the rows' last elements) agree."""
        if not self.digest:
            return True
        return digest_agrees([r[self.id_extra:] for r in rows], self.kind, self.op, self.world_size, self.bits)

    def encode(self, program: int) -> list[int]:
        """The extra elements a rank running the program with id ``program`` sends (0:
        this rank runs no program, it only joins to make the others resync)."""
        if self.kind == "all_gather":
            return [program]
        if self.op == "max":
            return [program, self.ids - program]
        return [program, program * program]

    def expected(self, program: int) -> list[list[int]]:
        """The extra elements of the result (one row per rank for a gather) when every
        rank sent :meth:`encode` of ``program``, and only then: a max is the same id on
        every rank exactly when max(id) and max(ids - id) agree with it; a sum (avg) of
        (id, id**2) is (n*p, n*p**2) (the mean) exactly when every id is p, since
        sum((id - p)**2) = 0 (all of them exact in the dtype: :func:`.fold._why_not`)."""
        if self.kind == "all_gather":
            return [[program]] * self.world_size
        if self.op == "max":
            return [[program, self.ids - program]]
        n = 1 if self.op == "avg" else self.world_size
        return [[n * program, n * program * program]]

    def start(self, buf: torch.Tensor) -> torch.Tensor:
        """The collective on a payload ``buf`` (this rank's part, flat, with the id)."""
        if self.kind == "all_reduce":
            return c10d.all_reduce.default(buf, self.op, self.group)
        return c10d.all_gather_into_tensor.default(buf, self.world_size, self.group)

    def raise_flag(self, program: int = 0, leaves: list | None = None) -> list:
        """Take part in this folded collective with zeros and the id ``program`` (0: no
        program, only a mismatch for the others; same kind, size, dtype, op and group as
        the program's), wait for it, and return the extra elements every rank sent, as
        :meth:`expected` reads them, followed by the digest's (:meth:`digest_agrees`).
        ``leaves``: this rank's batch leaves, whose digest it sends (None: a digest of
        nothing, which reads as a difference only where the others sent another)."""
        buf = torch.zeros(self.numel + self.extra, dtype=self.dtype)
        buf[self.numel:self.numel + self.id_extra] = torch.tensor(self.encode(program), dtype=self.dtype)
        if self.digest:
            ok = program > 0 and leaves is not None and all(i < len(leaves) and isinstance(leaves[i], torch.Tensor) for i, _ in self.digest)
            tensors = [leaves[i] for i, _ in self.digest] if ok else []  # id 0 reads as a mismatch anyway
            buf[self.numel + self.id_extra:] = digest_elements(tensors, self.kind, self.op, self.bits, self.dtype)
        try:
            out = c10d.wait_tensor.default(self.start(buf))
        except RuntimeError as e:
            raise GuardError(str(e), where=self.where()) from e
        return out.view(-1, self.numel + self.extra)[:, self.numel:].tolist()

    def join(self, rest: tuple[FoldPoint, ...] = (), program: int = 0, leaves: list | None = None) -> None:
        """This rank does not run the agreed program: take part in its folded collective
        (and in the ``rest`` of a :class:`FoldChain`) with zeros and the id of the cached
        ``program`` it means to run (0: none). Returns only if every rank joined for the
        same ``program`` (all of them then run it, agreed) and the same batch digest
        (``leaves``: this rank's batch leaves); otherwise raises Resync (after sending 0
        in the chain's later collectives once it read a mismatch, as the programs'
        checks do)."""
        agreed = program > 0
        for p in (self, *rest):
            got = p.raise_flag(program if agreed else 0, leaves)
            agreed = [r[:p.id_extra] for r in got] == p.expected(program) and p.digest_agrees(got) and agreed
        if not agreed:
            raise Resync()

    def where(self) -> str:
        what = f"{self.op} of " if self.op else ""
        return (f"the program's first {self.kind} ({self.collective}, {what}{list(self.shape)} {self.dtype}), "
                f"which carries the per-step check that every rank runs the same program")


def resync_if_flagged(packed: torch.Tensor, width: int, expected: list, rest: tuple[tuple, ...] = (), pending: tuple = (),
                      digest: tuple | None = None) -> None:
    """The folded check: ``packed`` is the collective's result, rows of ``width``
    elements whose last ones carry the program ids every rank sent (one row for an
    all_reduce, one per rank for a gather); unless they read ``expected`` (every rank
    ran this program, :meth:`FoldPoint.expected`), some rank runs another program or
    none: raise Resync.

    In a :class:`FoldChain` (one folded collective per mesh axis) a rank that reads a
    mismatch first joins the chain's later folded collectives with id 0, ``rest`` (each
    a :class:`FoldPoint` as a tuple of its fields, so the graph holds only literals), so
    that the ranks of the other axes' groups learn it too; ``pending``: the collectives
    the program issued before this check and waits after it, waited before Resync (their
    whole group issued them, so they complete).

    ``digest`` (:meth:`FoldPoint.digest_check`): the ids are followed by each rank's
    batch digest elements (:mod:`.batch_digest`); ranks that sent different digests
    resync the same way (every rank reads the same result), and the exchange that
    follows raises the ValueError naming the tensor."""
    ids = len(expected[0])
    tail = ids * 2 if digest else ids
    rows = packed.view(-1, width)[:, width - tail:].tolist()
    same = agreed = [r[:ids] for r in rows] == expected
    if agreed and digest is not None:
        kind, op, n, bits = digest
        same = digest_agrees([r[ids:] for r in rows], kind, op, n, bits)
    if not same:
        for t in pending:
            c10d.wait_tensor.default(t)
        for fields in rest:
            FoldPoint(*fields).raise_flag()
        raise Resync() if not agreed else Resync("ranks of a mesh axis passed different values for a Replicate batch tensor")


@dataclass(frozen=True)
class FoldChain:
    """The step check folded into the first collective of each mesh axis's group (a
    mesh of several axes, where no collective spans every rank), in program order.

    Every rank runs the chain's collectives in the same order: a rank whose signature
    changed joins each with its flag raised (:meth:`join`); a rank that reads a flag in
    one raises it in the later ones before Resync (:func:`resync_if_flagged`). After the
    fold on axis ``a``, a flag has reached every rank of its ``a`` group; after one fold
    per axis, every rank of the mesh (the axis groups of a mesh connect its ranks: from
    any rank, a step along each axis reaches any other). A group's ranks read the same
    flags, so the collectives of an already folded axis between two folds are run or
    skipped by the whole group together; nothing else may run between them
    (:func:`.fold.find_fold`)."""

    points: tuple[FoldPoint, ...]

    def join(self, program: int = 0, leaves: list | None = None) -> None:
        """:meth:`FoldPoint.join` over every folded collective, in order."""
        self.points[0].join(rest=self.points[1:], program=program, leaves=leaves)

    @property
    def spec(self) -> tuple:
        """Every folded collective's :attr:`FoldPoint.spec`, in order."""
        return tuple(p.spec for p in self.points)

    def where(self) -> str:
        return "; ".join(p.where() for p in self.points)
