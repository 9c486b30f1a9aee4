"""``ep_dispatch`` / ``ep_combine``: the row moves of one step and their gradients.

[Note: padded all_to_all]
Each move is gather -> ``jax.lax.all_to_all`` -> gather, every index taken from the
:class:`EPHandle`. The all_to_all buffer holds ``P = min(T * K, C)`` row slots per peer
(``W * P`` rows), enough for the worst case a source can send one peer (see
[Note: drop rule] in ``layout.py``), so every shape is static and the move runs on any
backend, CPU included. The cost is bytes: each rank sends and receives ``W * P`` rows
of H whatever the routing, where a ragged exchange (``jax.lax.ragged_all_to_all``, which
XLA:CPU does not implement) would move only the ``T * K`` rows routed, ``W * P / (T * K)``
times fewer (W without a capacity). A finite ``EPConfig.capacity`` bounds P and so the
padding, at the cost of the drop rule.

[Note: gradients]
Both moves are linear and the handle's index maps are bijections between sent pairs and
valid ``recv_x`` rows, so each move's adjoint is the other: the backward of dispatch is
a combine of the row gradients (the gradient of ``x`` sums its K rows, ``topk_weights``
gets each pair's ``recv_w`` gradient), the backward of combine is a dispatch of the
output gradient. ``jax.custom_vjp`` says so, which keeps the backward to gathers and
all_to_alls (autodiff of the forward gathers would scatter-add instead).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from etp.jax.ep.checks import check_combine, check_dispatch
from etp.jax.ep.config import EPConfig
from etp.jax.ep.routing_layout import EPHandle

__all__ = ["ep_combine", "ep_dispatch"]


def _take_rows(source, index):
    """``source[index]`` along axis 0, zero rows where ``index < 0``."""
    picked = jnp.take(source, jnp.maximum(index, 0), axis=0)
    mask = (index >= 0).reshape(index.shape + (1,) * (source.ndim - 1))
    return jnp.where(mask, picked, jnp.zeros((), source.dtype))


def _exchange(cfg: EPConfig, buffer):
    # [W * P, ...]: block d goes to rank d; block s of the result came from rank s.
    return jax.lax.all_to_all(buffer, cfg.axis_name, 0, 0, tiled=True)


def _to_experts(cfg: EPConfig, handle: EPHandle, source, send_index):
    """Rows ``source[send_index]`` of every rank, into this rank's [C, ...] receive order."""
    return _take_rows(_exchange(cfg, _take_rows(source, send_index)), handle.row_slot)


def _from_experts(cfg: EPConfig, handle: EPHandle, rows):
    """[C, ...] receive rows back to the pairs that sent them: [T*K, ...], zero if not sent."""
    return _take_rows(_exchange(cfg, _take_rows(rows, handle.recv_row)), handle.pair_slot)


def _send_tokens(cfg: EPConfig, handle: EPHandle):
    return jnp.where(handle.send_pair >= 0, handle.send_pair // cfg.topk, -1)


def _sum_over_k(cfg: EPConfig, pairs, dtype):
    # Accumulate the K copies in at least float32: bf16 partial sums would round K times.
    wide = jnp.promote_types(dtype, jnp.float32)
    summed = pairs.reshape(-1, cfg.topk, *pairs.shape[1:]).astype(wide).sum(axis=1)
    return summed.astype(dtype)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch(cfg, x, topk_weights, handle):
    recv_x = _to_experts(cfg, handle, x, _send_tokens(cfg, handle))
    recv_w = _to_experts(cfg, handle, topk_weights.reshape(-1), handle.send_pair)
    return recv_x, recv_w


def _dispatch_fwd(cfg, x, topk_weights, handle):
    return _dispatch(cfg, x, topk_weights, handle), handle


def _dispatch_bwd(cfg, handle, grads):
    # See [Note: gradients]: a combine of the row gradients.
    grad_recv_x, grad_recv_w = grads
    grad_x = _sum_over_k(cfg, _from_experts(cfg, handle, grad_recv_x), grad_recv_x.dtype)
    grad_w = _from_experts(cfg, handle, grad_recv_w).reshape(-1, cfg.topk)
    return grad_x, grad_w, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _combine(cfg, expert_out, handle):
    return _sum_over_k(cfg, _from_experts(cfg, handle, expert_out), expert_out.dtype)


def _combine_fwd(cfg, expert_out, handle):
    return _combine(cfg, expert_out, handle), handle


def _combine_bwd(cfg, handle, grad_out):
    # See [Note: gradients]: a dispatch of the output gradient.
    return _to_experts(cfg, handle, grad_out, _send_tokens(cfg, handle)), None


_combine.defvjp(_combine_fwd, _combine_bwd)


def ep_dispatch(cfg: EPConfig, x, topk_weights, handle: EPHandle):
    """Sends each token's row and routing weight to the ranks holding its experts.

    Differentiable in ``x`` and ``topk_weights`` (see [Note: gradients]); bytes moved:
    [Note: padded all_to_all].

    Args:
        cfg: the layer's :class:`EPConfig`.
        x: [T, H] rows of this rank's tokens, dtype ``cfg.dtype``.
        topk_weights: [T, K] floating routing weights, moved beside the rows.
        handle: this step's :class:`EPHandle` from :func:`ep_prepare`.

    Returns:
        ``(recv_x [C, H], recv_w [C], tokens_per_expert [E/W] int32)``: the rows routed to
        this rank sorted by local expert (expert j's rows start at
        ``sum(tokens_per_expert[:j])``; within an expert by source rank, then (token, k));
        rows past ``sum(tokens_per_expert)`` are zero. ``recv_w`` has ``topk_weights``'s dtype.

    Example::

        recv_x, recv_w, tokens_per_expert = jep.ep_dispatch(cfg, x, topk_weights, handle)
        expert_out = experts(recv_x, tokens_per_expert) * recv_w[:, None]
    """
    check_dispatch(cfg, x, topk_weights, handle.pair_slot.shape[0] // cfg.topk)
    recv_x, recv_w = _dispatch(cfg, x, topk_weights, handle)
    return recv_x, recv_w, handle.tokens_per_expert


def ep_combine(cfg: EPConfig, expert_out, handle: EPHandle):
    """Sends the expert outputs back and sums each token's K copies.

    The experts apply ``recv_w`` themselves. Dropped and out-of-range pairs add zero.
    Differentiable in ``expert_out`` (see [Note: gradients]).

    Args:
        cfg: the layer's :class:`EPConfig`.
        expert_out: [C, H] dtype ``cfg.dtype``, row-aligned with ``ep_dispatch``'s
            ``recv_x``; rows past ``sum(tokens_per_expert)`` are ignored.
        handle: the :class:`EPHandle` the dispatch used.

    Returns:
        [T, H] ``cfg.dtype``: for each token, the sum of its K experts' output rows.

    Example::

        out = jep.ep_combine(cfg, expert_out, handle)
    """
    check_combine(cfg, expert_out, handle.row_slot.shape[0])
    return _combine(cfg, expert_out, handle)
