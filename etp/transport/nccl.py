"""The NCCL transports (also the gloo / CPU path): the process group's own collectives.

``NCCLGather`` / ``NCCLReduce`` are today's path (``etp.collectives``). ``capped_groups``
builds an extra reduce communicator per shard group whose NCCL config caps its CTAs
(``ProcessGroupNCCL.Options().config.max_ctas``: this communicator only, not the global
``NCCL_MAX_CTAS``), for the ``nccl_capped`` reduce transport.
"""
from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist

from ..collectives import all_gather_rows, reduce_scatter_rows
from ..groups import ShardGroup
from .base import DoneHandle, GatherTransport, Handle, ReduceTransport

__all__ = ["NCCLGather", "NCCLReduce", "capped_nccl_group", "nccl_options"]

log = logging.getLogger("etp.transport")


class _WorkHandle(DoneHandle):
    def __init__(self, result, work, then=None):
        super().__init__(result, then)
        self.work = work

    def wait(self):
        if self.work is not None:
            self.work.wait()  # the current stream waits for the collective
            self.work = None
        return super().wait()


class NCCLGather(GatherTransport):
    """``all_gather_into_tensor`` on the group's AG communicator."""

    name = "nccl"

    def gather(self, source, group, out, async_op) -> Handle:
        out, work = all_gather_rows(source, group, out=out, async_op=async_op)
        return _WorkHandle(out, work)


class NCCLReduce(ReduceTransport):
    """``reduce_scatter_tensor`` in the gradient's dtype, then divide and add on wait (the
    arithmetic of etp before transports, kept bit for bit)."""

    name = "nccl"

    def __init__(self, group_override: ShardGroup | None = None, name: str = "nccl"):
        self.group_override = group_override  # nccl_capped: the same ranks, capped comm
        self.name = name

    def reduce_scatter(self, full, group, target, mean, async_op) -> Handle:
        use = self.group_override or group
        out = torch.empty((full.shape[0] // group.size, *full.shape[1:]), dtype=full.dtype, device=full.device)
        out, work = reduce_scatter_rows(full, use, out=out, async_op=async_op)

        def finish():
            if mean:
                out.div_(group.size)
            if target is None:
                return out
            target.add_(out)
            return target

        return _WorkHandle(out, work, finish)


def nccl_options(max_ctas: int):
    """``ProcessGroupNCCL.Options`` whose communicator runs on at most ``max_ctas`` CTAs;
    None when this torch build has no per-communicator NCCL config."""
    options_type = getattr(getattr(dist, "ProcessGroupNCCL", None), "Options", None)
    if options_type is None:
        return None
    options = options_type()
    config = getattr(options, "config", None)
    if config is None or not hasattr(config, "max_ctas"):
        return None
    config.max_ctas = int(max_ctas)
    if hasattr(config, "min_ctas"):
        config.min_ctas = min(int(getattr(config, "min_ctas", 1) or 1), int(max_ctas))
    return options


def capped_nccl_group(group: ShardGroup, max_ctas: int) -> ShardGroup:
    """A ShardGroup over ``group``'s ranks whose RS communicator is capped at ``max_ctas``.

    A collective over the world (``dist.new_group``): every rank calls it, for its own
    group, in the same order; the partition is exchanged first so every rank creates every
    communicator in sorted order."""
    options = nccl_options(max_ctas)
    if options is None:
        raise ValueError(
            "ETPConfig.reduce_transport='nccl_capped' needs torch's ProcessGroupNCCL.Options()"
            ".config (torch >= 2.11 with NCCL): use reduce_transport='nccl' or 'auto'"
        )
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, tuple(group.ranks))
    mine = None
    for ranks in sorted({r for r in everyone if len(r) > 1}):
        made = dist.new_group(list(ranks), backend="nccl", pg_options=options)
        if ranks == tuple(group.ranks):
            mine = made
    log.info("etp transport: capped reduce communicator over %s (max_ctas=%d)", group.ranks, max_ctas)
    return dataclasses.replace(group, rs_group=mine)
