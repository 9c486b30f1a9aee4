"""Triton kernels that compute the expert-parallel routing layout of ``etp.ep.routing_layout``.

The pure-torch ``count_pairs_torch`` / ``pair_rows_torch`` of ``etp.ep.routing_layout`` define the
results (see [Note: receive layout] there); these give the same tensors bit for bit in four
launches, where the torch code issues ~40 small ops whose launches, not their work, cost the
host its time in ``prepare``.

[Note: layout in blocks]
Notation: pair ``p = t * K + k`` of this rank (P = T * K of them), ``bin(p)`` its expert if
``0 <= e < E``, else ``E`` (out of range: counted, never sent). What the torch code gets from
a stable argsort is ``j(p)``, the number of pairs before ``p`` (in ``(token, k)`` order) with
the same bin. The pairs are cut into blocks of ``BLOCK`` and

    j(p) = prefix[b, bin(p)] + #{q in block b, q < p, bin(q) = bin(p)}
    prefix[b, x] = #{pairs of bin x in blocks < b}

1. ``_block_counts_kernel``: per block, the histogram of its bins (``tl.histogram``).
2. ``_block_prefix_kernel``: per column of bins, the exclusive prefix of those histograms
   over the blocks, in place; the column totals that it is left with are the per-expert
   counts and the out-of-range count, written into ``meta`` with T between them. The totals
   come from a scan, not from atomics into a zeroed buffer: no zeroing launch, and the same
   order every call.
   (The caller all-gathers ``meta`` into ``meta_all [W, E + 2]`` here.)
3. ``_plan_kernel``: one program computes the ``[W, W, E_local]`` plan (kept / base /
   kept_fit) from ``meta_all`` as ``[source, destination, local expert]`` tiles, and writes
   the small fields of the layout (``tokens_per_expert`` ... ``tokens``) into one buffer.
4. ``_pair_rows_kernel``: per block, ``j`` as above (the in-block count from ``[BLOCK, SUB]``
   comparisons of bins, SUB columns at a time: BLOCK compares per pair, no sort), then
   ``pair_row = send_base[e] + j`` where ``j < send_kept[e]`` (both gathered from step 3's
   output, which the stream order makes visible), ``pair_rank = e // E_local``.

The host passes shapes and the static arguments (rank, capacity, expert capacity) only:
no host sync, the same launches every call for one shape, so a CUDA graph captures it.
Block histograms and prefixes are int32 (a count is at most P); every row index is int64.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from etp.kernels.launch import launch

__all__ = ["count_pairs_triton", "pair_rows_triton", "num_blocks", "PAIR_BLOCK"]

#: Pairs per block (see [Note: layout in blocks]): the in-block count costs BLOCK compares
#: per pair, the block prefix (E + 1) ints per block; 256 keeps both small at 300k pairs.
PAIR_BLOCK = 256
# Columns of one comparison tile of the in-block count: [BLOCK, SUB] bins at a time.
_SUB = 32
# Bins per program and blocks per step of the prefix scan.
_PREFIX_COLS, _PREFIX_ROWS = 32, 64
# Programs of the per-block kernels; each loops over its share of blocks beyond that.
_MAX_PROGRAMS = 1024
# A receive limit that no count reaches (expert_capacity None).
_NO_LIMIT = 1 << 62


@triton.jit
def _bins(e, valid_pair, E: tl.constexpr):
    """The bin of each pair: its expert, or E for an out-of-range index."""
    return tl.where(valid_pair & (e >= 0) & (e < E), e, E)


@triton.jit
def _block_counts_kernel(idx_ptr, hist_ptr, P, n_blocks, E: tl.constexpr, BLOCK: tl.constexpr,
                         BINS: tl.constexpr):
    """``hist[b, x]`` = pairs of bin x (E + 1 bins) in block b."""
    x = tl.arange(0, BINS)
    for b in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
        b64 = tl.cast(b, tl.int64)  # the loop index is int32: offsets in int64
        offs = b64 * BLOCK + tl.arange(0, BLOCK)
        live = offs < P
        e = tl.load(idx_ptr + offs, mask=live, other=0)
        # Lanes past P land in bin E + 1, which is not stored (BINS >= E + 2): a histogram
        # mask is not in every Triton this runs on.
        bins = tl.where(live, _bins(e, live, E), E + 1).to(tl.int32)
        tl.store(hist_ptr + b64 * (E + 1) + x, tl.histogram(bins, BINS), mask=x < E + 1)


@triton.jit
def _block_prefix_kernel(hist_ptr, meta_ptr, n_blocks, T, E: tl.constexpr, ROWS: tl.constexpr,
                         COLS: tl.constexpr):
    """In place, ``hist[b, x]`` becomes the pairs of bin x in blocks before b; ``meta[x]`` (the
    out-of-range bin E: ``meta[E + 1]``) the total of bin x, and ``meta[E]`` = T."""
    x = tl.program_id(0) * COLS + tl.arange(0, COLS)
    cols = x < E + 1
    carry = tl.zeros([COLS], tl.int32)
    for r0 in range(0, n_blocks, ROWS):
        r = r0 + tl.arange(0, ROWS)
        mask = (r < n_blocks)[:, None] & cols[None, :]
        ptrs = hist_ptr + r.to(tl.int64)[:, None] * (E + 1) + x[None, :]
        h = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, carry[None, :] + tl.cumsum(h, axis=0) - h, mask=mask)
        carry += tl.sum(h, axis=0)
    tl.store(meta_ptr + tl.where(x < E, x, E + 1), carry.to(tl.int64), mask=cols)
    if tl.program_id(0) == 0:
        tl.store(meta_ptr + E, T)


@triton.jit
def _plan_kernel(meta_ptr, out_ptr, rank, capacity, limit, W: tl.constexpr, L: tl.constexpr,
                 W_PAD: tl.constexpr, L_PAD: tl.constexpr):
    """The plan of [Note: receive layout] from ``meta_all [W, E + 2]``, as [source s,
    destination d, local expert l] tiles (padding holds zero counts, at the end of every
    axis, so it changes no sum or prefix). ``out``: tokens_per_expert [L], recv_base [W, L],
    recv_kept [W, L], send_kept [E], send_base [E], needed [W], tokens [W], in that order."""
    E: tl.constexpr = W * L
    i = tl.arange(0, W_PAD)
    e = tl.arange(0, L_PAD)  # local expert
    s3, d3, l3 = i[:, None, None], i[None, :, None], e[None, None, :]
    counts = tl.load(meta_ptr + s3 * (E + 2) + d3 * L + l3, mask=(s3 < W) & (d3 < W) & (l3 < L), other=0)
    before_src = tl.cumsum(counts, axis=0) - counts
    kept = tl.minimum(tl.maximum(limit - before_src, 0), counts)
    expert_kept = tl.sum(kept, axis=0)  # [d, l]
    start = tl.cumsum(expert_kept, axis=1) - expert_kept
    base = start[None, :, :] + tl.cumsum(kept, axis=0) - kept
    # Rows past the capacity are never written: the kept counts clipped to what fits.
    kept_fit = tl.minimum(tl.maximum(capacity - base, 0), kept)
    tokens_per_expert = tl.minimum(tl.maximum(capacity - start, 0), expert_kept)

    # This rank's row (as destination: recv_*, tokens_per_expert; as source: send_*), picked
    # by a masked sum over the axis. r2: the first axis of a [W, L] result (d or s).
    r2, l2 = i[:, None], e[None, :]
    wl = (r2 < W) & (l2 < L)
    tl.store(out_ptr + e, tl.sum(tl.where(r2 == rank, tokens_per_expert, 0), axis=0), mask=e < L)
    tl.store(out_ptr + L + r2 * L + l2, tl.sum(tl.where(d3 == rank, base, 0), axis=1), mask=wl)
    tl.store(out_ptr + L + E + r2 * L + l2, tl.sum(tl.where(d3 == rank, kept_fit, 0), axis=1), mask=wl)
    tl.store(out_ptr + L + 2 * E + r2 * L + l2, tl.sum(tl.where(s3 == rank, kept_fit, 0), axis=0), mask=wl)
    tl.store(out_ptr + L + 3 * E + r2 * L + l2, tl.sum(tl.where(s3 == rank, base, 0), axis=0), mask=wl)
    tl.store(out_ptr + L + 4 * E + i, tl.sum(expert_kept, axis=1), mask=i < W)
    tl.store(out_ptr + L + 4 * E + W + i, tl.load(meta_ptr + i * (E + 2) + E, mask=i < W, other=0), mask=i < W)


@triton.jit
def _pair_rows_kernel(idx_ptr, prefix_ptr, plan_ptr, out_ptr, P, n_blocks, E: tl.constexpr, L: tl.constexpr,
                      BLOCK: tl.constexpr, SUB: tl.constexpr):
    """``out[0, p]`` = pair_row, ``out[1, p]`` = pair_rank (see [Note: layout in blocks])."""
    send_kept_ptr = plan_ptr + L + 2 * E
    send_base_ptr = plan_ptr + L + 3 * E
    i = tl.arange(0, BLOCK)
    for b in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
        b64 = tl.cast(b, tl.int64)  # the loop index is int32: offsets in int64
        first = b64 * BLOCK
        live = first + i < P
        e = tl.load(idx_ptr + first + i, mask=live, other=-1)
        valid = live & (e >= 0) & (e < E)
        bins = _bins(e, live, E)
        # Earlier pairs of the same bin in this block. Lanes past P sit after every live lane,
        # so whatever bin they read as, they are never "earlier".
        earlier = tl.zeros([BLOCK], tl.int32)
        for c in tl.static_range(0, BLOCK, SUB):
            q = c + tl.arange(0, SUB)
            eq = tl.load(idx_ptr + first + q, mask=first + q < P, other=-1)
            same = (bins[:, None] == _bins(eq, first + q < P, E)[None, :]) & (q[None, :] < i[:, None])
            earlier += tl.sum(same.to(tl.int32), axis=1)
        j = tl.load(prefix_ptr + b64 * (E + 1) + bins, mask=live, other=0).to(tl.int64) + earlier
        expert = tl.where(valid, e, 0)
        kept = tl.load(send_kept_ptr + expert, mask=valid, other=0)
        base = tl.load(send_base_ptr + expert, mask=valid, other=0)
        sent = valid & (j < kept)
        tl.store(out_ptr + first + i, tl.where(sent, base + j, -1), mask=live)
        tl.store(out_ptr + P + first + i, tl.where(sent, expert // L, -1), mask=live)


def num_blocks(pairs: int, block: int = PAIR_BLOCK) -> int:
    """Blocks of ``block`` pairs that ``pairs`` pairs take (the rows of the block prefix)."""
    return triton.cdiv(pairs, block)


def _check_block(block: int) -> None:
    if not isinstance(block, int) or block < _SUB or block & (block - 1):
        raise ValueError(f"block={block!r}: expected a power of two >= {_SUB}")


def count_pairs_triton(topk_idx: torch.Tensor, num_experts: int, out: torch.Tensor | None = None, *,
                block: int = PAIR_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(meta, block_prefix)``: ``meta`` [E + 2] int64 as ``etp.ep.routing_layout.count_pairs`` (per
    expert pairs, T, out-of-range indices), written into ``out`` if given; ``block_prefix``
    [num_blocks, E + 1] int32, the pairs of each bin in the blocks before each block, which
    ``pair_rows_triton`` takes. Two launches (see [Note: layout in blocks]).

    Example::

        meta, block_prefix = count_pairs_triton(topk_idx, num_experts)
    """
    _check_block(block)
    flat = topk_idx.reshape(-1)
    pairs = flat.numel()
    n_blocks = num_blocks(pairs, block)
    if out is None:
        out = torch.empty(num_experts + 2, dtype=torch.int64, device=flat.device)
    elif out.dtype != torch.int64 or out.shape != (num_experts + 2,) or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous int64 [{num_experts + 2}] tensor, got {out.dtype} "
                         f"{tuple(out.shape)}")
    hist = torch.empty(n_blocks, num_experts + 1, dtype=torch.int32, device=flat.device)
    if n_blocks:
        launch(_block_counts_kernel, (min(n_blocks, _MAX_PROGRAMS),), flat, hist, pairs, n_blocks, E=num_experts,
               BLOCK=block, BINS=triton.next_power_of_2(num_experts + 2), num_warps=4)
    launch(_block_prefix_kernel, (triton.cdiv(num_experts + 1, _PREFIX_COLS),), hist, out, n_blocks,
           topk_idx.shape[0], E=num_experts, ROWS=_PREFIX_ROWS, COLS=_PREFIX_COLS, num_warps=4)
    return out, hist


def pair_rows_triton(topk_idx: torch.Tensor, meta: torch.Tensor, block_prefix: torch.Tensor, rank: int, capacity: int,
              expert_capacity: int | None, *, block: int = PAIR_BLOCK) -> tuple:
    """The fields of ``etp.ep.routing_layout.Layout``, in its order, from the all-gathered ``meta``
    [W, E + 2] and this rank's ``block_prefix`` (from ``count_pairs_triton`` with the same
    ``block``). Two launches (see [Note: layout in blocks]). ``j`` comes from the block
    prefix, not from ``meta[rank]``: the two must count the same ``topk_idx`` (as in
    ``prepare``), where the torch reference reads ``meta[rank]``.

    Example::

        fields = pair_rows_triton(topk_idx, meta_all, block_prefix, rank, capacity, None)
    """
    _check_block(block)
    world = meta.shape[0]
    num_experts = meta.shape[1] - 2
    local = num_experts // world
    flat = topk_idx.reshape(-1)
    pairs = flat.numel()
    n_blocks = num_blocks(pairs, block)
    if block_prefix.shape != (n_blocks, num_experts + 1) or block_prefix.dtype != torch.int32:
        raise ValueError(f"block_prefix: expected int32 [{n_blocks}, {num_experts + 1}] (count_pairs_triton of these "
                         f"{pairs} pairs, block={block}), got {block_prefix.dtype} {tuple(block_prefix.shape)}")
    meta = meta.contiguous()
    limit = _NO_LIMIT if expert_capacity is None else min(expert_capacity, _NO_LIMIT)
    plan = torch.empty(local + 4 * num_experts + 2 * world, dtype=torch.int64, device=flat.device)
    launch(_plan_kernel, (1,), meta, plan, rank, capacity, limit, W=world, L=local,
           W_PAD=triton.next_power_of_2(world), L_PAD=triton.next_power_of_2(local), num_warps=4)
    rows = torch.empty(2, pairs, dtype=torch.int64, device=flat.device)
    if n_blocks:
        launch(_pair_rows_kernel, (min(n_blocks, _MAX_PROGRAMS),), flat, block_prefix, plan, rows, pairs, n_blocks,
               E=num_experts, L=local, BLOCK=block, SUB=_SUB, num_warps=4)
    # Views of the plan buffer, in _plan_kernel's order.
    sizes = (local, num_experts, num_experts, num_experts, num_experts, world, world)
    tpe, recv_base, recv_kept, send_kept, send_base, needed, tokens = plan.split(sizes)
    return (rows[0], rows[1], tpe, recv_base.view(world, local), recv_kept.view(world, local), send_kept,
            send_base, needed, tokens)
