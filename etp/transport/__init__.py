"""etp.transport: how ETP moves weight and gradient bytes. See [Note: ETP transports] in
``etp/transport/base.py`` and docs/transport.md.

``choose_transports(config, group, device)`` picks the gather and reduce transports of one
shard group once, at wrap time (a collective over the group on CUDA: it may compare host
names, rendezvous symmetric memory or create a capped communicator).
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
from .nccl import NCCLGather, NCCLReduce, capped_nccl_group, nccl_options

__all__ = [
    "DoneHandle",
    "EventHandle",
    "GatherTransport",
    "Handle",
    "ReduceTransport",
    "Transports",
    "choose_transports",
    "nccl_options",
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


def _refuse(key: str, value: str, why: str) -> ValueError:
    return ValueError(
        f"ETPConfig.{key}={value!r} needs CUDA tensors on an NCCL process group of GPUs on one "
        f"host (torch symmetric memory over NVLink), but here: {why}. Use {key}='auto' (picks "
        f"nccl here) or {key}='nccl'"
    )


def choose_transports(config: ETPConfig, group: ShardGroup, device: torch.device) -> Transports:
    """The transports of ``group`` for ``config`` (a collective over the group on CUDA)."""
    symm_reductions = ("symm_triton", "copy_engine", "copy_engine_push")
    maybe_symm = (config.transport in ("auto", "copy_engine")
                  or config.reduce_transport in (*symm_reductions, "auto"))
    ok, why = symmetric_memory_status(group, device) if maybe_symm else (False, "not asked for")
    if config.transport == "copy_engine" and not ok:
        raise _refuse("transport", config.transport, why)
    if config.reduce_transport in symm_reductions and not ok:
        raise _refuse("reduce_transport", config.reduce_transport, why)
    reasons = []
    if config.transport == "copy_engine" or (config.transport == "auto" and ok):
        from .copy_engine import CopyEngineGather

        gather: GatherTransport = CopyEngineGather(group.ag_group, device, alias_own_rows=config.alias_own_rows)
        reasons.append(f"copy_engine: {why}")
    else:
        gather = NCCLGather()
        reasons.append("nccl: " + ("configured" if config.transport == "nccl" else why))
    reduce_name = config.reduce_transport
    if reduce_name == "auto":
        # The push reduce-scatter where symmetric memory is available, else NCCL. BENCHMARKS.md:
        # session 11 (2xH100), the flagship recipe at world 2 10% faster than with NCCL and 2.8
        # GiB less peak memory; session 9 (2xH200), the expert stack at 0.855x of no
        # communication against capped NCCL's 0.791x.
        # Its flags are signals a CUDA graph replays correctly ([Note: push reduce-scatter]).
        reduce_name = "copy_engine_push" if ok else "nccl"
        reasons.append(f"reduce {reduce_name}: " + (why if ok else f"no symmetric memory ({why})"))
    if reduce_name == "copy_engine_push":
        from .push_reduce import CopyEnginePushReduce

        reduce: ReduceTransport = CopyEnginePushReduce(group.rs_group, device)
    elif reduce_name in symm_reductions:
        from .symm_reduce import CopyEngineReduce, SymmTritonReduce

        cls = SymmTritonReduce if reduce_name == "symm_triton" else CopyEngineReduce
        reduce = cls(group.rs_group, device, config.reduce_ctas)
    elif reduce_name == "nccl_capped":
        if device.type != "cuda":
            raise ValueError(
                f"ETPConfig.reduce_transport='nccl_capped' needs CUDA tensors and NCCL (here: "
                f"{device.type}): use reduce_transport='auto' or 'nccl'"
            )
        reduce = NCCLReduce(capped_nccl_group(group, config.reduce_ctas), name="nccl_capped")
    else:
        reduce = NCCLReduce()
    chosen = Transports(gather, reduce, "; ".join(reasons))
    log.info("etp transport: %s", chosen.describe(group.ranks))  # once: wrap time only
    return chosen
