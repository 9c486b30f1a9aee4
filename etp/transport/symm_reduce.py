"""The ``symm_triton`` reduce transport: a few-CTA Triton reduce-scatter over symmetric memory.

Weight-gradient buffers come from a ``WgradPool`` whose allocator places them in symmetric
memory (each rendezvoused once, when the pool first makes it; the pool keeps at most two
idle per shape, so this happens a bounded number of times). A reduction is, on the current
(RS side) stream::

    barrier   -- every peer's wgrad GEMM wrote its buffer
    kernel    -- etp.kernels.symm_reduce: read every peer's slice of this rank's rows (16-bit
                 wire bytes), sum in fp32, divide (mean), add into main_grad (``reduce_ctas`` CTAs)
    barrier   -- every peer finished reading this rank's buffer (it may return to the pool)

The barriers run on one small signal allocation of the transport, so they pair up by issue
order, which is the same on every rank (the backward is the same program everywhere).
"""
from __future__ import annotations

import torch
from torch.autograd.profiler import record_function

from ..kernels.symm_reduce import symm_reduce_scatter
from .base import EventHandle, Handle, ReduceTransport, record_event
from .symm_pool import symm_mem_module

__all__ = ["SymmTritonReduce"]

_WIRE_16 = (torch.bfloat16, torch.float16)


class SymmTritonReduce(ReduceTransport):
    """Reduce-scatter by ``symm_reduce_scatter`` on ``num_ctas`` CTAs."""

    name = "symm_triton"

    def __init__(self, process_group, device: torch.device, num_ctas: int) -> None:
        self.process_group = process_group
        self.device = device
        self.num_ctas = num_ctas
        self._symm_mem = symm_mem_module(process_group)
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # data_ptr -> (t, table)
        signal = self._symm_mem.empty(16, dtype=torch.int32, device=device)
        self._signal = (signal, self._symm_mem.rendezvous(signal, process_group))

    def wire_dtype(self, param_dtype, grad_dtype):
        return param_dtype if param_dtype in _WIRE_16 else grad_dtype

    def allocator(self):
        return self._allocate

    def _allocate(self, shape, dtype, device) -> torch.Tensor:
        buffer = self._symm_mem.empty(tuple(shape), dtype=dtype, device=device)
        handle = self._symm_mem.rendezvous(buffer, self.process_group)
        # The buffer may start inside a larger symmetric block: offset every peer alike.
        offset = buffer.data_ptr() - handle.buffer_ptrs[handle.rank]
        table = torch.tensor([p + offset for p in handle.buffer_ptrs], dtype=torch.int64, device=device)
        self._buffers[buffer.data_ptr()] = (buffer, table)
        return buffer

    def reduce_scatter(self, full, group, target, mean, async_op) -> Handle:
        entry = self._buffers.get(full.data_ptr())
        if entry is None:
            raise RuntimeError("etp symm_triton reduce: the wgrad is not a symmetric pool buffer (an etp bug)")
        _, table = entry
        rows = full.shape[0] // group.size
        out = target
        if out is None:  # no main_grad: the fp32 sum is rounded once, into the wire dtype
            out = torch.empty((rows, *full.shape[1:]), dtype=full.dtype, device=full.device)
        handle = self._signal[1]
        with record_function("etp::reduce_scatter_symm_triton"):
            handle.barrier(channel=0)
            symm_reduce_scatter(table, full, group.rank, out, divisor=float(group.size) if mean else 1.0,
                                accumulate=target is not None, num_ctas=self.num_ctas, impl="triton")
            handle.barrier(channel=0)
        event = record_event(full.device) if async_op else None
        return EventHandle(out, event, keep=(full,))

    def nbytes(self) -> int:
        """Every symmetric wgrad buffer made (the runtime's pool for this group keeps them)."""
        return sum(t.numel() * t.element_size() for t, _ in self._buffers.values())
