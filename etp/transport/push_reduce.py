"""The push reduce-scatter (the reduction of ``transport="copy_engine"``): no SMs while it overlaps.

[Note: push reduce-scatter]
A weight-gradient reduce-scatter beside the backward GEMMs costs the GEMMs SMs: NCCL's
kernels hold 16-24 SMs for the whole reduction, and a persistent GEMM that starts beside them
runs part of its tiles late. A pull over copy engines would still fence each reduction with
barrier kernels that spin on an SM each. Here nothing that overlaps a GEMM runs on an SM:

* on the RS side stream, right after the wgrad GEMM: for every peer ``p``, a copy-engine copy
  of the full gradient's rows of ``p`` into ``p``'s staging slot (a symmetric-memory buffer),
  then a fenced write that sets ``p``'s READY flag of the slot. Before the copies the stream
  waits on this rank's own flag pad until every peer has freed the slot.
  Waits and writes are stream memory operations (``etp.transport.stream_ops``): the stream's
  front end, no kernel; each side's are one batch (``MemoryOps``: one driver call, laid out once
  per slot, as the staging views are made once per slot and shape: an eager step issues these
  for every weight, and their host cost adds up).
* when the runtime finalizes the reduction (one weight later, on the compute stream): wait
  for the peers' READY flags of the slot, then one memory-bound kernel
  (``etp.kernels.sum_received.sum_received``) sums this rank's own rows and the received ones
  in fp32 and adds them into ``main_grad``, then fenced writes tell the peers the slot is
  free again. This kernel does take the SMs, but between GEMMs, not beside them: a pass
  over 6-12 bytes per shard element.

Flags are signals, not counters, so a CUDA graph that captured a reduction replays it
correctly however often it runs, and eager reductions may come between replays. A flag holds 1
("set") or 0, and whoever waits on it clears it right after the wait (a write of 0 on the same
stream; fenced like every stream write, since the v2 driver API takes no unfenced one):

* READY (in the consumer's pad, one per producer and slot) is set by the producer after its
  copy, waited on and cleared by the consumer before its sum;
* FREE (in the producer's pad, one per consumer and slot) starts set (``materialize``), is
  waited on and cleared by the producer before its copy into the slot, and set again by the
  consumer after its sum.

A flag can be set again only after it was cleared: a producer sets READY of slot ``s`` only
after clearing FREE of ``s``, which the consumer sets only after clearing READY of ``s``
earlier on its stream (the fenced FREE write orders that clear before it). So the k-th wait
on a slot's READY always pairs with the k-th push into it, whatever the values at capture.
Every rank issues the same reductions in the same order (the backward is the same program
everywhere), so the k-th reduction means the same weight on every rank; ``SLOTS`` staging
slots per peer (the k-th reduction takes slot ``k % SLOTS``) let a producer run one reduction
ahead of its slowest consumer. The staging holds ``SLOTS * (world - 1)`` shards of the
largest weight (reserved at wrap time); the wgrad buffers themselves are plain memory, since
no peer reads them.

A hazard of waiting on a flag: with CUDA's lazy module loading (the default),
the first launch of a kernel loads its module, and that blocks the host until the device can
take it, which a stream parked on an unsatisfied flag may delay. If what satisfies the flag is
enqueued by this same host later, that is a deadlock. So no kernel is launched for the first
time behind a wait: each specialization of the sum kernel is launched once on one element
before the first wait that precedes it (``_load_sum_kernel``).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from ..kernels.sum_received import sum_received
from ..streams import current_raw_stream, current_stream, current_stream_event
from .base import Handle, SixteenBitWireReduce
from .symm_pool import flag_pad, rendezvous_offset, symm_mem_module

__all__ = ["CopyEnginePushReduce"]

_READY, _FREE = 0, 1


class _SlotFences(NamedTuple):
    """One staging slot's flag operations (``stream_ops.MemoryOps`` each)."""

    push_free: object  # wait until every peer has summed what we put here last; clear those FREE flags
    push_ready: object  # set every peer's READY flag (fenced after the copies)
    receive: object  # wait for every peer's READY flag; clear them
    release: object  # set FREE at every peer (this rank has summed their rows)


class _PushHandle(Handle):
    """One pushed reduction, finished on the consumer's stream by ``wait``."""

    def __init__(self, transport, full, seq, target, divisor, event) -> None:
        self.transport, self.full, self.seq = transport, full, seq
        self.target, self.divisor, self.event = target, divisor, event
        self.result: torch.Tensor | None = None

    def wait(self) -> torch.Tensor | None:
        if self.result is not None:
            return self.result
        if self.event is not None:  # our pushes read ``full``: done before it goes back to the pool
            current_stream().wait_event(self.event)
        t = self.transport
        rows = self.full.shape[0] // t.world
        own = self.full[t.rank * rows : (t.rank + 1) * rows]
        with record_function("etp::reduce_scatter_push_sum"):
            out = self.target
            if out is None:  # no main_grad: the fp32 sum is rounded once, into the wire dtype
                out = torch.empty(own.shape, dtype=own.dtype, device=own.device)
            t._load_sum_kernel(own.dtype, out.dtype, self.target is not None)
            received = t._receive(self.full, rows, self.seq)
            sum_received(own, received, out, divisor=self.divisor, accumulate=self.target is not None)
            t._release(self.seq)
        self.result, self.full, self.event = out, None, None
        return out


class CopyEnginePushReduce(SixteenBitWireReduce):
    """Reduce-scatter by copy-engine pushes into the peers' staging and a local fp32 sum."""

    name = "copy_engine_push"
    label = "etp::reduce_scatter_push"
    SLOTS = 2

    def __init__(self, process_group, device: torch.device, num_ctas: int = 0) -> None:
        del num_ctas  # no reduction kernel beside the GEMMs: nothing to cap
        self.process_group, self.device = process_group, device
        self.rank = dist.get_rank(process_group)
        self.world = dist.get_world_size(process_group)
        self._reserved = 0  # bytes of the largest shard any registered weight reduces
        self._shard_bytes = 0  # ... that the staging was made for
        self._staging = None  # (local uint8 buffer, its peers' views by rank)
        self._flags = None  # (local int32 pad, the pads' addresses by rank)
        self._issued = 0
        self._loaded: set[tuple] = set()  # sum-kernel specializations launched once already
        self._fences: dict[int, _SlotFences] = {}  # slot -> its flag operations, laid out once
        self._views: dict[tuple, torch.Tensor] = {}  # (owner, slot, dtype, shape) -> staging view

    # ------------------------------------------------------------------ set-up (collective)
    def reserve(self, param: torch.Tensor, wire_dtype: torch.dtype) -> None:
        """Makes room in the staging for ``param``'s shard in ``wire_dtype``."""
        numel = torch.Size(param.etp_layout.shard_shape).numel()
        self._reserved = max(self._reserved, numel * torch.empty((), dtype=wire_dtype).element_size())

    def materialize(self) -> None:
        """Allocates and rendezvouses the flag pads and a staging big enough for every
        reserved shard (a collective over the group; again only when a wrap grew it)."""
        if self._reserved <= self._shard_bytes and self._flags is not None:
            return
        if self._flags is None:
            self._flags = flag_pad(self.process_group, self.device, 2 * self.world * self.SLOTS)
            self.init_flags(self._flags[0])
        if self._reserved > self._shard_bytes:
            shard_bytes = -(-self._reserved // 256) * 256
            nbytes = max(1, self.SLOTS * (self.world - 1) * shard_bytes)
            buffer = symm_mem_module(self.process_group).empty(nbytes, dtype=torch.uint8, device=self.device)
            handle, offset = rendezvous_offset(buffer, self.process_group)
            peers = [buffer if r == self.rank else handle.get_buffer(r, (nbytes,), torch.uint8, offset)
                     for r in range(self.world)]
            self._staging, self._shard_bytes = (buffer, peers), shard_bytes
            self._views.clear()  # views of the old staging
        torch.cuda.synchronize(self.device)  # every flag initialized before any peer may write one
        dist.barrier(group=self.process_group)

    def init_flags(self, pad: torch.Tensor) -> None:
        """This rank's flag pad before any reduction: READY clear, FREE set (every slot free)."""
        pad.zero_()
        pad[self.world * self.SLOTS :].fill_(1)

    # ------------------------------------------------------------------ the three steps
    def _flag(self, owner: int, kind: int, other: int, slot: int) -> int:
        """Address of ``owner``'s flag ``kind`` about rank ``other`` and ``slot``: READY is
        written by the producer ``other``, FREE by the consumer ``other``."""
        return self._flags[1][owner] + 4 * ((kind * self.world + other) * self.SLOTS + slot)

    def _slot_view(self, owner: int, seq: int, full: torch.Tensor, rows: int) -> torch.Tensor:
        """``owner``'s staging of sequence ``seq``: ``[world - 1, rows, ...]`` of ``full``'s
        dtype; index ``k`` holds the rows sent by the rank ``k + 1`` before ``owner``."""
        key = (owner, seq % self.SLOTS, full.dtype, rows, full.shape[1:])
        view = self._views.get(key)
        if view is None:
            start = (seq % self.SLOTS) * (self.world - 1) * self._shard_bytes
            nbytes = (self.world - 1) * rows * full[0].numel() * full.element_size()
            region = self._staging[1][owner][start : start + nbytes]
            view = self._views[key] = region.view(full.dtype).view(self.world - 1, rows, *full.shape[1:])
        return view

    def _slot_fences(self, slot: int) -> "_SlotFences":
        """``slot``'s four flag-operation batches, laid out once (``stream_ops.MemoryOps``; the
        flags' addresses are fixed once materialized)."""
        fences = self._fences.get(slot)
        if fences is None:
            from .stream_ops import WAIT_GEQ, WRITE, MemoryOps

            to = [(self.rank + k) % self.world for k in range(1, self.world)]  # the peers pushed to
            by = [(self.rank - k) % self.world for k in range(1, self.world)]  # the peers pushing here
            frees = [self._flag(self.rank, _FREE, peer, slot) for peer in to]
            readies = [self._flag(self.rank, _READY, peer, slot) for peer in by]
            fences = self._fences[slot] = _SlotFences(
                push_free=MemoryOps([(WAIT_GEQ, f, 1) for f in frees] + [(WRITE, f, 0) for f in frees]),
                push_ready=MemoryOps([(WRITE, self._flag(peer, _READY, self.rank, slot), 1) for peer in to]),
                receive=MemoryOps([(WAIT_GEQ, r, 1) for r in readies] + [(WRITE, r, 0) for r in readies]),
                release=MemoryOps([(WRITE, self._flag(peer, _FREE, self.rank, slot), 1) for peer in by]))
        return fences

    def _push(self, full: torch.Tensor, rows: int, seq: int) -> None:
        fences, stream = self._slot_fences(seq % self.SLOTS), current_raw_stream()
        fences.push_free.enqueue(stream)
        for k in range(1, self.world):
            peer = (self.rank + k) % self.world
            self._slot_view(peer, seq, full, rows)[k - 1].copy_(full[peer * rows : (peer + 1) * rows])
        fences.push_ready.enqueue(stream)

    def _load_sum_kernel(self, wire: torch.dtype, out: torch.dtype, accumulate: bool) -> None:
        """Launches the sum kernel's specialization once on one element (see the module doc)."""
        key = (wire, out, accumulate)
        if key in self._loaded:
            return
        self._loaded.add(key)
        one = torch.zeros(1, dtype=wire, device=self.device)
        sum_received(one, torch.zeros((self.world - 1, 1), dtype=wire, device=self.device),
                     torch.zeros(1, dtype=out, device=self.device), accumulate=accumulate)

    def _receive(self, full: torch.Tensor, rows: int, seq: int) -> torch.Tensor:
        self._slot_fences(seq % self.SLOTS).receive.enqueue(current_raw_stream())
        return self._slot_view(self.rank, seq, full, rows)

    def _release(self, seq: int) -> None:
        self._slot_fences(seq % self.SLOTS).release.enqueue(current_raw_stream())

    def reduce_scatter(self, full, group, target, mean, async_op) -> Handle:
        rows = full.shape[0] // self.world
        nbytes = rows * full[0].numel() * full.element_size()
        if self._staging is not None and nbytes > self._shard_bytes:
            raise RuntimeError(f"etp push reduce: a {nbytes}-byte shard exceeds the {self._shard_bytes}-byte "
                               "staging reserved at wrap time (an etp bug)")
        seq = self._issued
        self._issued += 1
        with record_function(self.label):
            self._push(full, rows, seq)
        event = current_stream_event(full.device) if async_op else None
        handle = _PushHandle(self, full, seq, target, float(self.world) if mean else 1.0, event)
        if not async_op:
            handle.wait()
        return handle

    def nbytes(self) -> int:
        """The staging and flag pads (symmetric memory, outside torch's allocator)."""
        staging = 0 if self._staging is None else self._staging[0].numel()
        return staging + (0 if self._flags is None else self._flags[0].numel() * 4)
