"""CUDA stream memory operations: a stream writes or waits on a 32-bit flag without an SM.

``cuStreamWriteValue32`` / ``cuStreamWaitValue32`` run in the stream's front end (the same
place as an event wait), so a fence built from them takes no SM from the GEMMs beside it,
unlike a symmetric-memory barrier, which is a one-CTA kernel that spins on an SM until every
peer arrives. The flag may be in a peer's memory (NVLink P2P): a write is preceded by a
memory fence, so whatever the stream did before it (a copy into the peer's buffer) is visible
to the peer once it sees the flag.

Called through ``ctypes`` on the driver library (torch does not expose the wait); the stream
is torch's current stream. Neither works on CPU tensors: callers choose these only where
symmetric memory is available.
"""
from __future__ import annotations

import ctypes
import functools

import torch

__all__ = ["wait_value_geq", "write_value"]

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0, wrap-safe
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: a memory fence precedes the write


@functools.lru_cache(maxsize=1)
def _driver():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:  # pragma: no cover - only without an NVIDIA driver
        raise RuntimeError(f"etp stream memory operations need the CUDA driver library: {exc}") from exc
    ops = {}
    for name in ("cuStreamWaitValue32", "cuStreamWriteValue32"):
        fn = getattr(lib, name + "_v2", None) or getattr(lib, name)  # _v2: CUDA >= 11.7 drivers
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
        ops[name] = fn
    return ops


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"etp: {what} failed with CUDA driver error {result} (CUresult)")


def _handle(stream: torch.cuda.Stream | int | None) -> int:
    # An int is a raw cudaStream_t (``stream.cuda_stream``): callers that issue several
    # operations look the stream up once (``torch.cuda.current_stream()`` costs ~8 us of host).
    if isinstance(stream, int):
        return stream
    return (stream or torch.cuda.current_stream()).cuda_stream


def wait_value_geq(address: int, value: int, stream: torch.cuda.Stream | int | None = None) -> None:
    """Makes ``stream`` (default: current; or a raw ``cuda_stream`` handle) wait until the uint32
    at device ``address`` is ``>= value`` (modulo 2**32, as a signed difference). No kernel, no SM."""
    _check(_driver()["cuStreamWaitValue32"](_handle(stream), address, value & 0xFFFFFFFF, _WAIT_GEQ),
           f"cuStreamWaitValue32(address {address:#x}, >= {value})")


def write_value(address: int, value: int, stream: torch.cuda.Stream | int | None = None) -> None:
    """Enqueues on ``stream`` (default: current; or a raw ``cuda_stream`` handle) a fenced write of
    ``value`` to the uint32 at device ``address`` (this GPU's or a peer's). No kernel, no SM."""
    _check(_driver()["cuStreamWriteValue32"](_handle(stream), address, value & 0xFFFFFFFF, _WRITE_DEFAULT),
           f"cuStreamWriteValue32(address {address:#x}, {value})")
