"""Routing layout by prefix sums, on device: where every (token, expert) pair goes.

``count_pairs`` and ``pair_rows`` run the Triton kernels of ``etp.kernels.ep_layout`` on a
GPU (four launches in all, see [Note: layout in blocks] there) and the pure-torch
``count_pairs_torch`` / ``pair_rows_torch`` on CPU; the torch functions define the results,
which the kernels match bit for bit (``tests/kernels/test_ep_layout.py``). Either way the
layout's tensors are allocated per call (from the caching allocator) and no host value
depends on the routing, so ``prepare`` is capturable.

[Note: receive layout]
Rank ``d``'s receive buffer holds its local experts' rows expert by expert; within one
local expert, the rows of source rank 0, then 1, ...; within one source, its pairs in
``(token, k)`` order. With ``C[s, d, l]`` the pairs source ``s`` routes to local expert
``l`` of rank ``d`` and ``kept`` those that fit (see [Note: receive capacity] in config):

    kept[s, d, l]  = clamp(limit - sum_{s' < s} C[s', d, l], 0, C[s, d, l])
    start[d, l]    = sum_{l' < l} sum_s kept[s, d, l']
    base[s, d, l]  = start[d, l] + sum_{s' < s} kept[s', d, l]

pair ``j`` (0-based, in ``(token, k)`` order) of source ``s`` for expert ``(d, l)`` lands in
row ``base[s, d, l] + j`` of rank ``d`` if ``j < kept[s, d, l]`` and that row is below the
capacity; otherwise it is not sent (``pair_row = -1``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from etp.kernels import ep_layout

__all__ = ["Layout", "count_pairs", "plan", "pair_rows", "count_pairs_torch", "pair_rows_torch", "META_COLUMNS"]

#: Extra columns of the exchanged metadata after the E per-expert counts: tokens T, and
#: the number of out-of-range expert indices.
META_COLUMNS = 2
# A limit no count reaches (plan's kept without dropping).
_NO_LIMIT = 1 << 62


class Layout(NamedTuple):
    """Per-rank routing layout (all on the device of ``topk_idx``).

    pair_row: [T*K] int64, row in the destination rank's receive buffer, -1 if not sent.
    pair_rank: [T*K] int64, destination rank of the pair, -1 if not sent.
    tokens_per_expert: [E_local] int64, valid rows per local expert.
    recv_base / recv_kept: [W, E_local] int64, first row and row count of each
        (source rank, local expert) block of this rank's receive buffer.
    send_kept: [E] int64, pairs of this rank sent to each expert.
    send_base: [E] int64, row of this rank's first pair in each expert's destination.
    needed: [W] int64, rows each rank's buffer would need (overflow iff > capacity).
    tokens: [W] int64, tokens of every rank.
    """

    pair_row: torch.Tensor
    pair_rank: torch.Tensor
    tokens_per_expert: torch.Tensor
    recv_base: torch.Tensor
    recv_kept: torch.Tensor
    send_kept: torch.Tensor
    send_base: torch.Tensor
    needed: torch.Tensor
    tokens: torch.Tensor


def _use_kernel(tensor: torch.Tensor, kernel: bool | None) -> bool:
    # None: the kernels on a GPU; tests force them on CPU (under the Triton interpreter).
    return tensor.is_cuda if kernel is None else kernel


def count_pairs(topk_idx: torch.Tensor, num_experts: int, *, out: torch.Tensor | None = None,
                return_blocks: bool = False, kernel: bool | None = None):
    """[E + META_COLUMNS] int64: pairs per expert, then T, then the out-of-range indices.

    ``out``: written there (and returned). ``return_blocks``: returns ``(meta, blocks)``,
    ``blocks`` being what ``pair_rows`` reuses instead of counting again (the kernels' block
    prefix; None from the torch path). ``kernel``: the Triton kernels (None: on CUDA tensors).

    Example::

        meta, blocks = count_pairs(topk_idx, num_experts, out=meta_buffer, return_blocks=True)
    """
    if _use_kernel(topk_idx, kernel):
        meta, blocks = ep_layout.count_pairs_triton(topk_idx, num_experts, out)
    else:
        meta, blocks = count_pairs_torch(topk_idx, num_experts), None
        if out is not None:
            meta = out.copy_(meta)
    return (meta, blocks) if return_blocks else meta


def pair_rows(topk_idx: torch.Tensor, meta: torch.Tensor, rank: int, capacity: int,
              expert_capacity: int | None, *, blocks: torch.Tensor | None = None,
              kernel: bool | None = None) -> Layout:
    """The full layout of this rank from the all-gathered counts ``meta`` [W, E + 2]. See
    [Note: receive layout]. ``blocks``: from this rank's ``count_pairs(...,
    return_blocks=True)`` (None: counted again); ``kernel`` as in ``count_pairs``.

    Example::

        layout = pair_rows(topk_idx, meta_all, rank, capacity, None, blocks=blocks)
    """
    if not _use_kernel(topk_idx, kernel):
        return pair_rows_torch(topk_idx, meta, rank, capacity, expert_capacity)
    num_experts = meta.shape[1] - META_COLUMNS
    if blocks is None:
        _, blocks = ep_layout.count_pairs_triton(topk_idx, num_experts)
    return Layout(*ep_layout.pair_rows_triton(topk_idx, meta, blocks, rank, capacity, expert_capacity))


def count_pairs_torch(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``count_pairs`` in pure torch: the reference."""
    flat = topk_idx.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    bins = torch.where(valid, flat, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.index_add_(0, bins, torch.ones_like(bins))
    tokens = torch.full((1,), topk_idx.shape[0], dtype=torch.int64, device=flat.device)
    return torch.cat([counts[:num_experts], tokens, counts[num_experts:]])


def plan(meta: torch.Tensor, rank: int, capacity: int, expert_capacity: int | None):
    """The layout tensors that depend only on the exchanged counts ``meta`` [W, E + 2].

    Returns ``(kept, base, tokens_per_expert, needed)`` with kept/base [W, W, E_local]
    indexed (source, destination, local expert). See [Note: receive layout].
    """
    world = meta.shape[0]
    counts = meta[:, : meta.shape[1] - META_COLUMNS].reshape(world, world, -1)
    limit = _NO_LIMIT if expert_capacity is None else expert_capacity
    before_src = counts.cumsum(0) - counts
    kept = torch.minimum((limit - before_src).clamp(min=0), counts)
    expert_kept = kept.sum(0)  # [d, l]
    start = expert_kept.cumsum(1) - expert_kept
    base = start.unsqueeze(0) + kept.cumsum(0) - kept
    needed = expert_kept.sum(1)
    tokens_per_expert = torch.minimum((capacity - start[rank]).clamp(min=0), expert_kept[rank])
    return kept, base, tokens_per_expert, needed


def pair_rows_torch(topk_idx: torch.Tensor, meta: torch.Tensor, rank: int, capacity: int,
                    expert_capacity: int | None) -> Layout:
    """``pair_rows`` in pure torch: the reference. See [Note: receive layout]."""
    world = meta.shape[0]
    num_experts = meta.shape[1] - META_COLUMNS
    local = num_experts // world
    kept, base, tokens_per_expert, needed = plan(meta, rank, capacity, expert_capacity)
    # Rows past the capacity are never written: clip the kept counts to what fits.
    kept_fit = torch.minimum((capacity - base).clamp(min=0), kept)
    flat = topk_idx.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    expert = torch.where(valid, flat, 0)
    # j: index of the pair among this rank's pairs to the same expert, in (token, k) order.
    order = torch.argsort(torch.where(valid, flat, num_experts), stable=True)
    counts = meta[rank, :num_experts]
    group_start = counts.cumsum(0) - counts
    j = torch.empty_like(flat)
    j[order] = torch.arange(flat.numel(), device=flat.device) - torch.cat(
        [group_start, counts.sum().reshape(1)])[torch.where(valid, flat, num_experts)[order]]
    my_base = base[rank].reshape(-1)[expert]
    ok = valid & (j < kept_fit[rank].reshape(-1)[expert])
    return Layout(
        pair_row=torch.where(ok, my_base + j, -1),
        pair_rank=torch.where(ok, expert // local, -1),
        tokens_per_expert=tokens_per_expert,
        recv_base=base[:, rank],
        recv_kept=kept_fit[:, rank],
        send_kept=kept_fit[rank].reshape(-1),
        send_base=base[rank].reshape(-1),
        needed=needed,
        tokens=meta[:, num_experts].contiguous(),
    )
