"""ShardLayout: the arithmetic of cutting one weight into N equal, padded row shards.

[Note: ETP shard layout]
A weight of logical shape ``(d0, ..., dk, cols)`` is viewed as a row-major matrix of
``rows = d0 * ... * dk`` rows by ``cols`` columns (a 2-D weight ``[out, in]`` has
``rows = out``; stacked experts ``[E, out, in]`` have ``rows = E * out``). The rows are padded
with structural zeros up to ``padded_rows``, a multiple of ``align * N``, and rank ``r`` holds
the contiguous rows ``[r * shard_rows, (r + 1) * shard_rows)``. Every rank therefore holds an
equal shard (one all-gather / reduce-scatter of equal pieces, no ragged collectives), and
padding may cover whole ranks when ``rows < (N - 1) * shard_rows`` (dim0 = 1 with N = 4).

For stacked experts this is a split of the expert axis whenever ``N`` divides ``E`` and
``align`` divides ``out`` (each rank holds ``E / N`` whole experts), and otherwise a split of
the flattened rows. The alternative, cutting each expert's rows, moves the same bytes but
needs either E collectives or a gather into ``[N, E, out / N, in]`` followed by a permuting
copy of the full weight; the flattened cut needs one collective and the gathered buffer *is*
the ``[E, out, in]`` weight (a view, no copy).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["ShardLayout"]


@dataclass(frozen=True)
class ShardLayout:
    """Where one rank's shard of a weight lies. See [Note: ETP shard layout].

    Args:
        logical_shape: shape of the full, unpadded weight (at least 2-D).
        world: number of ranks that shard it (N).
        rank: this rank's index in the shard group.
        align: the shard holds a multiple of ``align`` rows (power of two).

    Example::

        layout = ShardLayout((1, 8), world=4, rank=0, align=16)
        layout.padded_rows, layout.shard_rows, layout.valid_rows  # (64, 16, 1)
    """

    logical_shape: tuple[int, ...]
    world: int
    rank: int
    align: int = 1

    def __post_init__(self) -> None:
        if len(self.logical_shape) < 2:
            raise ValueError(
                f"ETP shards weights of 2 or more dimensions; got shape {self.logical_shape}"
            )
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside the shard group of size {self.world}")
        if self.align <= 0:
            raise ValueError(f"align={self.align} must be positive")

    @property
    def rows(self) -> int:
        """Logical rows: the product of all dimensions but the last."""
        return math.prod(self.logical_shape[:-1])

    @property
    def cols(self) -> int:
        return self.logical_shape[-1]

    @property
    def padded_rows(self) -> int:
        unit = self.align * self.world
        return max(unit, -(-self.rows // unit) * unit)

    @property
    def shard_rows(self) -> int:
        return self.padded_rows // self.world

    @property
    def shard_shape(self) -> tuple[int, int]:
        return (self.shard_rows, self.cols)

    @property
    def padded_shape(self) -> tuple[int, int]:
        return (self.padded_rows, self.cols)

    @property
    def row_start(self) -> int:
        """First row of this rank's shard, in padded coordinates."""
        return self.rank * self.shard_rows

    @property
    def valid_rows(self) -> int:
        """Rows of this shard that hold real (logical) data; the rest are padding."""
        return max(0, min(self.row_start + self.shard_rows, self.rows) - self.row_start)

    @property
    def padding_rows(self) -> int:
        return self.shard_rows - self.valid_rows

    @property
    def numel(self) -> int:
        """Logical elements (padding excluded)."""
        return self.rows * self.cols

    def shard_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's padded shard of a full logical tensor (a new contiguous tensor)."""
        if tuple(full.shape) != tuple(self.logical_shape):
            raise ValueError(
                f"expected a tensor of the logical shape {self.logical_shape}, got {tuple(full.shape)}"
            )
        shard = full.new_zeros(self.shard_shape)
        if self.valid_rows:
            rows = full.reshape(self.rows, self.cols)
            shard[: self.valid_rows].copy_(rows[self.row_start : self.row_start + self.valid_rows])
        return shard

    def unpad(self, gathered: torch.Tensor) -> torch.Tensor:
        """The logical weight as a view of a gathered ``[padded_rows, cols]`` buffer."""
        return gathered[: self.rows].view(self.logical_shape)
