"""The NCCL transports (also the gloo / CPU path): the process group's own collectives
(``etp.collectives``)."""
from __future__ import annotations

import logging

import torch

from ..collectives import all_gather_rows, reduce_scatter_rows
from .base import DoneHandle, GatherTransport, Handle, ReduceTransport

__all__ = ["NCCLGather", "NCCLReduce"]

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

    def reduce_scatter(self, full, group, target, mean, async_op) -> Handle:
        out = torch.empty((full.shape[0] // group.size, *full.shape[1:]), dtype=full.dtype, device=full.device)
        out, work = reduce_scatter_rows(full, group, out=out, async_op=async_op)

        def finish():
            if mean:
                out.div_(group.size)
            if target is None:
                return out
            target.add_(out)
            return target

        return _WorkHandle(out, work, finish)
