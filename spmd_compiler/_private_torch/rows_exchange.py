"""``spmd_compiler::all_to_all_rows``: rows of different counts to every rank of a group.

Expert parallelism sends each token row to the rank that holds its expert; how many rows
go from each rank to each rank depends on the routing (data), so the exchange takes its
counts as tensors (``all_to_all_single`` with split sizes, which torchtitan and Megatron
call with the sizes read back to the host). The result has a fixed number of rows,
``out_rows``, the received rows first, in source-rank order, then zeros: every shape of
the compiled program stays static.

Touches ``torch.distributed.distributed_c10d._resolve_process_group`` (the group of a
functional collective's name). Checked against torch 2.13.0 and 2.14.1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["ALL_TO_ALL_ROWS", "all_to_all_rows", "exchange_rows", "rows_exchange_inputs", "overflow_message"]


def _group(name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def exchange_rows(x: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor, out_rows: int, group_name: str,
                  most: torch.Tensor | None = None) -> torch.Tensor:
    """Send rows ``[sum(send_counts[:j]), +send_counts[j])`` of ``x`` to rank ``j`` of the
    group; receive ``recv_counts[j]`` rows from rank ``j``, in rank order, into the first
    rows of an ``out_rows``-row result of zeros. ``most``: the most rows any member of the
    group receives in this exchange (the same on every member), given where ``out_rows``
    may be too few: every member then stops here with the same error, before any row
    moves. (The op's body; the per-rank program's runner calls it directly, without the
    custom op's Python dispatch.)"""
    send = [int(c) for c in send_counts.tolist()]
    recv = [int(c) for c in recv_counts.tolist()]
    _check_capacity(recv, out_rows, most, int(x.shape[0]))
    if sum(recv) > out_rows:
        raise RuntimeError(overflow_message(recv, out_rows) + "; the group's ranks were not told (this is a bug in spmd-compiler)")
    if sum(send) > x.shape[0]:
        raise RuntimeError(f"all_to_all_rows: {sum(send)} rows to send from {x.shape[0]}; this is a bug in spmd-compiler")
    out = x.new_zeros((out_rows, *x.shape[1:]))
    dist.all_to_all_single(out[: sum(recv)], x[: sum(send)].contiguous(), recv, send, group=_group(group_name))
    return out


@torch.library.custom_op("spmd_compiler::all_to_all_rows", mutates_args=())
def all_to_all_rows(x: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor, out_rows: int, group_name: str,
                    most: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`exchange_rows` as an op of the per-rank graph (fake tensors, inductor)."""
    return exchange_rows(x, send_counts, recv_counts, out_rows, group_name, most)


@all_to_all_rows.register_fake
def _(x: torch.Tensor, send_counts: torch.Tensor, recv_counts: torch.Tensor, out_rows: int, group_name: str,
      most: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty((out_rows, *x.shape[1:]))


ALL_TO_ALL_ROWS = torch.ops.spmd_compiler.all_to_all_rows.default


def _check_capacity(recv: list[int], out_rows: int, most: torch.Tensor | None, rows: int) -> None:
    """ExpertCapacityError where ``most`` (the group's largest receive) exceeds ``out_rows``."""
    if most is not None and int(most) > out_rows:
        from ..errors import ExpertCapacityError

        raise ExpertCapacityError(overflow_message(recv, out_rows, int(most), rows))


def overflow_message(recv: list[int], out_rows: int, most: int | None = None, rows: int | None = None) -> str:
    """``rows``: this rank's own routed rows (the capacity's unit)."""
    most = sum(recv) if most is None else most
    need = f"of at least {most / rows:.2f} for this step" if rows else "larger than the current one"
    return (
        f"expert parallelism: this step routes {most} rows to the experts of one rank of the group (this rank: "
        f"{sum(recv)}, per source rank {recv}), more than the {out_rows} a rank's buffer holds "
        f"(Plan(expert_capacity=...) times its own routed rows); no token is dropped, every rank of the group stops "
        f"here, before the rows move. fix: Plan(expert_capacity=...) {need}, or leave it unset (the mesh axis size: never exceeded), or balance the "
        f"router (an auxiliary load-balancing loss)"
    )


def rows_exchange_inputs(xs: list[torch.Tensor], sends: list[torch.Tensor], recvs: list[torch.Tensor], out_rows: int,
                         mosts: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
    """The exchange computed for every member of a group at once (the simulator's): member
    ``i``'s result from every member's rows ``xs``, counts ``sends`` and ``recvs``; with
    ``mosts`` (each member's ``most``), every member's check as :func:`exchange_rows` makes it."""
    for x, recv, most in zip(xs, recvs, mosts or []):
        _check_capacity([int(c) for c in recv.tolist()], out_rows, most, int(x.shape[0]))
    out = []
    for i, recv in enumerate(recvs):
        pieces = []
        for j, (x, send) in enumerate(zip(xs, sends)):
            s = [int(c) for c in send.tolist()]
            pieces.append(x.narrow(0, sum(s[:i]), s[i]))
        got = torch.cat(pieces, dim=0)
        if got.shape[0] > out_rows:
            raise RuntimeError(overflow_message([int(p.shape[0]) for p in pieces], out_rows))
        if got.shape[0] != int(recv.sum()):
            raise RuntimeError(f"all_to_all_rows: member {i} expects {int(recv.sum())} rows, the others send {got.shape[0]}")
        buf = xs[i].new_zeros((out_rows, *xs[i].shape[1:]))
        buf[: got.shape[0]] = got
        out.append(buf)
    return out
