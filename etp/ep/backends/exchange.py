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

The exchange runs in ``chunks`` pieces (so that packing and unpacking one overlaps the
transfer of the next). Peer ``d``'s ``n_d`` rows are cut into chunks of ``ceil(n_d / chunks)``
and the buffer is chunk-major: chunk 0's rows to peer 0, 1, ..., then chunk 1's, so each
chunk is one contiguous ``all_to_all_single`` input and output. ``n_d`` is the exact count
(``nccl``: read on the host, one sync per ``prepare``) or a fixed per-peer capacity
(``nccl_padded``: equal static splits, no sync, rows past the capacity are not sent and are
reported by ``check()``).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

__all__ = ["ExchangePlan", "chunk_counts", "plan_exchange"]


class ExchangePlan(NamedTuple):
    """Maps of one handle (device tensors) and the exchange's split sizes (host ints).

    pair_row / pair_where: [T*K] int64: pair p's row is row ``pair_row[p]`` of the exchange
        buffer (``pair_where[p] == 0``) or of this rank's receive rows (``== 1``: its expert
        is local); ``pair_row[p] = -1``: the pair is not sent.
    arrival_row: [A] int64, the receive row of each arrival row (-1: padding).
    send_splits / recv_splits: per chunk, rows to / from each rank (0 for this rank).
    send_range / recv_range: per chunk, ``(first, end)`` rows of the exchange buffer.
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


def chunk_counts(counts, chunks: int):
    """``(per [chunks, W], size [W], offset [chunks, W])`` for per-peer row counts ``counts``:
    chunk c holds rows ``[c * size, ...)`` of each peer's slot, ``per[c, d]`` of them, at
    ``offset[c, d]`` (chunk-major). Works on int64 tensors and on lists of ints alike."""
    if isinstance(counts, torch.Tensor):
        size = (counts + chunks - 1) // chunks
        c = torch.arange(chunks, device=counts.device)[:, None]
        per = torch.minimum((counts[None, :] - c * size[None, :]).clamp(min=0), size[None, :])
        flat = per.reshape(-1)
        return per, size, (flat.cumsum(0) - flat).reshape(chunks, -1)
    size = [(n + chunks - 1) // chunks for n in counts]
    per = [[min(max(n - c * s, 0), s) for n, s in zip(counts, size)] for c in range(chunks)]
    offset, at = [], 0
    for row in per:
        offset.append([])
        for n in row:
            offset[-1].append(at)
            at += n
    return per, size, offset


def _host_splits(per_send, per_recv, off_send, off_recv, send_base: int):
    send_range = [(send_base + o[0], send_base + o[0] + sum(p)) for o, p in zip(off_send, per_send)]
    recv_range = [(o[0], o[0] + sum(p)) for o, p in zip(off_recv, per_recv)]
    return per_send, per_recv, send_range, recv_range


def _pair_rows(handle, ctx, send_counts, chunks, send_base, peer_rows):
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
    _, size, offset = chunk_counts(send_counts, chunks)
    size_d = size[dest].clamp(min=1)
    c = (q // size_d).clamp(0, chunks - 1)
    row = send_base + offset[c, dest] + q - c * size_d
    pair_row = torch.where(remote, row, torch.where(own, lay.pair_row, -1))
    return pair_row, own.long()


def _arrival_rows(handle, ctx, recv_counts, chunks, arrival_rows, peer_rows):
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
    _, size, offset = chunk_counts(recv_counts, chunks)
    size_s = size[src].clamp(min=1)
    c = (q // size_s).clamp(0, chunks - 1)
    arrival = offset[c, src] + q - c * size_s
    out = torch.full((arrival_rows + 1,), -1, dtype=torch.int64, device=starts.device)
    out.scatter_(0, torch.where(ok, arrival, arrival_rows), r)
    return out[:arrival_rows]


def plan_exchange(handle, ctx, *, chunks: int, arrival_rows: int, peer_rows: Optional[int] = None,
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
    per_s, _, off_s = chunk_counts(send_list, chunks)
    per_r, _, off_r = chunk_counts(recv_list, chunks)
    pair_row, pair_where = _pair_rows(handle, ctx, send_counts, chunks, arrival_rows, peer_rows)
    arrival = _arrival_rows(handle, ctx, recv_counts, chunks, arrival_rows, peer_rows)
    splits = _host_splits(per_s, per_r, off_s, off_r, arrival_rows)
    return ExchangePlan(pair_row, pair_where, arrival, *splits, send_exact.max())
