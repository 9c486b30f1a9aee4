"""Pure-torch references of ``etp.kernels.ep_move`` and ``etp.kernels.ep_pack``: the same
moves over lists of per-rank tensors (``bufs[d]`` is rank d's buffer) instead of pointer tables. They define the results
the kernels are tested against (bit for bit: the sums accumulate in fp32 in the same order).
"""
from __future__ import annotations

import torch

__all__ = ["push_rows_ref", "pull_reduce_ref", "pull_pairs_ref", "select_rows_ref", "gather_tokens_ref",
           "local_reduce_ref", "push_meta_ref", "copy_rows_ref"]


def _first_of_rank(pair_row, pair_rank, topk):
    """[T, K] bool: the pair is sent and is the first of its token to its rank."""
    row, dest = pair_row.reshape(-1, topk), pair_rank.reshape(-1, topk)
    first = row >= 0
    for k in range(topk):
        for k2 in range(k):
            first[:, k] &= (row[:, k2] < 0) | (dest[:, k2] != dest[:, k])
    return first


def push_rows_ref(x, w, pair_row, pair_rank, x_bufs, w_bufs, *, mode, me=0, t_max=0, own=None):
    tokens = x.shape[0]
    topk = pair_row.numel() // tokens if tokens else 1
    first = _first_of_rank(pair_row, pair_rank, topk).reshape(-1) if tokens else None
    for p in range(pair_row.numel()):
        row, d, t = int(pair_row[p]), int(pair_rank[p]), p // topk
        if row < 0:
            continue
        if w is not None:
            w_bufs[d][row] = w.reshape(-1)[p]
        if mode == 1:
            x_bufs[d][row] = x[t]
        elif mode == 2 and first[p] and not (own is not None and d == me):
            x_bufs[d][me * t_max + t] = x[t]
        if mode == 2 and own is not None and d == me:
            own[row] = x[t]


def pull_reduce_ref(srcs, pair_row, pair_rank, out, *, dedup=False):
    tokens = out.shape[0]
    if tokens == 0:
        return
    topk = pair_row.numel() // tokens
    first = _first_of_rank(pair_row, pair_rank, topk)
    acc = torch.zeros(out.shape, dtype=torch.float32, device=out.device)
    for t in range(tokens):
        for k in range(topk):
            row, d = int(pair_row[t * topk + k]), int(pair_rank[t * topk + k])
            if dedup and first[t, k]:
                acc[t] += srcs[d][t].float()
            elif not dedup and row >= 0:
                acc[t] += srcs[d][row].float()
    out.copy_(acc)


def pull_pairs_ref(srcs, pair_row, pair_rank, out):
    for p in range(out.numel()):
        row = int(pair_row[p])
        out[p] = srcs[int(pair_rank[p])][row] if row >= 0 else 0


def select_rows_ref(src, src_map, out, tokens_per_expert, totals, local=None, local_first=0, kept_rows=0):
    total, prev = int(tokens_per_expert.sum()), int(totals[0])
    if src_map is not None:
        for r in range(total):
            q = int(src_map[r])
            if local_first <= q < local_first + kept_rows:
                continue
            if local is not None and local_first <= q < local_first + local.shape[0]:
                out[r] = local[q - local_first]
            else:
                out[r] = src[q] if q >= 0 else 0
    out[total:max(total, prev)] = 0
    totals[0] = total


def gather_tokens_ref(srcs, tokens, out, t_max, skip=-1):
    for s, src in enumerate(srcs):
        if s == skip:
            continue
        n = int(tokens[s])
        out[s * t_max: s * t_max + n] = src[:n]


def local_reduce_ref(y, red, tokens, push_to, t_max, *, me=0):
    """``push_to``: the sources' buffers (``push_to[s]``); the sum goes to slot me*t_max + t."""
    for q in range(red.shape[0]):
        s, t = divmod(q, t_max)
        rows = [int(r) for r in red[q] if r >= 0]
        if t < int(tokens[s]) and rows:
            acc = torch.zeros(y.shape[1], dtype=torch.float32, device=y.device)
            for r in rows:
                acc += y[r].float()
            push_to[s][me * t_max + t] = acc.to(push_to[s].dtype)


def push_meta_ref(pair_row, pair_rank, map_bufs, red_bufs, me, t_max, topk):
    for d in range(len(map_bufs)):
        for p in range(pair_row.numel()):
            row, to_d = int(pair_row[p]), int(pair_rank[p]) == d
            red_bufs[d].view(-1)[me * t_max * topk + p] = row if (to_d and row >= 0) else -1
            if to_d and row >= 0:
                map_bufs[d][row] = me * t_max + p // topk


def copy_rows_ref(src, idx, dst, start, end, *, scatter, tokens_per_expert=None, slot_rows=0):
    """``slot_rows``: ``dst`` is the list of the peers' buffers (``dst[rank]``)."""
    if tokens_per_expert is not None:
        end = min(end, int(tokens_per_expert.sum()))
    for i in range(start, end):
        q = int(idx[i])
        if q < 0:
            continue
        if slot_rows:
            dst[q // slot_rows][q % slot_rows] = src[i]
        elif scatter:
            dst[q] = src[i]
        else:
            dst[i] = src[q]
