"""Triton kernels that move expert-parallel rows between ranks over symmetric memory.

Every kernel reads and writes through *pointer tables*: int64 device tensors holding the
address of the same buffer on every rank (``buffer_ptrs`` of a symmetric-memory handle,
or plain local addresses, which is how the CPU interpreter tests them). A kernel never
synchronizes with peers: the caller fences each phase with a symmetric-memory barrier.
The pure-torch references of ``etp.kernels.ep_reference`` define the results.

Notation: ``T`` tokens of this rank, ``K`` experts per token, ``H`` row width, pair
``p = t * K + k`` with ``pair_row[p]`` (-1: not sent) and ``pair_rank[p]``; ``T_max`` the
tokens slot of each source rank in a per-token buffer (slot ``s * T_max + t``).

[Note: row tiles]
A move of a few GB is bound by the bytes in flight, not by instructions: one 8 KB row per
loop iteration on 32 programs keeps ~256 KB in flight, ~150 GB/s at NVLink's latency. So
every kernel is persistent (``num_ctas`` programs, few SMs) and each program moves
``[ROWS, BLOCK_H]`` tiles, iterating over (row tile, column block) pairs in one flat loop
that Triton software-pipelines (``tl.range(num_stages=STAGES)``: on Hopper the loads of
the next ``STAGES - 1`` iterations are in flight as cp.async copies into shared memory,
address loads one stage earlier). A reduction issues the K loads of its tile
unconditionally, masked: a pair not taken loads nothing and adds 0, which leaves an fp32
sum that starts at +0 unchanged bit for bit, so the adds stay in k order while the loads
overlap. No load or store sits behind a data-dependent ``if``: masks only. Addresses come
from pointer tables, about which the compiler knows nothing: ``ALIGN`` tells it that rows
start 16-byte aligned, or it issues one 2-byte access per element.

[Note: peer order]
Over NVLink a store is posted (the program moves on) while a load waits a round trip, so a
move that writes to its peers keeps more bytes in flight per program than one that reads
from them: the combines therefore push (``local_reduce(push=True)``: each rank sums the rows
it holds per source token and writes one partial sum into the source's slot; the source
then reduces its slots locally) instead of pulling. A kernel that walks per-source slots
must also not walk them source by source: every program of every rank would write to (or
read from) rank 0 first, then rank 1, ..., so one peer's link carries all the traffic at a
time. The slot kernels therefore interleave the sources (iteration i takes rank
``me + 1 + i mod W``), so at any moment each rank's programs spread over all peers and
different ranks start at different peers.

[Note: own rows]
A de-duplicating dispatch pushes each token once per peer rank into a per-token slot there,
and each rank then expands the slots into its expert-sorted rows. This rank's own tokens need
no slot: ``push_rows(own=out)`` stores them straight into their final rows in the same loop
as the peer pushes, so those local stores run while the posted NVLink stores drain instead of
in the expansion after the barrier, which then skips them (``select_rows(kept_rows=...)``).

``rows`` (a power of two), ``num_warps`` and ``stages`` are launch parameters (the
``EPConfig`` fields ``tile_rows`` / ``num_warps`` / ``num_stages``). ``rows`` counts rows of
a copy; a reduction over K rows takes ``rows // K`` output rows and a push to K pairs
``rows // K`` input rows, so one setting moves about the same bytes per iteration everywhere
(default: ``_TILE_ELEMS`` elements, see ``tile_rows``); ``stages`` is lowered to what fits in
shared memory.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from etp.kernels.ep_tiles import (
    DEFAULT_NUM_WARPS,
    DEFAULT_STAGES,
    grid,
    pipeline_stages,
    row_align,
    row_block,
    tile_rows,
)
from etp.kernels.launch import launch

__all__ = ["push_rows", "pull_reduce", "pull_pairs", "select_rows", "gather_tokens", "local_reduce",
           "push_meta", "zero_tail", "slot_table"]

# Modes of _push_kernel's x rows.
X_NONE, X_ROWS, X_DEDUP = 0, 1, 2
# Pairs per iteration of the per-pair (index and scalar) kernels.
_PAIR_BLOCK = 1024


@triton.jit
def _first_of_rank(send, d, seen):
    """``(send and the token sent nothing to rank d before, seen | d's bit)``: ``seen`` holds
    one bit per rank a token's earlier pairs went to (hence at most 64 ranks), so the first
    pair to each rank carries the token's one copy there."""
    bit = tl.where(send, tl.full(d.shape, 1, tl.int64) << tl.where(send, d, 0), 0)
    return send & ((seen & bit) == 0), seen | bit


@triton.jit
def _token_tile(it, n_h, T, H, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """Loop iteration ``it`` of a [ROWS tokens, BLOCK_H columns] tiling with ``n_h`` column
    blocks per row: the tokens (int64), the columns, and which of each are in range."""
    t = (it // n_h) * ROWS + tl.arange(0, ROWS)
    h = (it % n_h) * BLOCK_H + tl.arange(0, BLOCK_H)
    return t.to(tl.int64), h, t < T, h < H


@triton.jit
def _push_kernel(x_ptr, w_ptr, row_ptr, rank_ptr, x_table, w_table, own_ptr, T, H, me, T_max,
                 K: tl.constexpr, X_MODE: tl.constexpr, HAS_W: tl.constexpr, OWN: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr, ALIGN: tl.constexpr,
                 STAGES: tl.constexpr):
    """X_ROWS: ``x_table[d][pair_row[p]] = x[t]``; X_DEDUP: ``x_table[d][me*T_max + t] = x[t]``
    once per destination d of token t (OWN: not for d = me, but ``own[pair_row[p]] = x[t]`` for
    each pair to d = me, its final row here); HAS_W:
    ``w_table[d][pair_row[p]] = w[p]``. A tile of ROWS tokens is read once and stored K times."""
    n_h = tl.cdiv(H, BLOCK_H) if X_MODE != 0 else 1
    for it in tl.range(tl.program_id(0), tl.cdiv(T, ROWS) * n_h, tl.num_programs(0), num_stages=STAGES):
        t64, h, live, hmask = _token_tile(it, n_h, T, H, ROWS, BLOCK_H)
        pair0 = t64 * K
        if HAS_W:
            if it % n_h == 0:  # a tile's weights go with its first column block (uniform branch)
                for k in tl.static_range(K):
                    row = tl.load(row_ptr + pair0 + k, mask=live, other=-1)
                    d = tl.load(rank_ptr + pair0 + k, mask=live, other=0)
                    sent = row >= 0
                    dst_w = tl.load(w_table + tl.where(sent, d, 0)).to(tl.pointer_type(w_ptr.dtype.element_ty))
                    tl.store(dst_w + tl.where(sent, row, 0), tl.load(w_ptr + pair0 + k, mask=sent), mask=sent)
        if X_MODE != 0:
            vals = tl.load(x_ptr + (t64 * H)[:, None] + h[None, :], mask=live[:, None] & hmask[None, :])
            seen = tl.zeros([ROWS], tl.int64)
            for k in tl.static_range(K):
                row = tl.load(row_ptr + pair0 + k, mask=live, other=-1)
                d = tl.load(rank_ptr + pair0 + k, mask=live, other=0)
                send = row >= 0
                if X_MODE == 2:
                    if OWN:  # local stores beside the posted peer stores: see [Note: own rows]
                        mine = send & (d == me)
                        dst_own = tl.multiple_of(own_ptr + tl.where(mine, row, 0) * H, ALIGN)
                        tl.store(dst_own[:, None] + h[None, :], vals, mask=mine[:, None] & hmask[None, :])
                    send, seen = _first_of_rank(send, d, seen)
                    if OWN:
                        send = send & (d != me)
                    row = t64 + me * T_max
                dst = tl.load(x_table + tl.where(send, d, 0)).to(tl.pointer_type(x_ptr.dtype.element_ty))
                dst = tl.multiple_of(dst + tl.where(send, row, 0) * H, ALIGN)
                tl.store(dst[:, None] + h[None, :], vals, mask=send[:, None] & hmask[None, :])


@triton.jit
def _pull_reduce_kernel(table, row_ptr, rank_ptr, out_ptr, T, H,
                        K: tl.constexpr, DEDUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                        ALIGN: tl.constexpr, STAGES: tl.constexpr):
    """``out[t] = sum_k src_d[row]`` over sent pairs, accumulated in fp32 in k order (the
    K loads of a tile are issued together; the adds stay in k order: bit-identical to
    ``sum_pairs``). DEDUP: ``src_d[t]`` once per destination rank d (the partial sum d pushed
    into this rank's block d, see ``slot_table``), in the order of each rank's first pair."""
    n_h = tl.cdiv(H, BLOCK_H)
    for it in tl.range(tl.program_id(0), tl.cdiv(T, ROWS) * n_h, tl.num_programs(0), num_stages=STAGES):
        t64, h, live, hmask = _token_tile(it, n_h, T, H, ROWS, BLOCK_H)
        pair0 = t64 * K
        acc = tl.zeros([ROWS, BLOCK_H], dtype=tl.float32)
        seen = tl.zeros([ROWS], tl.int64)
        for k in tl.static_range(K):
            row = tl.load(row_ptr + pair0 + k, mask=live, other=-1)
            d = tl.load(rank_ptr + pair0 + k, mask=live, other=0)
            take = row >= 0
            if DEDUP:
                take, seen = _first_of_rank(take, d, seen)
                row = t64
            src = tl.load(table + tl.where(take, d, 0)).to(tl.pointer_type(out_ptr.dtype.element_ty))
            src = tl.multiple_of(src + tl.where(take, row, 0) * H, ALIGN)
            acc += tl.load(src[:, None] + h[None, :], mask=take[:, None] & hmask[None, :], other=0.0).to(tl.float32)
        tl.store(out_ptr + (t64 * H)[:, None] + h[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=live[:, None] & hmask[None, :])


@triton.jit
def _pull_pairs_kernel(table, row_ptr, rank_ptr, out_ptr, N, BLOCK: tl.constexpr):
    """``out[p] = src_{pair_rank[p]}[pair_row[p]]``, 0 for pairs not sent."""
    for start in range(tl.program_id(0) * BLOCK, N, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < N
        row = tl.load(row_ptr + offs, mask=mask, other=-1)
        d = tl.load(rank_ptr + offs, mask=mask, other=0)
        sent = row >= 0
        src = tl.load(table + tl.where(sent, d, 0), mask=mask, other=0).to(tl.pointer_type(out_ptr.dtype.element_ty))
        vals = tl.load(src + tl.where(sent, row, 0), mask=mask & sent, other=0.0)
        tl.store(out_ptr + offs, vals, mask=mask)


@triton.jit
def _select_kernel(src_ptr, map_ptr, local_ptr, out_ptr, tpe_ptr, totals_ptr, H, local_first, local_rows,
                   E_LOCAL: tl.constexpr, E_PAD: tl.constexpr, IDENTITY: tl.constexpr, ZERO_ONLY: tl.constexpr,
                   HAS_LOCAL: tl.constexpr, KEEP_LOCAL: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                   STAGES: tl.constexpr):
    """``out[r] = src[map[r]]`` (IDENTITY: ``src[r]``; HAS_LOCAL: ``local[map[r] - local_first]``
    where ``map[r] - local_first`` lies in ``[0, local_rows)``, KEEP_LOCAL: those rows left as
    they are; 0 where ``map[r] < 0``) for r < sum(tokens_per_expert),
    skipped with ZERO_ONLY; rows in ``[that, totals[0])`` are zeroed (they held the previous
    step's rows). Program 0 stores the new total in ``totals[1]`` (every program reads
    ``totals[0]``, so it cannot be overwritten here; the launcher copies [1] to [0] after)."""
    e = tl.arange(0, E_PAD)
    total = tl.sum(tl.load(tpe_ptr + e, mask=e < E_LOCAL, other=0), axis=0)
    prev = tl.load(totals_ptr)
    if tl.program_id(0) == 0:
        tl.store(totals_ptr + 1, total)
    end = tl.maximum(total, prev)
    first = total if ZERO_ONLY else 0
    cols = tl.arange(0, BLOCK_H)
    n_h = tl.cdiv(H, BLOCK_H)
    for it in tl.range(tl.program_id(0), tl.cdiv(end - first, ROWS) * n_h, tl.num_programs(0), num_stages=STAGES):
        r = first + (it // n_h) * ROWS + tl.arange(0, ROWS)
        h = (it % n_h) * BLOCK_H + cols
        hmask = h < H
        r64 = r.to(tl.int64)
        keep = r < end
        if ZERO_ONLY:
            vals = tl.zeros([ROWS, BLOCK_H], out_ptr.dtype.element_ty)
        else:
            copy = r < total
            if IDENTITY:
                q = r64
            else:
                q = tl.load(map_ptr + r64, mask=copy, other=0)
                copy = copy & (q >= 0)  # a row nothing arrived for (-1) is zeroed
            ptrs = src_ptr + (tl.where(copy, q, 0) * H)[:, None] + h[None, :]
            if HAS_LOCAL:
                # This rank's own tokens never went through src: read them where they are
                # (one load of either address, so one tile of shared memory per stage).
                mine = (q >= local_first) & (q < local_first + local_rows)
                own = local_ptr + (tl.where(copy & mine, q - local_first, 0) * H)[:, None] + h[None, :]
                ptrs = tl.where(mine[:, None], own, ptrs)
            if KEEP_LOCAL:  # push_rows(own=out) wrote them already
                kept = (q >= local_first) & (q < local_first + local_rows)
                copy = copy & ~kept
                keep = keep & ~(kept & (r < total))
            vals = tl.load(ptrs, mask=copy[:, None] & hmask[None, :], other=0.0)
        tl.store(out_ptr + (r64 * H)[:, None] + h[None, :], vals, mask=keep[:, None] & hmask[None, :])


@triton.jit
def _slot_tile(it, n_h, W, T_max, tokens_ptr, me, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """Loop iteration ``it`` over the W * T_max per-token slots (``n_h`` column blocks per
    slot, tiles of ROWS tokens of one source rank): the slots, the columns, the tile's
    source rank s (a scalar), the tokens, and whether each token exists (``t < tokens[s]``).
    Consecutive iterations take ranks ``me + 1, me + 2, ...`` in turn (see [Note: peer order])."""
    rest = it // n_h
    s = (me + 1 + rest % W) % W
    tile = rest // W
    t = tile * ROWS + tl.arange(0, ROWS)
    h = (it % n_h) * BLOCK_H + tl.arange(0, BLOCK_H)
    q = s * T_max + t
    return q, h, s, t, (t < T_max) & (t < tl.load(tokens_ptr + s))


@triton.jit
def _gather_tokens_kernel(table, tokens_ptr, out_ptr, W, T_max, H, skip, ROWS: tl.constexpr,
                          BLOCK_H: tl.constexpr, ALIGN: tl.constexpr, STAGES: tl.constexpr):
    """``out[s*T_max + t] = src_s[t]`` for every rank s != skip and t < tokens[s]."""
    n_h = tl.cdiv(H, BLOCK_H)
    for it in tl.range(tl.program_id(0), W * tl.cdiv(T_max, ROWS) * n_h, tl.num_programs(0), num_stages=STAGES):
        q, h, s, t, live = _slot_tile(it, n_h, W, T_max, tokens_ptr, skip, ROWS, BLOCK_H)
        live = live & ((t * 0 + s) != skip)  # a vector compare: the interpreter masks with vectors only
        src = tl.load(table + s).to(tl.pointer_type(out_ptr.dtype.element_ty))
        src = tl.multiple_of(src + tl.where(live, t, 0).to(tl.int64) * H, ALIGN)
        mask = live[:, None] & (h < H)[None, :]
        vals = tl.load(src[:, None] + h[None, :], mask=mask)
        tl.store(out_ptr + (q.to(tl.int64) * H)[:, None] + h[None, :], vals, mask=mask)


@triton.jit
def _local_reduce_kernel(y_ptr, red_ptr, tokens_ptr, out_table, W, T_max, H, me, K: tl.constexpr,
                         ROWS: tl.constexpr, BLOCK_H: tl.constexpr, ALIGN: tl.constexpr, STAGES: tl.constexpr):
    """For slots q = s*T_max + t, t < tokens[s], that have at least one row here: rank s's
    slot ``me*T_max + t`` (``out_table`` holds the ranks' buffers) gets ``sum_k y[red[q, k]]``
    (red >= 0, k order, fp32; the K loads of a tile issued together); other slots are left as
    they are. The local reads and one remote write per token of a combine that pushes (see
    [Note: peer order])."""
    n_h = tl.cdiv(H, BLOCK_H)
    for it in tl.range(tl.program_id(0), W * tl.cdiv(T_max, ROWS) * n_h, tl.num_programs(0), num_stages=STAGES):
        q, h, s, t, live = _slot_tile(it, n_h, W, T_max, tokens_ptr, me, ROWS, BLOCK_H)
        hmask = h < H
        q64 = q.to(tl.int64)
        acc = tl.zeros([ROWS, BLOCK_H], dtype=tl.float32)
        found = q < 0  # no row yet
        for k in tl.static_range(K):
            row = tl.load(red_ptr + q64 * K + k, mask=live, other=-1)
            take = row >= 0
            found = found | take
            offs = (tl.where(take, row, 0) * H)[:, None] + h[None, :]
            acc += tl.load(y_ptr + offs, mask=take[:, None] & hmask[None, :], other=0.0).to(tl.float32)
        dst = tl.load(out_table + s).to(tl.pointer_type(y_ptr.dtype.element_ty))
        dst = tl.multiple_of(dst + (me * T_max + t.to(tl.int64)) * H, ALIGN)
        tl.store(dst[:, None] + h[None, :], acc.to(y_ptr.dtype.element_ty), mask=found[:, None] & hmask[None, :])


@triton.jit
def _push_meta_kernel(row_ptr, rank_ptr, map_table, red_table, N, W, me, T_max, K: tl.constexpr, BLOCK: tl.constexpr):
    """For every rank d: ``red_d[me*T_max*K + p] = pair_row[p]`` if pair p goes to d else -1;
    and ``map_d[pair_row[p]] = me*T_max + p // K`` for the pairs going to d."""
    for start in range(tl.program_id(0) * BLOCK, N, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < N
        row = tl.load(row_ptr + offs, mask=mask, other=-1)
        dest = tl.load(rank_ptr + offs, mask=mask, other=-1)
        for d in range(W):
            red = tl.load(red_table + d).to(tl.pointer_type(tl.int64))
            tl.store(red + me * T_max * K + offs, tl.where((dest == d) & (row >= 0), row, -1), mask=mask)
            srcmap = tl.load(map_table + d).to(tl.pointer_type(tl.int64))
            go = mask & (dest == d) & (row >= 0)
            tl.store(srcmap + tl.where(go, row, 0), me * T_max + offs // K, mask=go)


# ------------------------------------------------------------------ launchers
# Every row launcher takes ``num_ctas`` (programs), ``rows`` (ROWS of a tile, None: see
# tile_rows), ``num_warps`` and ``stages``; see [Note: row tiles].
def _check_dedup_world(table) -> None:
    # _first_of_rank keeps one bit per rank in an int64.
    if table.numel() > 64:
        raise ValueError(f"the rank de-duplicated moves (symm_dedup, symm_allgather) take at most 64 ranks, got "
                         f"{table.numel()}; use symm_push")


def push_rows(x, w, pair_row, pair_rank, x_table, w_table, *, mode: int, me: int = 0, t_max: int = 0,
              own=None, num_ctas: int = 32, rows=None, num_warps: int = DEFAULT_NUM_WARPS,
              stages: int = DEFAULT_STAGES) -> None:
    """Writes x rows (``mode``: X_NONE / X_ROWS / X_DEDUP) and, if ``w`` is given, routing
    weights into the peers' buffers named by the tables. ``own`` (X_DEDUP, local ``[rows, H]``):
    this rank's own slot is left out, each pair to this rank writing its token straight into
    ``own[pair_row]`` instead ([Note: own rows]). See ``_push_kernel``."""
    tokens, H = x.shape
    if tokens == 0:
        return
    if own is not None and (mode != X_DEDUP or own.dtype != x.dtype or own.dim() != 2 or own.shape[1] != H):
        raise ValueError(f"push_rows: own must be a [rows, {H}] {x.dtype} tensor with mode=X_DEDUP, got "
                         f"{own.dtype} {tuple(own.shape)} with mode {mode}")
    K = pair_row.numel() // tokens
    x_table = x_table if x_table is not None else w_table
    if mode == X_DEDUP:
        _check_dedup_world(x_table)
    ROWS = tile_rows(rows, H, K)
    launch(_push_kernel, grid(num_ctas), x, w if w is not None else x, pair_row, pair_rank, x_table,
           w_table if w_table is not None else x_table, own if own is not None else x, tokens, H, me, t_max,
           K=K, X_MODE=mode, HAS_W=w is not None, OWN=own is not None, ROWS=ROWS,
           BLOCK_H=row_block(H), ALIGN=row_align(x),
           STAGES=pipeline_stages(stages, ROWS, H, x.element_size()), num_warps=num_warps)


def pull_reduce(table, pair_row, pair_rank, out, *, dedup: bool = False,
                num_ctas: int = 32, rows=None, num_warps: int = DEFAULT_NUM_WARPS,
                stages: int = DEFAULT_STAGES) -> None:
    """``out [T, H]``: each token's sum of its pairs' rows pulled from the peers."""
    tokens, H = out.shape
    if tokens == 0:
        return
    K = pair_row.numel() // tokens
    if dedup:
        _check_dedup_world(table)
    ROWS = tile_rows(rows, H, K)
    launch(_pull_reduce_kernel, grid(num_ctas), table, pair_row, pair_rank, out, tokens, H, K=K, DEDUP=dedup,
           ROWS=ROWS, BLOCK_H=row_block(H), ALIGN=row_align(out),
           STAGES=pipeline_stages(stages, ROWS, H, out.element_size(), K),
           num_warps=num_warps)


def pull_pairs(table, pair_row, pair_rank, out, *, num_ctas: int = 32, rows=None,
               num_warps: int = DEFAULT_NUM_WARPS, stages: int = DEFAULT_STAGES) -> None:
    """``out [T*K]``: each pair's scalar pulled from its destination (``rows`` and ``stages``
    are ignored: these are scalars, ``_PAIR_BLOCK`` per iteration)."""
    if out.numel():
        launch(_pull_pairs_kernel, grid(num_ctas), table, pair_row, pair_rank, out, out.numel(), BLOCK=_PAIR_BLOCK,
               num_warps=num_warps)


def select_rows(src, src_map, out, tokens_per_expert, totals, *, identity: bool = False,
                zero_only: bool = False, local=None, local_first: int = 0, kept_rows: int = 0,
                num_ctas: int = 32, rows=None, num_warps: int = DEFAULT_NUM_WARPS,
                stages: int = DEFAULT_STAGES) -> None:
    """``out[r] = src[src_map[r]]`` for the valid rows, zero for the rest of the previous
    valid rows. With ``local`` ([L, H]): rows whose ``src_map`` value lies in
    ``[local_first, local_first + L)`` come from ``local[src_map[r] - local_first]`` instead
    (this rank's own tokens, which need not be copied into ``src`` first). With ``kept_rows``
    (no ``local``): rows whose value lies in ``[local_first, local_first + kept_rows)`` are left
    as they are (``push_rows(own=out)`` wrote this rank's own tokens there already).

    ``totals`` (int64 [2], on device, one per ``out``) carries the row count across calls:
    ``totals[0]`` is read as the previous call's valid rows and holds this call's afterwards
    (``totals[1]`` is scratch). All of it stays on device, stream-ordered: no host value
    changes between calls, so a CUDA graph replays exactly what eager runs (see
    [Note: graph-safe moves] in ``etp.ep.backends.symm``), and nothing is allocated.
    """
    if totals.dtype != torch.int64 or totals.numel() != 2 or not totals.is_contiguous():
        raise ValueError(f"totals: expected a contiguous int64 [2] tensor, got {totals.dtype} {tuple(totals.shape)}")
    if kept_rows and (local is not None or identity or src_map is None):
        raise ValueError("select_rows: kept_rows needs a src_map and no local / identity")
    n_local = tokens_per_expert.numel()
    H = out.shape[1]
    ROWS = tile_rows(rows, H)
    launch(_select_kernel, grid(num_ctas), src, src_map if src_map is not None else totals,
           local if local is not None else src, out, tokens_per_expert, totals, H,
           local_first, local.shape[0] if local is not None else kept_rows,
           E_LOCAL=n_local, E_PAD=triton.next_power_of_2(n_local), IDENTITY=identity,
           ZERO_ONLY=zero_only, HAS_LOCAL=local is not None, KEEP_LOCAL=kept_rows > 0, ROWS=ROWS,
           BLOCK_H=row_block(H),
           STAGES=pipeline_stages(stages, ROWS, H, out.element_size()), num_warps=num_warps)
    totals[0:1].copy_(totals[1:2])


def gather_tokens(table, tokens, out, t_max: int, *, skip: int = -1, num_ctas: int = 32,
                  rows=None, num_warps: int = DEFAULT_NUM_WARPS, stages: int = DEFAULT_STAGES) -> None:
    """``out [W*T_max, H]``: every rank's token rows (all-gather), but rank ``skip``'s, the
    peers in turn from ``skip + 1`` (see [Note: peer order])."""
    H = out.shape[1]
    ROWS = tile_rows(rows, H)
    launch(_gather_tokens_kernel, grid(num_ctas), table, tokens, out, tokens.numel(), t_max, H, skip,
           ROWS=ROWS, BLOCK_H=row_block(H), ALIGN=row_align(out),
           STAGES=pipeline_stages(stages, ROWS, H, out.element_size()), num_warps=num_warps)


def local_reduce(y, red, tokens, out_table, t_max: int, *, me: int = 0, num_ctas: int = 32, rows=None,
                 num_warps: int = DEFAULT_NUM_WARPS, stages: int = DEFAULT_STAGES) -> None:
    """Per source token, the sum of its rows held here, pushed into the source:
    ``out_table`` is the pointer table of the sources' ``[W*T_max, H]`` buffers and the sum of
    source s's token t goes to rank s's slot ``me*T_max + t``, the sources in turn from
    ``me + 1`` (see [Note: peer order])."""
    H, K = y.shape[1], red.shape[-1]
    ROWS = tile_rows(rows, H, K)
    launch(_local_reduce_kernel, grid(num_ctas), y, red, tokens, out_table, tokens.numel(), t_max, H, me, K=K,
           ROWS=ROWS, BLOCK_H=row_block(H), ALIGN=row_align(y),
           STAGES=pipeline_stages(stages, ROWS, H, y.element_size(), K), num_warps=num_warps)


def slot_table(buffer: torch.Tensor, world: int) -> torch.Tensor:
    """Pointer table of the W ``[T_max, H]`` slot blocks of one local ``[W*T_max, H]`` buffer:
    ``pull_reduce(slot_table(buf, W), ..., dedup=True)`` then reads ``buf[d*T_max + t]`` for
    each destination rank d of token t (the partial sums that rank d pushed here), each token's
    once per rank in the order of its first pair to each."""
    step = buffer.shape[0] // world * buffer.stride(0) * buffer.element_size()
    return torch.tensor([buffer.data_ptr() + d * step for d in range(world)], dtype=torch.int64,
                        device=buffer.device)


def push_meta(pair_row, pair_rank, map_table, red_table, world: int, me: int, t_max: int, topk: int, *,
              num_ctas: int = 32, rows=None, num_warps: int = DEFAULT_NUM_WARPS, stages: int = DEFAULT_STAGES) -> None:
    """Tells every peer which of its rows came from which of this rank's tokens (``rows``
    and ``stages`` are ignored: ``_PAIR_BLOCK`` pairs per iteration)."""
    if pair_row.numel():
        launch(_push_meta_kernel, grid(num_ctas), pair_row, pair_rank, map_table, red_table, pair_row.numel(), world, me,
               t_max, K=topk, BLOCK=_PAIR_BLOCK, num_warps=num_warps)


def zero_tail(out, tokens_per_expert, totals, **launch) -> None:
    """Zeroes rows ``[sum(tokens_per_expert), totals[0])`` of ``out`` (rows below are kept);
    ``totals`` as in ``select_rows``; ``launch``: num_ctas / rows / num_warps / stages."""
    select_rows(out, None, out, tokens_per_expert, totals, identity=True, zero_only=True, **launch)


def table_of(tensors: list[torch.Tensor], device) -> torch.Tensor:
    """Pointer table of same-shaped local tensors (the CPU stand-in for symmetric memory)."""
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=device)
