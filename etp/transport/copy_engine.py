"""The copy-engine gather: peer copies out of symmetric memory, no SMs.

Each rank's wire shard (the bf16 parameter itself, or the FP8 shard written by
``etp.quantize_shards``) lives in a slot of the group's ``SymmetricPool``; the parameter's
storage *is* that slot when the wire dtype is the parameter's (set up by
``etp.transport.setup``), so the optimizer's update needs no copy. A gather is, on the
current (AG side) stream::

    fence     -- every peer's stream reached this gather: its shard is written
    copy_     -- one cudaMemcpyAsync per rank, peer slot -> rows of the ticket buffer
    fence     -- every peer finished reading this rank's shard (it may be overwritten)

The fences are stream flag operations (``FlagBarrier``: a fenced write into each peer's pad,
a wait on this rank's own; no kernel), and the copies run on the copy engines, so a GEMM
beside the gather keeps all its SMs. While a CUDA graph is being captured the fences are
symmetric-memory barrier kernels instead (one CTA each, spinning until the peers arrive:
7.1 ms per step of them beside the expert stack's GEMMs on 2 x H200, session 9), since flag
values would be baked into the graph. Each stream that gathers gets its own channel
(assigned in first-use order, the same on every rank), so a synchronous gather on the
compute stream never pairs with a prefetch's fence.
"""
from __future__ import annotations

import torch
from torch.autograd.profiler import record_function

from .base import DoneHandle, EventHandle, GatherTransport, Handle, record_event
from .flag_barrier import FlagBarrier
from .symm_pool import SymmetricPool

__all__ = ["CopyEngineGather"]


class CopyEngineGather(GatherTransport):
    """Gathers out of the group's symmetric pools (one slot per param, keyed by ``id(param)``)."""

    name = "copy_engine"
    #: "flags" (stream flag operations, no SM; kernel barriers while capturing) or "kernel"
    #: (symmetric-memory barrier kernels always: the session-9 behaviour, kept to measure against)
    fence = "flags"
    #: Copy this rank's own rows on a companion stream while this stream pulls the peers' rows
    #: (joined by an event before the closing fence). Off by default: not yet measured. Session
    #: 11's trace of the bf16 expert stack had the compute stream waiting 3.9 ms per step on
    #: gathers, each of which ran its own-rows copy (130 us for an fc1 shard on H100) before
    #: its peer pull (510 us) on one stream.
    own_copy_beside = False

    def __init__(self, process_group, device: torch.device) -> None:
        self.process_group, self.device = process_group, device
        # One pool per wrap call (normally one): slots are reserved, then materialized once.
        self.pools: list[SymmetricPool] = []
        self._pool_of: dict[object, SymmetricPool] = {}
        self._key_of_ptr: dict[int, tuple[object, SymmetricPool]] = {}
        self._channels: dict[int, int] = {}
        self._flags: FlagBarrier | None = None

    def register(self, param: torch.Tensor, wire_dtype: torch.dtype) -> None:
        """Reserves ``param``'s home slot ``[shard_rows, cols]`` of ``wire_dtype``."""
        if id(param) in self._pool_of:
            return
        if not self.pools or self.pools[-1].buffer is not None:
            self.pools.append(SymmetricPool(self.process_group, self.device))
        self.pools[-1].reserve(id(param), param.etp_layout.shard_shape, wire_dtype)
        self._pool_of[id(param)] = self.pools[-1]

    def materialize(self) -> None:
        """Allocates and rendezvouses the pending pool (a collective over the group)."""
        if not self.pools or self.pools[-1].buffer is not None:
            return
        pool = self.pools[-1]
        pool.materialize()
        if self._flags is None and self.device.type == "cuda":
            self._flags = FlagBarrier(self.process_group, self.device)
            self._flags.materialize()
        for key in pool.keys():
            self._key_of_ptr[pool.slot(key).data_ptr()] = (key, pool)

    def home(self, param: torch.Tensor) -> torch.Tensor | None:
        pool = self._pool_of.get(id(param))
        return None if pool is None or pool.buffer is None else pool.slot(id(param))

    def _channel(self) -> tuple[int, int]:
        """The current stream's fence channel and its raw handle."""
        stream = torch.cuda.current_stream(self.device).cuda_stream
        return self._channels.setdefault(stream, len(self._channels)), stream

    def _fence(self, pool: SymmetricPool, channel: int, stream: int, capturing: bool) -> None:
        if self._flags is None or self.fence == "kernel" or capturing:
            pool.barrier(channel)
        else:
            self._flags(channel, stream)

    def _copy_own_beside(self, source, out, rank: int, rows: int):
        """Copies this rank's rows into ``out`` on the current stream's companion stream (it needs
        no peer, so it runs before the opening fence and beside the peer pulls); returns the
        event the current stream waits on before its closing fence. ``out`` and ``source`` were
        ready on the current stream (the runtime's events), hence the companion waits on it."""
        from ..streams import companion_stream

        current = torch.cuda.current_stream(self.device)
        beside = companion_stream(current)
        beside.wait_stream(current)
        with torch.cuda.stream(beside):
            out[rank * rows : (rank + 1) * rows].copy_(source)
            return record_event(out.device)

    def gather(self, source, group, out, async_op) -> Handle:
        found = self._key_of_ptr.get(source.data_ptr())
        if found is None:
            raise RuntimeError(
                "etp copy-engine gather: the source shard is not in the symmetric pool "
                "(the runtime stages it there; this is an etp bug)"
            )
        key, pool = found
        rows = source.shape[0]
        channel, stream = self._channel()
        capturing = out.is_cuda and torch.cuda.is_current_stream_capturing()
        with record_function("etp::all_gather_copy_engine"):
            beside = self.own_copy_beside and out.is_cuda
            own_done = self._copy_own_beside(source, out, group.rank, rows) if beside else None
            self._fence(pool, channel, stream, capturing)
            for step in range(group.size):
                peer = (group.rank + step) % group.size
                if peer == group.rank and own_done is not None:
                    continue
                src = source if peer == group.rank else pool.peer(key, peer)
                out[peer * rows : (peer + 1) * rows].copy_(src)
            if own_done is not None:
                torch.cuda.current_stream(self.device).wait_event(own_done)
            self._fence(pool, channel, stream, capturing)
        if not async_op:
            return DoneHandle(out)
        return EventHandle(out, record_event(out.device), keep=(source,))

    def nbytes(self) -> int:
        flags = 0 if self._flags is None else self._flags.nbytes()
        return sum(pool.nbytes() for pool in self.pools) + flags
