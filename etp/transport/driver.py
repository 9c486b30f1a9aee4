"""The CUDA driver library through ``ctypes``: what torch does not expose (stream memory
operations: ``etp.transport.stream_ops``; virtual memory mappings: ``etp.transport.vmm``)."""
from __future__ import annotations

import ctypes
import functools

__all__ = ["bind", "check"]


@functools.lru_cache(maxsize=1)
def _libcuda():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as exc:  # pragma: no cover - only without an NVIDIA driver
        raise RuntimeError(f"etp needs the CUDA driver library here: {exc}") from exc


def bind(signatures: dict[str, list], prefer_v2: bool = False) -> dict:
    """The driver functions named in ``signatures`` (name -> argtypes), returning CUresult; with
    ``prefer_v2`` a name's ``_v2`` variant where the driver has one."""
    lib, ops = _libcuda(), {}
    for name, argtypes in signatures.items():
        fn = (prefer_v2 and getattr(lib, name + "_v2", None)) or getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
        ops[name] = fn
    return ops


def check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"etp: {what} failed with CUDA driver error {result} (CUresult)")
