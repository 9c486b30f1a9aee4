"""Backend registry: name -> class, and which names this machine can run."""
from __future__ import annotations

from etp.ep.backends.base import Backend, EPContext
from etp.ep.backends.nccl import NcclBackend, NcclPaddedBackend
from etp.ep.backends.reference import ReferenceBackend

__all__ = ["Backend", "EPContext", "available_backends", "backend_class", "ALL_BACKENDS"]

#: Every backend name, in the order the profiler tries them.
ALL_BACKENDS = ("reference", "nccl", "nccl_padded", "symm_push", "symm_allgather", "symm_dedup")


def _symm_available(group) -> tuple[bool, str]:
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if dist.get_backend(group) != "nccl":
        return False, f"the process group's backend is {dist.get_backend(group)!r}, not nccl"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError as exc:  # pragma: no cover - torch without symmetric memory
        return False, f"torch has no symmetric memory ({exc})"
    return True, ""


def unavailable_reason(name: str, group) -> str:
    """Why ``name`` cannot run with ``group`` here ('' if it can)."""
    if name not in ALL_BACKENDS:
        return f"unknown backend {name!r}; known: {', '.join(ALL_BACKENDS)}"
    if name.startswith("symm_"):
        return _symm_available(group)[1]
    return ""


def available_backends(group) -> list[str]:
    """Backend names that can run with ``group`` on this machine."""
    return [name for name in ALL_BACKENDS if not unavailable_reason(name, group)]


def backend_class(name: str, group) -> type:
    """The class of backend ``name``; ValueError naming why when it cannot run here."""
    reason = unavailable_reason(name, group)
    if reason:
        raise ValueError(f"EP backend {name!r} is not available: {reason}. Available: {available_backends(group)}")
    if name == "reference":
        return ReferenceBackend
    if name == "nccl":
        return NcclBackend
    if name == "nccl_padded":
        return NcclPaddedBackend
    from etp.ep.backends.symm import SYMM_BACKENDS

    return SYMM_BACKENDS[name]
