"""Backend registry: name -> class, and which names this machine and group can run."""
from __future__ import annotations

from etp.ep.backends.base import Backend, EPContext
from etp.ep.backends.nccl import NcclBackend, NcclPaddedBackend
from etp.ep.backends.reference import ReferenceBackend

__all__ = ["Backend", "EPContext", "available_backends", "backend_class", "symm_unavailable_reason",
           "unavailable_reason", "ALL_BACKENDS"]

#: Every backend name, in the order the profiler tries them.
ALL_BACKENDS = ("reference", "nccl", "nccl_padded", "symm_push", "symm_allgather", "symm_dedup", "hierarchical")


def _hosts(group, ranks_per_host) -> tuple[int, str]:
    """(hosts the group spans, '' or why that is unknown). See [Note: host groups]."""
    import torch.distributed as dist

    from etp.ep.backends.hosts import ranks_per_host as detect

    try:
        return dist.get_world_size(group) // detect(group, ranks_per_host), ""
    except ValueError as exc:
        return 0, str(exc)


def symm_unavailable_reason(group) -> str:
    """Why torch symmetric memory over NVLink cannot serve ``group`` here ('' if it can),
    hosts aside."""
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        return "no CUDA device"
    if dist.get_backend(group) != "nccl":
        return f"the process group's backend is {dist.get_backend(group)!r}, not nccl"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError as exc:  # pragma: no cover - torch without symmetric memory
        return f"torch has no symmetric memory ({exc})"
    return ""


def unavailable_reason(name: str, group, ranks_per_host=None) -> str:
    """Why ``name`` cannot run with ``group`` here ('' if it can); ``ranks_per_host`` as
    ``EPConfig.ranks_per_host`` (None: detected)."""
    if name not in ALL_BACKENDS:
        return f"unknown backend {name!r}; known: {', '.join(ALL_BACKENDS)}"
    if name.startswith("symm_"):
        reason = symm_unavailable_reason(group)
        if reason:
            return reason
        hosts, why = _hosts(group, ranks_per_host)
        if hosts != 1:
            return why or f"the group spans {hosts} hosts (symmetric memory needs one NVLink domain; use hierarchical)"
    if name == "hierarchical":
        hosts, why = _hosts(group, ranks_per_host)
        if hosts < 2:
            return why or ("the group is on one host (declare EPConfig.ranks_per_host to run it over simulated "
                           "hosts)")
    return ""


def available_backends(group, ranks_per_host=None) -> list[str]:
    """Backend names that can run with ``group`` on this machine."""
    return [name for name in ALL_BACKENDS if not unavailable_reason(name, group, ranks_per_host)]


def backend_class(name: str, group, ranks_per_host=None) -> type:
    """The class of backend ``name``; ValueError naming why when it cannot run here."""
    reason = unavailable_reason(name, group, ranks_per_host)
    if reason:
        raise ValueError(f"EP backend {name!r} is not available: {reason}. Available: "
                         f"{available_backends(group, ranks_per_host)}")
    if name == "reference":
        return ReferenceBackend
    if name == "nccl":
        return NcclBackend
    if name == "nccl_padded":
        return NcclPaddedBackend
    if name == "hierarchical":
        from etp.ep.backends.hierarchical import HierarchicalBackend

        return HierarchicalBackend
    from etp.ep.backends.symm import SYMM_BACKENDS

    return SYMM_BACKENDS[name]
