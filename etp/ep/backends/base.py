"""What a backend is: how the rows of a layout move, nothing else.

Every backend reads the same :class:`etp.ep.routing_layout.Layout` (see [Note: receive layout]) and
writes into buffers the dispatcher allocated at construction; it never decides where a row
goes. A dispatch backend fills a receive buffer, a combine backend sums rows back onto their
source tokens. Dispatch and combine may come from different backends.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from etp.kernels.gather_sum import sum_in_k_order

__all__ = ["EPContext", "Backend", "first_pairs", "sum_pairs"]


@dataclass(frozen=True)
class EPContext:
    """What every backend of one dispatcher shares: config, group and derived sizes."""

    cfg: object  # EPConfig (not imported: backends sit below the config in the import order)
    group: Optional[dist.ProcessGroup]
    rank: int
    world_size: int
    experts_per_rank: int
    capacity: int
    device: torch.device


class Backend:
    """Base class. Subclasses set ``name`` and implement the three moves.

    ``needs_host_layout``: the backend reads split sizes on the host (one sync per
    ``prepare``; not capturable in a CUDA graph).
    """

    name = "base"
    needs_host_layout = True

    def __init__(self, ctx: EPContext):
        self.ctx = ctx

    def alloc_rows(self, rows: int, width: Optional[int] = None, dtype: Optional[torch.dtype] = None):
        """A zeroed [rows, width] buffer the backend can write into (symm backends: symmetric)."""
        shape = (rows,) if width is None else (rows, width)
        return torch.zeros(shape, dtype=dtype or self.ctx.cfg.dtype, device=self.ctx.device)

    def on_prepare(self, handle) -> None:
        """Called at the end of ``prepare`` (e.g. to push metadata to peers)."""

    def check(self, layer: str) -> None:
        """Raises what this backend saw on device since the last call (``ExpertDispatcher.check``,
        a host sync point), naming ``layer``."""

    def wire_rows(self, handle, move: str) -> list[int]:
        """Rows of width H this rank's tokens move between it and each rank over the
        interconnect in ``move`` (``"dispatch"``: sent to that rank; ``"combine"``: received
        from it), this rank's own entry 0: what benchmarks count as the bytes a move moves
        (host values; not for the step). Here: one row per pair to another rank."""
        lay = handle.layout
        counts = torch.bincount(lay.pair_rank[lay.pair_row >= 0], minlength=self.ctx.world_size)
        counts[self.ctx.rank] = 0
        return counts.tolist()

    def tune(self, **options) -> None:
        """Changes launch options from the next move on (see each backend); none here."""
        if options:
            raise ValueError(f"EP backend {self.name!r} takes no tune() options, got {sorted(options)}")

    def dispatch(self, x: torch.Tensor, w: Optional[torch.Tensor], handle, out_x: torch.Tensor,
                 out_w: Optional[torch.Tensor]) -> None:
        """Writes row ``pair_row[t*K+k]`` of rank ``pair_rank[...]``'s ``out_x`` with ``x[t]``
        (``out_w`` with ``w[t, k]``); rows past the valid ones end zero."""
        raise NotImplementedError

    def combine(self, y: torch.Tensor, handle, out: torch.Tensor) -> None:
        """``out[t] = sum_k y_of(pair_rank, pair_row)[t*K+k]`` (fp32 sum in k order)."""
        raise NotImplementedError

    def combine_pairs(self, v: torch.Tensor, handle, out: torch.Tensor) -> None:
        """``out[t, k] = v_of(pair_rank, pair_row)[t*K+k]`` (0 for pairs not sent)."""
        raise NotImplementedError


def sum_pairs(per_pair: torch.Tensor, out: torch.Tensor) -> None:
    """``out[t] = per_pair[t, 0] + ... + per_pair[t, K-1]`` accumulated in fp32 (fp64 for fp64),
    one k at a time (``etp.kernels.gather_sum.sum_in_k_order``): the summation order every
    backend reproduces bit for bit."""
    out.copy_(sum_in_k_order(per_pair))


def first_pairs(key: torch.Tensor, sent: torch.Tensor) -> torch.Tensor:
    """[T, K] bool: the pair is sent and is the first of its token (in k order) with its
    ``key`` (the destination rank, or host): where a de-duplicated move sends the token."""
    K = key.shape[1]
    same = (key[:, :, None] == key[:, None, :]) & sent[:, None, :]
    earlier = torch.ones(K, K, dtype=torch.bool, device=key.device).tril(-1)
    return sent & ~(same & earlier).any(2)
