"""Where every row sits around an ``all_to_all_single``: the maps the ``nccl`` backends'
fused pack / unpack kernels read. Pure torch on device, built once per ``prepare``.

[Note: exchange layout]
One buffer per backend holds both sides of the exchange: rows ``[0, A)`` are the *arrival*
region (rows this rank receives in dispatch, sends back in combine), rows ``[A, A + S)`` the
*send* region. A pair whose expert lives on another rank has a *slot position* ``q`` among
this rank's rows to that peer, in the receiver's order (local expert, then the pair's index
among this rank's pairs to that expert): the receiver finds the same position from its own
receive layout. Pairs to this rank's own experts never enter the buffer: dispatch writes
them straight into the receive rows, combine reads them straight from ``expert_out``.

Each region holds peer 0's rows, then peer 1's, ...: one contiguous ``all_to_all_single``
input and output. Peer ``d``'s ``n_d`` rows are the exact count (``nccl``: read on the host,
one sync per ``prepare``) or a fixed per-peer capacity (``nccl_padded``: equal static
splits, no sync, rows past the capacity are not sent and are reported by ``check()``).
One exchange per move, not several chunks whose pack and unpack overlap the transfer: on
NVLink NCCL's kernels slowed beside the copies by more than the overlap saved (BENCHMARKS.md,
'Expert parallelism').
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

__all__ = ["ExchangePlan", "plan_exchange"]


class ExchangePlan(NamedTuple):
    """Maps of one handle (device tensors) and the exchange's split sizes (host ints).

    pair_row / pair_where: [T*K] int64: pair p's row is row ``pair_row[p]`` of the exchange
        buffer (``pair_where[p] == 0``) or of this rank's receive rows (``== 1``: its expert
        is local); ``pair_row[p] = -1``: the pair is not sent.
    arrival_row: [A] int64, the receive row of each arrival row (-1: padding).
    send_splits / recv_splits: rows to / from each rank (0 for this rank).
    send_range / recv_range: ``(first, end)`` rows of the exchange buffer.
    needed: [] int64, the most rows this rank sends to one peer (the padded overflow check).
    """

    pair_row: torch.Tensor
    pair_where: torch.Tensor
    arrival_row: torch.Tensor
    send_splits: list
    recv_splits: list
    send_range: list
    recv_range: list
    needed: torch.Tensor


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    """Each peer's first row in its region: the exclusive prefix sum of ``counts``."""
    return counts.cumsum(0) - counts


def _pair_rows(handle, ctx, send_counts, send_base, peer_rows):
    lay, me = handle.layout, ctx.rank
    world, local = ctx.world_size, ctx.experts_per_rank
    send_kept = lay.send_kept.view(world, local)
    slot_start = (send_kept.cumsum(1) - send_kept).reshape(-1)
    expert = handle.topk_idx.reshape(-1).clamp(0, world * local - 1)
    sent = lay.pair_row >= 0
    dest = lay.pair_rank.clamp(min=0)
    q = lay.pair_row - lay.send_base[expert] + slot_start[expert]
    own = sent & (dest == me)
    remote = sent & (dest != me)
    if peer_rows is not None:
        remote = remote & (q < peer_rows)
    row = send_base + _offsets(send_counts)[dest] + q
    pair_row = torch.where(remote, row, torch.where(own, lay.pair_row, -1))
    return pair_row, own.long()


def _arrival_rows(handle, ctx, recv_counts, arrival_rows, peer_rows):
    lay, me, world = handle.layout, ctx.rank, ctx.world_size
    recv_kept = lay.recv_kept  # [source, local expert]
    within = recv_kept.cumsum(1) - recv_kept
    starts = lay.recv_base.t().reshape(-1)  # blocks in receive order: local expert, then source
    r = torch.arange(ctx.capacity, device=starts.device)
    block = (torch.searchsorted(starts, r, right=True) - 1).clamp(min=0)
    src, expert = block % world, block // world
    q = within[src, expert] + r - starts[block]
    ok = (r < lay.tokens_per_expert.sum()) & (src != me)
    if peer_rows is not None:
        ok = ok & (q < peer_rows)
    arrival = _offsets(recv_counts)[src] + q
    out = torch.full((arrival_rows + 1,), -1, dtype=torch.int64, device=starts.device)
    out.scatter_(0, torch.where(ok, arrival, arrival_rows), r)
    return out[:arrival_rows]


def plan_exchange(handle, ctx, *, arrival_rows: int, peer_rows: Optional[int] = None,
                  peer_counts: Optional[torch.Tensor] = None) -> ExchangePlan:
    """The maps and splits of ``handle`` (see [Note: exchange layout]). ``arrival_rows``: A.
    ``peer_rows``: the fixed per-peer capacity, with ``peer_counts`` the [W] device tensor of
    it (0 for this rank), made once (no host value enters a capturable ``prepare``); None:
    exact counts, read on the host."""
    lay, me, world = handle.layout, ctx.rank, ctx.world_size
    not_me = torch.arange(world, device=lay.pair_row.device) != me
    send_exact = lay.send_kept.view(world, -1).sum(1) * not_me
    if peer_rows is None:
        recv_exact = lay.recv_kept.sum(1) * not_me
        send_list, recv_list = torch.stack([send_exact, recv_exact]).tolist()  # the one host sync of nccl
        send_counts, recv_counts = send_exact, recv_exact
    else:
        send_list = recv_list = [0 if d == me else peer_rows for d in range(world)]
        send_counts = recv_counts = peer_counts
    pair_row, pair_where = _pair_rows(handle, ctx, send_counts, arrival_rows, peer_rows)
    arrival = _arrival_rows(handle, ctx, recv_counts, arrival_rows, peer_rows)
    send_range = (arrival_rows, arrival_rows + sum(send_list))
    return ExchangePlan(pair_row, pair_where, arrival, send_list, recv_list, send_range, (0, sum(recv_list)),
                        send_exact.max())
