"""``ep_prepare``: the routing layout of one step by prefix sums, and the handle holding it.

[Note: receive layout]
With ``c[s, d, l]`` the (token, k) pairs source rank ``s`` routes to local expert ``l`` of
rank ``d`` (one ``all_gather`` of every rank's per-expert counts), rank ``d`` orders the
rows it receives by local expert, then source rank, then the source's (token, k) order:

    start[d, l]   = sum_{l' < l} sum_s c[s, d, l']
    base[s, d, l] = start[d, l] + sum_{s' < s} c[s', d, l]

pair ``j`` (0-based, in (token, k) order) of source ``s`` for expert ``(d, l)`` belongs in
row ``base[s, d, l] + j`` of rank ``d``'s ``recv_x``.

[Note: drop rule]
A pair is kept iff that row is below the capacity C; the rest are dropped: each rank
keeps the first C rows of the order above (lower local experts first, then lower source
ranks, then lower (token, k)). Every rank computes every ``base`` from the gathered
counts, so senders and receivers agree without another exchange. A dropped pair is not
sent, has no row, and adds zero to ``ep_combine``; ``handle.dropped`` counts the rows
rank ``d`` could not keep. Rows keep increasing in (l, j) order from one source to one
destination, so the kept pairs of ``s`` for ``d`` are a prefix of that order: they fit
``P = min(T * K, C)`` slots of the padded all_to_all (see ``moves.py``).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from etp.jax.ep.checks import check_prepare, is_concrete, validate_topk_idx
from etp.jax.ep.compat import axis_size
from etp.jax.ep.config import EPConfig

__all__ = ["EPHandle", "ep_prepare"]

_INDEX = jnp.int32


class EPHandle(NamedTuple):
    """Routing of one step on one rank (a pytree of int32 arrays; pass it through jit freely).

    With T tokens, K = topk, W ranks, C receive rows and ``P = min(T * K, C)`` slots per peer
    in the padded all_to_all buffers (flat index ``peer * P + slot``):

    Attributes:
        pair_slot: [T*K] send-buffer slot of pair ``t * K + k``, -1 if not sent (an
            out-of-range id or a dropped pair).
        send_pair: [W*P] the pair in each send-buffer slot, -1 for padding.
        recv_row: [W*P] the ``recv_x`` row of each receive-buffer slot, -1 for padding.
        row_slot: [C] the receive-buffer slot of each ``recv_x`` row, -1 past the valid rows.
        tokens_per_expert: [E/W] rows each local expert received (after drops).
        dropped: [] rows routed to this rank beyond its capacity (always 0 without one).
        invalid: [] this rank's expert ids outside ``[0, num_experts)`` (never sent).
    """

    pair_slot: jax.Array
    send_pair: jax.Array
    recv_row: jax.Array
    row_slot: jax.Array
    tokens_per_expert: jax.Array
    dropped: jax.Array
    invalid: jax.Array


def _exclusive_cumsum(counts, axis):
    return jnp.cumsum(counts, axis=axis, dtype=_INDEX) - counts


def _rank_within_expert(bins, num_bins):
    """(j, counts): j is each pair's index among the pairs of its bin, in (token, k) order."""
    n = bins.shape[0]
    counts = jnp.zeros(num_bins, _INDEX).at[bins].add(1)
    order = jnp.argsort(bins, stable=True)
    j_sorted = jnp.arange(n, dtype=_INDEX) - _exclusive_cumsum(counts, 0)[bins[order]]
    return jnp.zeros(n, _INDEX).at[order].set(j_sorted), counts


def _send_plan(expert, valid, j, mine, base_mine, local, rows, slots):
    """(pair_slot, send_pair) of this rank as a sender; ``mine`` is c[me] [W, L]."""
    world = mine.shape[0]
    dest, lex = expert // local, expert % local
    kept = valid & (base_mine[dest, lex] + j < rows)
    # Slot in the buffer for peer ``dest``: the pair's place in (local expert, j) order.
    slot = dest * slots + _exclusive_cumsum(mine, 1)[dest, lex] + j
    pair_slot = jnp.where(kept, slot, -1)
    pairs = jnp.arange(expert.shape[0], dtype=_INDEX)
    send_pair = jnp.full(world * slots, -1, _INDEX).at[jnp.where(kept, slot, world * slots)].set(pairs, mode="drop")
    return pair_slot, send_pair


def _recv_plan(to_me, base_to_me, rows, slots):
    """(recv_row, row_slot) of this rank as a receiver; ``to_me`` is c[:, me] [W, L]."""
    world, local = to_me.shape
    inclusive = jnp.cumsum(to_me, axis=1, dtype=_INDEX)
    slot = jnp.arange(slots, dtype=_INDEX)
    # The local expert of slot i of source s: the first l whose inclusive count exceeds i.
    lex = jax.vmap(lambda inc: jnp.searchsorted(inc, slot, side="right"))(inclusive).astype(_INDEX)
    in_range = lex < local
    lex = jnp.minimum(lex, local - 1)
    j = slot[None, :] - jnp.take_along_axis(inclusive - to_me, lex, axis=1)
    row = jnp.take_along_axis(base_to_me, lex, axis=1) + j
    ok = (in_range & (row < rows)).reshape(-1)
    row = row.reshape(-1)
    recv_row = jnp.where(ok, row, -1)
    row_slot = jnp.full(rows, -1, _INDEX).at[jnp.where(ok, row, rows)].set(
        jnp.arange(world * slots, dtype=_INDEX), mode="drop")
    return recv_row, row_slot


def ep_prepare(cfg: EPConfig, topk_idx) -> EPHandle:
    """Computes where every (token, k) pair of this rank goes; one small ``all_gather``.

    Call inside ``shard_map`` over a mesh with axis ``cfg.axis_name``. Shapes and dtypes
    are checked at trace time (ValueError). Expert ids outside ``[0, num_experts)`` are
    checked only when ``topk_idx`` is concrete; under jit they are not sent and are counted
    in ``handle.invalid`` (see :func:`validate_topk_idx`). Rows beyond ``cfg.capacity``
    are dropped by [Note: drop rule] and counted in ``handle.dropped``.

    Args:
        cfg: the layer's :class:`EPConfig`.
        topk_idx: [T, K] integer global expert ids of this rank's tokens (T <=
            ``cfg.max_tokens_per_rank``).

    Returns:
        An :class:`EPHandle` for ``ep_dispatch`` / ``ep_combine`` of the same step.

    Example::

        handle = jep.ep_prepare(cfg, topk_idx)
        recv_x, recv_w, tokens_per_expert = jep.ep_dispatch(cfg, x, topk_weights, handle)
    """
    check_prepare(cfg, topk_idx)
    if is_concrete(topk_idx):
        validate_topk_idx(cfg, topk_idx)
    world = axis_size(cfg.axis_name)
    local = cfg.experts_per_rank(world)
    rows = cfg.recv_rows(world)
    num_experts = cfg.num_experts
    slots = min(topk_idx.shape[0] * cfg.topk, rows)
    me = jax.lax.axis_index(cfg.axis_name)

    flat = topk_idx.reshape(-1).astype(_INDEX)
    valid = (flat >= 0) & (flat < num_experts)
    bins = jnp.where(valid, flat, num_experts)  # one extra bin for the out-of-range ids
    j, counts = _rank_within_expert(bins, num_experts + 1)
    # c[s, d, l]: see [Note: receive layout].
    c = jax.lax.all_gather(counts[:num_experts], cfg.axis_name).reshape(world, world, local)
    expert_total = c.sum(0)
    start = _exclusive_cumsum(expert_total, 1)
    base = start[None] + _exclusive_cumsum(c, 0)

    expert = jnp.where(valid, flat, 0)
    pair_slot, send_pair = _send_plan(expert, valid, j, c[me], base[me], local, rows, slots)
    recv_row, row_slot = _recv_plan(c[:, me], base[:, me], rows, slots)
    return EPHandle(
        pair_slot=pair_slot,
        send_pair=send_pair,
        recv_row=recv_row,
        row_slot=row_slot,
        tokens_per_expert=jnp.clip(rows - start[me], 0, expert_total[me]).astype(_INDEX),
        dropped=jnp.maximum(expert_total[me].sum() - rows, 0).astype(_INDEX),
        invalid=counts[num_experts],
    )
