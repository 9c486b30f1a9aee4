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

from ..streams import current_raw_stream
from .driver import bind
from .driver import check as _check

__all__ = ["stream_handle", "wait_value_geq", "write_value"]

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0, wrap-safe
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: a memory fence precedes the write


@functools.lru_cache(maxsize=1)
def _driver():
    signature = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    # _v2: CUDA >= 11.7 drivers
    return bind({"cuStreamWaitValue32": signature, "cuStreamWriteValue32": signature}, prefer_v2=True)


def stream_handle(stream: torch.cuda.Stream | int | None) -> int:
    """The raw ``cudaStream_t`` of ``stream``: an int is one already (callers that issue several
    operations look the stream up once), None is the current stream (``etp.streams``' lookup,
    no ``Stream`` object made)."""
    if isinstance(stream, int):
        return stream
    return stream.cuda_stream if stream is not None else current_raw_stream()


def wait_value_geq(address: int, value: int, stream: torch.cuda.Stream | int | None = None) -> None:
    """Makes ``stream`` (default: current; or a raw ``cuda_stream`` handle) wait until the uint32
    at device ``address`` is ``>= value`` (modulo 2**32, as a signed difference). No kernel, no SM."""
    _check(_driver()["cuStreamWaitValue32"](stream_handle(stream), address, value & 0xFFFFFFFF, _WAIT_GEQ),
           f"cuStreamWaitValue32(address {address:#x}, >= {value})")


def write_value(address: int, value: int, stream: torch.cuda.Stream | int | None = None) -> None:
    """Enqueues on ``stream`` (default: current; or a raw ``cuda_stream`` handle) a fenced write of
    ``value`` to the uint32 at device ``address`` (this GPU's or a peer's). No kernel, no SM."""
    _check(_driver()["cuStreamWriteValue32"](stream_handle(stream), address, value & 0xFFFFFFFF, _WRITE_DEFAULT),
           f"cuStreamWriteValue32(address {address:#x}, {value})")
