"""etp.transport: how ETP moves weight and gradient bytes. See [Note: ETP transports] in
``etp/transport/base.py`` and docs/transport.md.

``choose_transports(config, group, device)`` picks the gather and reduce transports of one
shard group once, at wrap time (a collective over the group on CUDA: it compares host names
and may rendezvous symmetric memory).
"""
from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import ETPConfig
from ..groups import ShardGroup
from .base import DoneHandle, EventHandle, GatherTransport, Handle, ReduceTransport
from .nccl import NCCLGather, NCCLReduce

__all__ = [
    "DoneHandle",
    "EventHandle",
    "GatherTransport",
    "Handle",
    "ReduceTransport",
    "Transports",
    "choose_transports",
    "symmetric_memory_status",
]

log = logging.getLogger("etp.transport")


@dataclass
class Transports:
    """The gather and reduce transports of one shard group, and why they were chosen."""

    gather: GatherTransport
    reduce: ReduceTransport
    reason: str

    def describe(self, ranks) -> str:
        return f"group {tuple(ranks)}: gather={self.gather.name} reduce={self.reduce.name} ({self.reason})"


def symmetric_memory_status(group: ShardGroup, device: torch.device) -> tuple[bool, str]:
    """Whether ``group`` can use torch symmetric memory on ``device``, and why (not).

    On CUDA with an NCCL group this compares host names over the group (a collective)."""
    if device.type != "cuda":
        return False, f"tensors on {device.type}, not CUDA"
    if group.ag_group is None:
        return False, "no process group"
    backend = str(dist.get_backend(group.ag_group)).lower()
    if "nccl" not in backend:
        return False, f"process-group backend {backend}, not nccl"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return False, "this torch has no torch.distributed._symmetric_memory"
    hosts: list = [None] * group.size
    dist.all_gather_object(hosts, socket.gethostname(), group=group.ag_group)
    if len(set(hosts)) > 1:
        return False, f"group spans {len(set(hosts))} hosts"
    return True, "NVLink peers of one host with torch symmetric memory"


def choose_transports(config: ETPConfig, group: ShardGroup, device: torch.device) -> Transports:
    """The transports of ``group`` for ``config`` (a collective over the group on CUDA).

    ``copy_engine`` (asked for, or ``auto`` where symmetric memory is available) is the
    copy-engine gather with the push reduce-scatter: both fenced by stream flag operations,
    neither on an SM, and both replayed by CUDA graphs. ``nccl`` is the process group's
    all-gather and reduce-scatter (and the CPU path)."""
    ok, why = (symmetric_memory_status(group, device) if config.transport in ("auto", "copy_engine")
               else (False, "configured"))
    if config.transport == "copy_engine" and not ok:
        raise ValueError(
            f"ETPConfig.transport='copy_engine' needs CUDA tensors on an NCCL process group of GPUs on one "
            f"host (torch symmetric memory over NVLink), but here: {why}. Use transport='auto' (picks nccl "
            "here) or transport='nccl'"
        )
    if ok:
        from .copy_engine import CopyEngineGather
        from .push_reduce import CopyEnginePushReduce

        gather = CopyEngineGather(group.ag_group, device)
        own_rows = "aliased" if gather.aliasing else f"copied ({gather.aliasing_reason})"
        chosen = Transports(gather, CopyEnginePushReduce(group.rs_group, device),
                            f"copy_engine: {why}; own rows {own_rows}")
    else:
        chosen = Transports(NCCLGather(), NCCLReduce(), "nccl: " + why)
    log.info("etp transport: %s", chosen.describe(group.ranks))  # once: wrap time only
    return chosen
