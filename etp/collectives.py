"""Stateless ETP collectives: row all-gather, row reduce-scatter, coalesced all-reduce.

Every function takes its group explicitly, keeps no state, and runs under an ``etp::``
profiler label so a trace reads by itself. With ``async_op=True`` the work handle is
returned; the caller owns waiting on it.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from .groups import ShardGroup

__all__ = ["all_gather_rows", "reduce_scatter_rows", "all_reduce_coalesced", "all_gather_tensor"]

_FLOAT8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)


# torch 2.13 renamed the tensor collectives (the old names warn); torch 2.11 has only those.
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _wire_view(tensor: torch.Tensor) -> torch.Tensor:
    # Gloo rejects float8 dtypes; the bytes are what travel, so move them as uint8.
    return tensor.view(torch.uint8) if tensor.dtype in _FLOAT8_DTYPES else tensor


def all_gather_rows(
    shard: torch.Tensor,
    group: ShardGroup,
    out: torch.Tensor | None = None,
    async_op: bool = False,
):
    """Gathers equal row shards ``[rows, cols]`` into ``[group.size * rows, cols]``.

    Returns ``(out, work)``; ``work`` is None unless ``async_op``.
    """
    if out is None:
        out = shard.new_empty((shard.shape[0] * group.size, *shard.shape[1:]))
    if group.size == 1:
        out.copy_(shard)
        return out, None
    with record_function("etp::all_gather"):
        work = all_gather_tensor(
            _wire_view(out), _wire_view(shard.contiguous()), group=group.ag_group, async_op=async_op
        )
    return out, work


def reduce_scatter_rows(
    full: torch.Tensor,
    group: ShardGroup,
    out: torch.Tensor | None = None,
    async_op: bool = False,
):
    """Sums ``[group.size * rows, cols]`` over the group, leaving this rank's ``[rows, cols]``.

    The sum runs in ``full``'s dtype: pass an fp32 ``full`` for fp32 accumulation. Mean
    reduction is the caller's division (see ``etp.autograd``), so that the same code serves
    gloo and NCCL. Returns ``(out, work)``.
    """
    rows = full.shape[0] // group.size
    if out is None:
        out = full.new_empty((rows, *full.shape[1:]))
    if group.size == 1:
        out.copy_(full)
        return out, None
    with record_function("etp::reduce_scatter"):
        work = _reduce_scatter_tensor(
            out, full.contiguous(), op=dist.ReduceOp.SUM, group=group.rs_group, async_op=async_op
        )
    return out, work


def all_reduce_coalesced(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    mean: bool,
) -> None:
    """All-reduces (sum, or mean when ``mean``) the tensors in place with one collective per
    dtype: they are flattened into one buffer, reduced, and copied back."""
    if group is None or dist.get_world_size(group) == 1 or not tensors:
        return
    size = dist.get_world_size(group)
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    with record_function("etp::all_reduce"):
        for bucket in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            if mean:
                flat.div_(size)
            offset = 0
            for tensor in bucket:
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
