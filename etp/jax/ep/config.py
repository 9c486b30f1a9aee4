"""``EPConfig``: the static shape of one MoE layer's token exchange under JAX.

Everything ``ep_prepare`` / ``ep_dispatch`` / ``ep_combine`` allocate follows from this
config and the axis size W, so one config traces and compiles once.

[Note: receive capacity]
Rank ``d`` receives one row per (token, k) pair routed to one of its experts. The receive
buffer ``recv_x`` has a fixed number of rows C: ``capacity`` when set, else the worst case
``W * max_tokens_per_rank * topk`` (every pair of every rank lands on ``d``), which never
drops. With a finite capacity the rows are ordered (local expert, source rank, source
(token, k)) and the first C are kept; the rest are dropped (see [Note: drop rule] in
``layout.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Optional

import jax.numpy as jnp
import numpy as np

__all__ = ["EPConfig"]


def _positive_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class EPConfig:
    """Static description of an expert-parallel token exchange inside ``shard_map``.

    Rank ``r`` of the mesh axis ``axis_name`` (size W) holds experts
    ``[r * E / W, (r + 1) * E / W)``. The config is hashable, so it can be a static
    argument of ``jax.jit``; each distinct config compiles once.

    Args:
        num_experts: experts in the layer over all ranks (E); divisible by W.
        topk: experts per token (K), at most ``num_experts``.
        hidden_size: row width H of ``x`` and ``expert_out``.
        max_tokens_per_rank: largest T a rank passes to ``ep_prepare``; sizes the
            default capacity.
        dtype: dtype of the token rows (``x``, ``recv_x``, ``expert_out``, the output).
        axis_name: the mesh axis the experts are sharded over.
        capacity: rows C of each rank's receive buffer. ``None``: the worst case
            ``W * max_tokens_per_rank * topk``, no row is ever dropped. See
            [Note: receive capacity].

    Example::

        cfg = EPConfig(num_experts=8, topk=2, hidden_size=16, max_tokens_per_rank=32,
                       dtype=jnp.bfloat16, axis_name="ep", capacity=None)
    """

    num_experts: int
    topk: int
    hidden_size: int
    max_tokens_per_rank: int
    dtype: Any = jnp.bfloat16
    axis_name: Hashable = "ep"
    capacity: Optional[int] = None

    def __post_init__(self):
        for name in ("num_experts", "topk", "hidden_size", "max_tokens_per_rank"):
            value = getattr(self, name)
            if not _positive_int(value):
                raise ValueError(f"EPConfig.{name}={value!r}: expected an int >= 1")
        if self.topk > self.num_experts:
            raise ValueError(f"EPConfig.topk={self.topk} is larger than num_experts={self.num_experts}: "
                             "a token picks topk distinct experts, lower topk or add experts")
        if self.capacity is not None and not _positive_int(self.capacity):
            raise ValueError(f"EPConfig.capacity={self.capacity!r}: expected an int >= 1 (receive rows per "
                             "rank), or None for the worst case that never drops")
        try:
            floating = jnp.issubdtype(jnp.dtype(self.dtype), jnp.floating)
        except TypeError:
            floating = False
        if not floating:
            raise ValueError(f"EPConfig.dtype={self.dtype!r}: expected a floating dtype such as jnp.bfloat16 "
                             "or jnp.float32")
        try:
            hash(self.axis_name)
        except TypeError as err:
            raise ValueError(f"EPConfig.axis_name={self.axis_name!r}: expected a mesh axis name "
                             "(a str)") from err

    def experts_per_rank(self, world_size: int) -> int:
        """Experts each rank holds (E / W); ValueError unless W divides E."""
        if self.num_experts % world_size:
            raise ValueError(
                f"EPConfig.num_experts={self.num_experts} is not divisible by the size {world_size} of mesh "
                f"axis {self.axis_name!r}: every rank must hold the same number of experts; pick num_experts "
                f"a multiple of {world_size} or a different mesh")
        return self.num_experts // world_size

    def recv_rows(self, world_size: int) -> int:
        """Rows C of ``recv_x``. See [Note: receive capacity]."""
        if self.capacity is not None:
            return self.capacity
        return world_size * self.max_tokens_per_rank * self.topk
