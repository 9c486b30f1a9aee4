"""CUDA stream memory operations: a stream writes or waits on 32-bit flags without an SM.

``cuStreamBatchMemOp``'s waits and writes run in the stream's front end (the same place as
an event wait), so a fence built from them takes no SM from the GEMMs beside it, unlike a
symmetric-memory barrier, which is a one-CTA kernel that spins on an SM until every peer
arrives. A flag may be in a peer's memory (NVLink P2P): a write is preceded by a memory
fence, so whatever the stream did before it (a copy into the peer's buffer) is visible to the
peer once it sees the flag.

``MemoryOps`` lays a fixed sequence of them out once and enqueues it with one driver call:
a push reduce-scatter fences each weight with a dozen flag operations at world 4, and in an
eager step a driver call through ``ctypes`` (and the Python that builds its arguments) costs
the host more than the work it enqueues. Callers keep one ``MemoryOps`` per fixed sequence
(its addresses do not move) and change only values that do (a barrier's number).

Called through ``ctypes`` on the driver library (torch does not expose the wait); the stream
is torch's current stream or a raw handle. Neither works on CPU tensors: callers choose these
only where symmetric memory is available.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from ..streams import current_raw_stream
from .driver import bind
from .driver import check as _check

__all__ = ["WAIT_GEQ", "WRITE", "MemoryOps", "stream_handle"]

#: ``MemoryOps`` kinds: CU_STREAM_MEM_OP_WAIT_VALUE_32 and CU_STREAM_MEM_OP_WRITE_VALUE_32.
WAIT_GEQ, WRITE = 1, 2
# Operations per cuStreamBatchMemOp call: the driver takes fewer than 256.
_BATCH = 255


class _MemOp(ctypes.Structure):
    """One ``CUstreamBatchMemOpParams`` (a 48-byte union) as its wait / write member: the
    operation, the address, the value (a union of 32 and 64 bits: the low word on x86-64),
    the flags and an alias pointer the driver ignores here."""

    _fields_ = [("operation", ctypes.c_uint32), ("address", ctypes.c_uint64), ("value", ctypes.c_uint64),
                ("flags", ctypes.c_uint32), ("alias", ctypes.c_uint64), ("_pad", ctypes.c_uint64)]


assert ctypes.sizeof(_MemOp) == 48, "CUstreamBatchMemOpParams is 48 bytes"


@functools.lru_cache(maxsize=1)
def _driver():
    batch = [ctypes.c_void_p, ctypes.c_uint, ctypes.POINTER(_MemOp), ctypes.c_uint]
    # _v2: CUDA >= 11.7 drivers
    return bind({"cuStreamBatchMemOp": batch}, prefer_v2=True)


def stream_handle(stream: torch.cuda.Stream | int | None) -> int:
    """The raw ``cudaStream_t`` of ``stream``: an int is one already (callers that issue several
    operations look the stream up once), None is the current stream (``etp.streams``' lookup,
    no ``Stream`` object made)."""
    if isinstance(stream, int):
        return stream
    return stream.cuda_stream if stream is not None else current_raw_stream()


class MemoryOps:
    """A fixed sequence of ``(WAIT_GEQ or WRITE, address, value)`` flag operations on 32-bit
    device words (this GPU's or a peer's), laid out once as ``CUstreamBatchMemOpParams``;
    ``enqueue`` puts them on a stream in their order with one ``cuStreamBatchMemOp`` per 255.

    A wait holds the stream until ``(int32)(*address - value) >= 0`` (wrap-safe); a write is
    fenced (``CU_STREAM_WRITE_VALUE_DEFAULT``): everything the stream did before it is visible
    to whoever sees the value. No kernel, no SM.

    Example::

        fence = MemoryOps([(WAIT_GEQ, ready, 1), (WRITE, ready, 0), (WRITE, free, 1)])
        fence.enqueue()           # on the current stream
        fence.set_value(2)        # every operation's value, for the next enqueue
    """

    def __init__(self, ops) -> None:
        ops = list(ops)
        self._count = len(ops)
        self._params = (_MemOp * max(1, len(ops)))()
        for param, (kind, address, value) in zip(self._params, ops):
            if kind not in (WAIT_GEQ, WRITE):
                raise ValueError(f"MemoryOps: kind {kind!r}: expected WAIT_GEQ ({WAIT_GEQ}) or WRITE ({WRITE})")
            # flags 0: CU_STREAM_WAIT_VALUE_GEQ / CU_STREAM_WRITE_VALUE_DEFAULT (fenced)
            param.operation, param.address, param.value, param.flags = kind, address, value & 0xFFFFFFFF, 0
        size = ctypes.sizeof(_MemOp)
        self._chunks = [(min(_BATCH, len(ops) - first),
                         ctypes.cast(ctypes.addressof(self._params) + first * size, ctypes.POINTER(_MemOp)))
                        for first in range(0, len(ops), _BATCH)]

    def __len__(self) -> int:
        return self._count

    def set_value(self, value: int) -> None:
        """Sets every operation's value (taken modulo 2**32) for the enqueues that follow."""
        value &= 0xFFFFFFFF
        for index in range(self._count):
            self._params[index].value = value

    def enqueue(self, stream: torch.cuda.Stream | int | None = None) -> None:
        """Enqueues the operations on ``stream`` (default: current; or a raw handle)."""
        handle, batch = stream_handle(stream), _driver()["cuStreamBatchMemOp"]
        for count, params in self._chunks:
            result = batch(handle, count, params, 0)
            if result:
                _check(result, f"cuStreamBatchMemOp({count} operations)")
