"""Triton kernels that move expert-parallel rows between ranks over symmetric memory.

Every kernel reads and writes through *pointer tables*: int64 device tensors holding the
address of the same buffer on every rank (``buffer_ptrs`` of a symmetric-memory handle,
or plain local addresses, which is how the CPU interpreter tests them). A kernel never
synchronizes with peers: the caller fences each phase with a symmetric-memory barrier.
All kernels are persistent (``num_ctas`` programs loop over their rows) so a transfer can
take few SMs. The pure-torch references of ``etp.kernels.ep_reference`` define the result.

Notation: ``T`` tokens of this rank, ``K`` experts per token, ``H`` row width, pair
``p = t * K + k`` with ``pair_row[p]`` (-1: not sent) and ``pair_rank[p]``; ``T_max`` the
tokens slot of each source rank in a per-token buffer (slot ``s * T_max + t``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["push_rows", "pull_reduce", "pull_pairs", "select_rows", "gather_tokens", "local_reduce",
           "push_meta", "zero_tail"]

# Modes of _push_kernel's x rows.
X_NONE, X_ROWS, X_DEDUP = 0, 1, 2


def _block(h: int) -> int:
    return min(4096, triton.next_power_of_2(max(h, 16)))


@triton.jit
def _push_kernel(x_ptr, w_ptr, row_ptr, rank_ptr, x_table, w_table, T, H, me, T_max,
                 K: tl.constexpr, X_MODE: tl.constexpr, HAS_W: tl.constexpr, BLOCK_H: tl.constexpr):
    """X_ROWS: ``x_table[d][pair_row[p]] = x[t]``; X_DEDUP: ``x_table[d][me*T_max + t] = x[t]``
    once per destination d of token t; HAS_W: ``w_table[d][pair_row[p]] = w[p]``."""
    offs = tl.arange(0, BLOCK_H)
    for t in range(tl.program_id(0), T, tl.num_programs(0)):
        if HAS_W:
            for k in tl.static_range(K):
                row = tl.load(row_ptr + t * K + k)
                if row >= 0:
                    d = tl.load(rank_ptr + t * K + k)
                    dst_w = tl.load(w_table + d).to(tl.pointer_type(w_ptr.dtype.element_ty))
                    tl.store(dst_w + row, tl.load(w_ptr + t * K + k))
        if X_MODE != 0:
            for h0 in range(0, H, BLOCK_H):
                mask = h0 + offs < H
                vals = tl.load(x_ptr + tl.cast(t, tl.int64) * H + h0 + offs, mask=mask)
                for k in tl.static_range(K):
                    row = tl.load(row_ptr + t * K + k)
                    d = tl.load(rank_ptr + t * K + k)
                    send = row >= 0
                    if X_MODE == 2:
                        # One copy per destination rank: only the first pair of t going to d.
                        for k2 in tl.static_range(k):
                            r2 = tl.load(row_ptr + t * K + k2)
                            d2 = tl.load(rank_ptr + t * K + k2)
                            send = send & ((r2 < 0) | (d2 != d))
                        row = tl.cast(me * T_max + t, tl.int64)
                    if send:
                        dst = tl.load(x_table + d).to(tl.pointer_type(x_ptr.dtype.element_ty))
                        tl.store(dst + row * H + h0 + offs, vals, mask=mask)


@triton.jit
def _pull_reduce_kernel(table, row_ptr, rank_ptr, out_ptr, T, H, me, T_max,
                        K: tl.constexpr, DEDUP: tl.constexpr, BLOCK_H: tl.constexpr):
    """``out[t] = sum_k src_d[row]`` over sent pairs in k order, fp32 accumulation. DEDUP:
    ``src_d[me*T_max + t]`` once per destination rank d (its partial sum)."""
    offs = tl.arange(0, BLOCK_H)
    for t in range(tl.program_id(0), T, tl.num_programs(0)):
        for h0 in range(0, H, BLOCK_H):
            mask = h0 + offs < H
            acc = tl.zeros([BLOCK_H], dtype=tl.float32)
            for k in tl.static_range(K):
                row = tl.load(row_ptr + t * K + k)
                d = tl.load(rank_ptr + t * K + k)
                take = row >= 0
                if DEDUP:
                    for k2 in tl.static_range(k):
                        r2 = tl.load(row_ptr + t * K + k2)
                        d2 = tl.load(rank_ptr + t * K + k2)
                        take = take & ((r2 < 0) | (d2 != d))
                    row = tl.cast(me * T_max + t, tl.int64)
                if take:
                    src = tl.load(table + d).to(tl.pointer_type(out_ptr.dtype.element_ty))
                    acc += tl.load(src + row * H + h0 + offs, mask=mask).to(tl.float32)
            tl.store(out_ptr + tl.cast(t, tl.int64) * H + h0 + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


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
def _select_kernel(src_ptr, map_ptr, out_ptr, tpe_ptr, totals_ptr, H, E_LOCAL: tl.constexpr,
                   E_PAD: tl.constexpr, BLOCK_H: tl.constexpr, IDENTITY: tl.constexpr, ZERO_ONLY: tl.constexpr):
    """``out[r] = src[map[r]]`` (IDENTITY: ``src[r]``) for r < sum(tokens_per_expert), skipped
    with ZERO_ONLY; rows in ``[that, totals[0])`` are zeroed (they held the previous step's
    rows). Program 0 stores the new total in ``totals[1]`` (every program reads ``totals[0]``,
    so it cannot be overwritten here; the launcher copies [1] to [0] after the kernel)."""
    e = tl.arange(0, E_PAD)
    total = tl.sum(tl.load(tpe_ptr + e, mask=e < E_LOCAL, other=0), axis=0)
    prev = tl.load(totals_ptr)
    if tl.program_id(0) == 0:
        tl.store(totals_ptr + 1, total)
    end = tl.maximum(total, prev)
    offs = tl.arange(0, BLOCK_H)
    first = tl.program_id(0)
    if ZERO_ONLY:
        first += total
    for r in range(first, end, tl.num_programs(0)):
        r64 = tl.cast(r, tl.int64)
        if r < total:
            if IDENTITY:
                q = r64
            else:
                q = tl.load(map_ptr + r)
            for h0 in range(0, H, BLOCK_H):
                mask = h0 + offs < H
                tl.store(out_ptr + r64 * H + h0 + offs, tl.load(src_ptr + q * H + h0 + offs, mask=mask), mask=mask)
        else:
            for h0 in range(0, H, BLOCK_H):
                mask = h0 + offs < H
                tl.store(out_ptr + r64 * H + h0 + offs, tl.zeros([BLOCK_H], out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gather_tokens_kernel(table, tokens_ptr, out_ptr, W, T_max, H, BLOCK_H: tl.constexpr):
    """``out[s*T_max + t] = src_s[t]`` for every rank s and t < tokens[s]."""
    offs = tl.arange(0, BLOCK_H)
    for q in range(tl.program_id(0), W * T_max, tl.num_programs(0)):
        s = q // T_max
        t = q % T_max
        if t < tl.load(tokens_ptr + s):
            src = tl.load(table + s).to(tl.pointer_type(out_ptr.dtype.element_ty))
            for h0 in range(0, H, BLOCK_H):
                mask = h0 + offs < H
                tl.store(out_ptr + tl.cast(q, tl.int64) * H + h0 + offs,
                         tl.load(src + tl.cast(t, tl.int64) * H + h0 + offs, mask=mask), mask=mask)


@triton.jit
def _local_reduce_kernel(y_ptr, red_ptr, tokens_ptr, out_ptr, W, T_max, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
    """``out[q] = sum_k y[red[q, k]]`` (red >= 0, k order, fp32) for slots q = s*T_max + t,
    t < tokens[s], that have at least one row here; other slots are left as they are."""
    offs = tl.arange(0, BLOCK_H)
    for q in range(tl.program_id(0), W * T_max, tl.num_programs(0)):
        s = q // T_max
        t = q % T_max
        if t < tl.load(tokens_ptr + s):
            any_row = tl.load(red_ptr + tl.cast(q, tl.int64) * K) >= 0
            for k in tl.static_range(1, K):
                any_row = any_row | (tl.load(red_ptr + tl.cast(q, tl.int64) * K + k) >= 0)
            if any_row:
                for h0 in range(0, H, BLOCK_H):
                    mask = h0 + offs < H
                    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
                    for k in tl.static_range(K):
                        row = tl.load(red_ptr + tl.cast(q, tl.int64) * K + k)
                        if row >= 0:
                            acc += tl.load(y_ptr + row * H + h0 + offs, mask=mask).to(tl.float32)
                    tl.store(out_ptr + tl.cast(q, tl.int64) * H + h0 + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


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
def _grid(num_ctas: int):
    return (max(1, num_ctas),)


def push_rows(x, w, pair_row, pair_rank, x_table, w_table, *, mode: int, me: int = 0, t_max: int = 0,
              num_ctas: int = 32) -> None:
    """Writes x rows (``mode``: X_NONE / X_ROWS / X_DEDUP) and, if ``w`` is given, routing
    weights into the peers' buffers named by the tables. See ``_push_kernel``."""
    tokens = x.shape[0]
    K = pair_row.numel() // tokens if tokens else 1
    H = x.shape[1]
    if tokens == 0:
        return
    x_table = x_table if x_table is not None else w_table
    _push_kernel[_grid(num_ctas)](x, w if w is not None else x, pair_row, pair_rank, x_table,
                                  w_table if w_table is not None else x_table, tokens, H, me, t_max,
                                  K=K, X_MODE=mode, HAS_W=w is not None, BLOCK_H=_block(H))


def pull_reduce(table, pair_row, pair_rank, out, *, dedup: bool = False, me: int = 0, t_max: int = 0,
                num_ctas: int = 32) -> None:
    """``out [T, H]``: each token's sum of its pairs' rows pulled from the peers."""
    tokens, H = out.shape
    if tokens == 0:
        return
    _pull_reduce_kernel[_grid(num_ctas)](table, pair_row, pair_rank, out, tokens, H, me, t_max,
                                         K=pair_row.numel() // tokens, DEDUP=dedup, BLOCK_H=_block(H))


def pull_pairs(table, pair_row, pair_rank, out, *, num_ctas: int = 32) -> None:
    """``out [T*K]``: each pair's scalar pulled from its destination."""
    if out.numel():
        _pull_pairs_kernel[_grid(num_ctas)](table, pair_row, pair_rank, out, out.numel(), BLOCK=256)


def select_rows(src, src_map, out, tokens_per_expert, totals, *, identity: bool = False,
                zero_only: bool = False, num_ctas: int = 32) -> None:
    """``out[r] = src[src_map[r]]`` for the valid rows, zero for the rest of the previous
    valid rows.

    ``totals`` (int64 [2], on device, one per ``out``) carries the row count across calls:
    ``totals[0]`` is read as the previous call's valid rows and holds this call's afterwards
    (``totals[1]`` is scratch). All of it stays on device, stream-ordered: no host value
    changes between calls, so a CUDA graph replays exactly what eager runs (see
    [Note: graph-safe moves] in ``etp.ep.backends.symm``), and nothing is allocated.
    """
    if totals.dtype != torch.int64 or totals.numel() != 2 or not totals.is_contiguous():
        raise ValueError(f"totals: expected a contiguous int64 [2] tensor, got {totals.dtype} {tuple(totals.shape)}")
    local = tokens_per_expert.numel()
    _select_kernel[_grid(num_ctas)](src, src_map if src_map is not None else totals, out, tokens_per_expert,
                                    totals, out.shape[1], E_LOCAL=local, E_PAD=triton.next_power_of_2(local),
                                    BLOCK_H=_block(out.shape[1]), IDENTITY=identity,
                                    ZERO_ONLY=zero_only)
    totals[0:1].copy_(totals[1:2])


def gather_tokens(table, tokens, out, t_max: int, *, num_ctas: int = 32) -> None:
    """``out [W*T_max, H]``: every rank's token rows (all-gather)."""
    _gather_tokens_kernel[_grid(num_ctas)](table, tokens, out, tokens.numel(), t_max, out.shape[1],
                                           BLOCK_H=_block(out.shape[1]))


def local_reduce(y, red, tokens, out, t_max: int, *, num_ctas: int = 32) -> None:
    """``out [W*T_max, H]``: per source token, the sum of its rows held here."""
    _local_reduce_kernel[_grid(num_ctas)](y, red, tokens, out, tokens.numel(), t_max, out.shape[1],
                                          K=red.shape[-1], BLOCK_H=_block(out.shape[1]))


def push_meta(pair_row, pair_rank, map_table, red_table, world: int, me: int, t_max: int, topk: int, *,
              num_ctas: int = 32) -> None:
    """Tells every peer which of its rows came from which of this rank's tokens."""
    if pair_row.numel():
        _push_meta_kernel[_grid(num_ctas)](pair_row, pair_rank, map_table, red_table, pair_row.numel(), world, me,
                                           t_max, K=topk, BLOCK=256)


def zero_tail(out, tokens_per_expert, totals, *, num_ctas: int = 32) -> None:
    """Zeroes rows ``[sum(tokens_per_expert), totals[0])`` of ``out`` (rows below are kept);
    ``totals`` as in ``select_rows``."""
    select_rows(out, None, out, tokens_per_expert, totals, identity=True, zero_only=True, num_ctas=num_ctas)


def table_of(tensors: list[torch.Tensor], device) -> torch.Tensor:
    """Pointer table of same-shaped local tensors (the CPU stand-in for symmetric memory)."""
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=device)
