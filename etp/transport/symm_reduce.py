"""Reduce transports over symmetric memory: ``symm_triton`` and ``copy_engine``.

Weight-gradient buffers come from a ``WgradPool`` whose allocator places them in symmetric
memory (each rendezvoused once, when the pool first makes it; the pool keeps at most two
idle per shape, so this happens a bounded number of times). A reduction is, on the current
(RS side) stream::

    barrier   -- every peer's wgrad GEMM wrote its buffer
    middle    -- the peers' 16-bit slices of this rank's rows, summed in fp32, divided (mean)
                 and added into main_grad, by one of:
                 symm_triton: etp.kernels.symm_reduce, one kernel on ``reduce_ctas`` CTAs that
                              reads the peers' memory itself;
                 copy_engine: one cudaMemcpyAsync per peer (the copy engines: no SMs) into a
                              local staging buffer, then one local add per slice (SMs for a
                              memory-bound pass over this rank's rows only)
    barrier   -- every peer finished reading this rank's buffer (it may return to the pool)

The barriers run on one small signal allocation of the transport, so they pair up by issue
order, which is the same on every rank (the backward is the same program everywhere).
"""
from __future__ import annotations

import torch
from torch.autograd.profiler import record_function

from ..kernels.symm_reduce import symm_reduce_scatter
from ..streams import current_stream_event
from .base import EventHandle, Handle, SixteenBitWireReduce
from .symm_pool import rendezvous_offset, symm_mem_module

__all__ = ["CopyEngineReduce", "SymmTritonReduce"]

class _SymmetricWgradReduce(SixteenBitWireReduce):
    """Symmetric wgrad buffers, the barriers around a reduction, and its handle; subclasses
    give the middle step (``_reduce_rows``)."""

    label = "etp::reduce_scatter_symm"

    def __init__(self, process_group, device: torch.device, num_ctas: int) -> None:
        self.process_group = process_group
        self.device = device
        self.num_ctas = num_ctas
        self._symm_mem = symm_mem_module(process_group)
        # data_ptr -> (buffer, peer pointer table, rendezvous handle, byte offset in its block)
        self._buffers: dict[int, tuple] = {}
        signal = self._symm_mem.empty(16, dtype=torch.int32, device=device)
        self._signal = (signal, self._symm_mem.rendezvous(signal, process_group))

    def allocator(self):
        return self._allocate

    def _allocate(self, shape, dtype, device) -> torch.Tensor:
        buffer = self._symm_mem.empty(tuple(shape), dtype=dtype, device=device)
        # The buffer may start inside a larger symmetric block: offset every peer alike.
        handle, offset = rendezvous_offset(buffer, self.process_group)
        table = torch.tensor([p + offset for p in handle.buffer_ptrs], dtype=torch.int64, device=device)
        self._buffers[buffer.data_ptr()] = (buffer, table, handle, offset)
        return buffer

    def reduce_scatter(self, full, group, target, mean, async_op) -> Handle:
        entry = self._buffers.get(full.data_ptr())
        if entry is None:
            raise RuntimeError(f"etp {self.name} reduce: the wgrad is not a symmetric pool buffer (an etp bug)")
        rows = full.shape[0] // group.size
        out = target
        if out is None:  # no main_grad: the fp32 sum is rounded once, into the wire dtype
            out = torch.empty((rows, *full.shape[1:]), dtype=full.dtype, device=full.device)
        barrier = self._signal[1]
        with record_function(self.label):
            barrier.barrier(channel=0)
            keep = self._reduce_rows(entry, full, group, out, divisor=float(group.size) if mean else 1.0,
                                     accumulate=target is not None)
            barrier.barrier(channel=0)
        event = current_stream_event(full.device) if async_op else None
        return EventHandle(out, event, keep=(full, *keep))

    def _reduce_rows(self, entry, full, group, out, divisor: float, accumulate: bool) -> tuple:
        """Writes (or adds, ``accumulate``) the fp32 sum over ranks of this rank's rows,
        divided by ``divisor``, into ``out``; returns tensors to keep alive until done."""
        raise NotImplementedError

    def nbytes(self) -> int:
        """Every symmetric wgrad buffer made (the runtime's pool for this group keeps them)."""
        return sum(entry[0].numel() * entry[0].element_size() for entry in self._buffers.values())


class SymmTritonReduce(_SymmetricWgradReduce):
    """Reduce-scatter by ``symm_reduce_scatter`` on ``num_ctas`` CTAs."""

    name = "symm_triton"
    label = "etp::reduce_scatter_symm_triton"

    def _reduce_rows(self, entry, full, group, out, divisor, accumulate):
        symm_reduce_scatter(entry[1], full, group.rank, out, divisor=divisor, accumulate=accumulate,
                            num_ctas=self.num_ctas, impl="triton")
        return ()


class CopyEngineReduce(_SymmetricWgradReduce):
    """Reduce-scatter by copy-engine pulls of the peers' slices and local fp32 adds."""

    name = "copy_engine"
    label = "etp::reduce_scatter_copy_engine"

    def _peer_rows(self, entry, full, peer: int, rows: int) -> torch.Tensor:
        """Rank ``peer``'s rows ``[rank * rows, (rank + 1) * rows)`` of its wgrad buffer (a
        view this rank can read: peer memory over NVLink)."""
        _, _, handle, offset = entry
        nbytes = full.numel() * full.element_size()
        whole = handle.get_buffer(peer, (nbytes,), torch.uint8, offset).view(full.dtype).view(full.shape)
        rank = handle.rank
        return whole[rank * rows : (rank + 1) * rows]

    def _reduce_rows(self, entry, full, group, out, divisor, accumulate):
        rows = full.shape[0] // group.size
        own = full[group.rank * rows : (group.rank + 1) * rows]
        peers = [(group.rank + step) % group.size for step in range(1, group.size)]
        staged = torch.empty((len(peers), *own.shape), dtype=full.dtype, device=full.device)
        for index, peer in enumerate(peers):
            staged[index].copy_(self._peer_rows(entry, full, peer, rows))  # cudaMemcpyAsync: copy engine
        # Sums in fp32 (or the wire dtype when wider) in a fixed order (this rank's rows, then
        # the peers by distance), each term scaled by 1 / divisor: straight into a main_grad of
        # that dtype, else through one temporary.
        scale = 1.0 / divisor
        terms = [own, *staged.unbind(0)]
        dtype = torch.promote_types(full.dtype, torch.float32)
        if accumulate and out.dtype == dtype:
            for term in terms:
                out.add_(term, alpha=scale)
            return (staged,)
        total = torch.zeros(own.shape, dtype=dtype, device=own.device)
        for term in terms:
            total.add_(term, alpha=scale)
        if accumulate:
            out.add_(total)
        else:
            out.copy_(total)
        return (staged, total)
