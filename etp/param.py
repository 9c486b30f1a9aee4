"""ETPShardedParam: an ``nn.Parameter`` that holds this rank's row shard of a weight.

It knows its layout, group and config, never the engine that drives it: the runtime is
attached as ``etp_runtime`` by ``etp.wrap.shard_parameter``.

Optimizers, DDP buffers and ``state_dict`` see only the shard ``[shard_rows, cols]``; the
full weight exists only transiently, gathered just before its GEMM (see ``etp.autograd``).
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from .collectives import all_gather_rows
from .config import ETPConfig
from .groups import ShardGroup
from .layout import ShardLayout

__all__ = ["ETPShardedParam"]


class ETPShardedParam(nn.Parameter):
    """This rank's padded row shard of a weight. See [Note: ETP shard layout].

    Attributes:
        etp_layout: the ``ShardLayout`` (logical shape, padding, this rank's rows).
        etp_group: the ``ShardGroup`` that holds the other shards.
        etp_config: the ``ETPConfig`` it was sharded with (reduction, gather dtype).
        etp_runtime: the ``ETPRuntime`` that gathers and reduce-scatters it.

    Create it with ``shard_parameter`` (or ``wrap_module_params_etp``), not directly.

    Example::

        shard = shard_parameter(linear.weight, groups.dense, ETPConfig(etp_size=4))
        shard.logical_shape, shard.shape   # (1000, 512), torch.Size([256, 512])
        full = shard.full_tensor()         # collective: every rank of the group calls it
    """

    etp_layout: ShardLayout
    etp_group: ShardGroup
    etp_config: ETPConfig

    def __new__(cls, data: torch.Tensor | None = None, requires_grad: bool = True):
        if data is None:
            data = torch.empty(0)
        return torch.Tensor._make_subclass(cls, data, requires_grad)

    # --------------------------------------------------------------- metadata
    @property
    def logical_shape(self) -> tuple[int, ...]:
        return self.etp_layout.logical_shape

    @property
    def padded_shape(self) -> tuple[int, int]:
        return self.etp_layout.padded_shape

    @property
    def row_range(self) -> tuple[int, int]:
        """This rank's rows ``[start, end)`` of the padded ``[rows, cols]`` view."""
        start = self.etp_layout.row_start
        return start, start + self.etp_layout.shard_rows

    @property
    def padding_rows(self) -> int:
        """Rows of this shard that are structural zeros (never written, never counted)."""
        return self.etp_layout.padding_rows

    @property
    def valid_shard(self) -> torch.Tensor:
        """The rows of this shard that hold logical data (padding excluded); a view."""
        return self.data[: self.etp_layout.valid_rows]

    # --------------------------------------------------------------- collectives
    def full_tensor(self) -> torch.Tensor:
        """Gathers the full logical weight (padding stripped) on every rank of the group.

        A collective: every rank of ``etp_group`` must call it.
        """
        gathered, _ = all_gather_rows(self.detach(), self.etp_group)
        return self.etp_layout.unpad(gathered).clone()

    # --------------------------------------------------------------- copying
    def __deepcopy__(self, memo: dict[int, Any]) -> "ETPShardedParam":
        if id(self) in memo:
            return memo[id(self)]
        result = type(self)(self.data.clone(memory_format=torch.preserve_format), self.requires_grad)
        memo[id(self)] = result
        for key, value in self.__dict__.items():
            # Process groups cannot be deep-copied; layout and config are immutable.
            result.__dict__[key] = value if key.startswith("etp_") else copy.deepcopy(value, memo)
        return result

    def __repr__(self) -> str:
        if "etp_layout" not in self.__dict__:
            return f"ETPShardedParam(unsharded, shape={tuple(self.shape)}, dtype={self.dtype})"
        return (
            f"ETPShardedParam(logical_shape={self.logical_shape}, shard={tuple(self.shape)}, "
            f"rank={self.etp_layout.rank}/{self.etp_layout.world}, dtype={self.dtype})"
        )
