"""Reduce-scatter over symmetric memory on a few CTAs (the ``symm_triton`` reduce transport).

Every rank of a shard group holds its full weight gradient ``G_r [padded_rows, cols]`` (bf16
or fp16: the wire bytes) in a symmetric-memory buffer; rank ``me`` owns the rows
``[me * S, (me + 1) * S)``. One kernel reads that row slice from every peer through a pointer
table (``buffer_ptrs`` of the buffer's rendezvous handle), sums in fp32 and writes

    out = sum_r G_r[me*S : (me+1)*S] / divisor          (accumulate=False)
    out = out + sum_r G_r[me*S : (me+1)*S] / divisor    (accumulate=True: out is main_grad)

in one pass: fp32 accumulation at 16-bit wire bytes, no fp32 staging copy, no separate add.
Peers are summed in rank order 0..N-1 (every rank, every run: deterministic). The grid is
``num_ctas`` persistent programs striding over the slice, so the reduction leaves the other
SMs to the GEMMs. Ordering (the peers' buffers are complete before the read, nobody reuses a
buffer a peer still reads) is the caller's: symmetric-memory barriers around the launch, see
``etp.transport.symm_reduce``.

``symm_reduce_scatter_reference`` is the pure-torch definition (and the CPU fallback); with
``TRITON_INTERPRET=1`` the kernel runs on CPU tensors (the pointer table then holds host
addresses), which is how the tests compare the two.
"""
from __future__ import annotations

import torch

try:  # triton is optional on CPU-only installs; the reference serves there
    import triton
    import triton.language as tl

    from etp.kernels.amax import cdiv
    from etp.kernels.launch import launch
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None

__all__ = ["pointer_table", "sum_received", "sum_received_reference", "symm_reduce_scatter",
           "symm_reduce_scatter_reference"]


def symm_reduce_scatter_reference(
    peers: list[torch.Tensor], rank: int, out: torch.Tensor, divisor: float = 1.0, accumulate: bool = False
) -> torch.Tensor:
    """The definition: ``out (+)= sum_r peers[r][rank*S:(rank+1)*S] / divisor``, summed in fp32
    (fp64 for fp64 inputs) in rank order, then cast to ``out``'s dtype."""
    rows = out.shape[0]
    acc_dtype = torch.float64 if peers[0].dtype == torch.float64 else torch.float32
    acc = torch.zeros(out.shape, dtype=acc_dtype, device=out.device)
    for peer in peers:
        acc += peer[rank * rows : (rank + 1) * rows].to(acc_dtype)
    acc /= divisor  # a division, as the NCCL path's mean: the same rounding
    if accumulate:
        acc += out.to(acc_dtype)
    return out.copy_(acc)


def sum_received_reference(own: torch.Tensor, received: torch.Tensor, out: torch.Tensor, divisor: float = 1.0,
                           accumulate: bool = False) -> torch.Tensor:
    """The definition of ``sum_received``: ``out (+)= (own + sum_k received[k]) / divisor``,
    summed in fp32 (fp64 for fp64 inputs) in that order, then cast to ``out``'s dtype."""
    acc_dtype = torch.float64 if own.dtype == torch.float64 else torch.float32
    acc = own.to(acc_dtype).clone()
    for term in received.unbind(0):
        acc += term.to(acc_dtype)
    acc /= divisor
    if accumulate:
        acc += out.to(acc_dtype)
    return out.copy_(acc)


def pointer_table(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """An int64 tensor of the tensors' addresses (what ``buffer_ptrs`` gives for peers)."""
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=device)


if triton is not None:

    @triton.jit
    def _symm_rs_kernel(table, wire_ptr, out_ptr, offset, numel, divisor, WORLD: tl.constexpr,
                        ACCUMULATE: tl.constexpr, ACC_F64: tl.constexpr, BLOCK: tl.constexpr):
        """``out[i] (+)= sum_{r<WORLD} peer_r[offset + i] / divisor`` for ``i < numel``, where
        ``peer_r`` is ``table[r]`` typed like ``wire_ptr`` (only its type is used); each of the
        ``num_programs`` programs strides over blocks of ``BLOCK`` elements."""
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        blocks = tl.cdiv(numel, BLOCK)
        for block in range(pid, blocks, programs):
            idx = tl.cast(block, tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = idx < numel
            if ACC_F64:
                acc = tl.zeros([BLOCK], dtype=tl.float64)
            else:
                acc = tl.zeros([BLOCK], dtype=tl.float32)
            for r in tl.static_range(WORLD):
                src = tl.load(table + r).to(tl.pointer_type(wire_ptr.dtype.element_ty))
                acc += tl.load(src + offset + idx, mask=mask, other=0.0).to(acc.dtype)
            acc = acc / divisor
            if ACCUMULATE:
                acc += tl.load(out_ptr + idx, mask=mask, other=0.0).to(acc.dtype)
            tl.store(out_ptr + idx, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _sum_received_kernel(own_ptr, received_ptr, out_ptr, numel, divisor, PEERS: tl.constexpr,
                             ACCUMULATE: tl.constexpr, ACC_F64: tl.constexpr, BLOCK: tl.constexpr):
        """``out[i] (+)= (own[i] + sum_{k<PEERS} received[k * numel + i]) / divisor``, one block
        per program (a full grid: this runs alone on the compute stream)."""
        idx = tl.cast(tl.program_id(0), tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = idx < numel
        if ACC_F64:
            acc = tl.load(own_ptr + idx, mask=mask, other=0.0).to(tl.float64)
        else:
            acc = tl.load(own_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        for k in tl.static_range(PEERS):
            acc += tl.load(received_ptr + tl.cast(numel, tl.int64) * k + idx, mask=mask, other=0.0).to(acc.dtype)
        acc = acc / divisor
        if ACCUMULATE:
            acc += tl.load(out_ptr + idx, mask=mask, other=0.0).to(acc.dtype)
        tl.store(out_ptr + idx, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_received(own: torch.Tensor, received: torch.Tensor, out: torch.Tensor, divisor: float = 1.0,
                 accumulate: bool = False, impl: str = "auto") -> torch.Tensor:
    """``out (+)= (own + sum_k received[k]) / divisor`` in one pass, fp32 sums of 16-bit terms.

    The local half of a push reduce-scatter (``etp.transport.push_reduce``): ``own`` is this
    rank's rows of its own weight gradient, ``received[k]`` the same rows of peer ``k``'s,
    already copied here by the peers' copy engines; ``out`` is ``main_grad``'s shard
    (``accumulate=True``) or a new shard.

    Args:
        own: contiguous ``[S, ...]`` (bf16 / fp16 / fp32 / fp64).
        received: contiguous ``[P, S, ...]`` of ``own``'s dtype (``P`` may be 0).
        out: contiguous, ``own``'s shape, any float dtype.
        impl: "triton", "torch" (``sum_received_reference``) or "auto" (triton where it runs).

    Example::

        sum_received(grad_rows, staged, param.main_grad, divisor=world, accumulate=True)
    """
    if not (own.is_contiguous() and received.is_contiguous() and out.is_contiguous()):
        raise ValueError("sum_received needs contiguous own, received and out tensors")
    if received.shape[1:] != own.shape or out.shape != own.shape or received.dtype != own.dtype:
        raise ValueError(f"sum_received: own {tuple(own.shape)} {own.dtype}, received {tuple(received.shape)} "
                         f"{received.dtype} and out {tuple(out.shape)} must be [S, ...], [P, S, ...] (same dtype) "
                         "and [S, ...]")
    use_triton = impl == "triton" or (impl == "auto" and triton is not None and _triton_runs_on(out))
    if not use_triton:
        return sum_received_reference(own, received, out, divisor, accumulate)
    numel = own.numel()
    if numel == 0:
        return out
    block = 4096
    launch(_sum_received_kernel, (cdiv(numel, block),),
           own, received, out, numel, float(divisor), PEERS=received.shape[0], ACCUMULATE=accumulate,
           ACC_F64=own.dtype == torch.float64, BLOCK=block, num_warps=8)
    return out


def symm_reduce_scatter(
    table: torch.Tensor,
    wire: torch.Tensor,
    rank: int,
    out: torch.Tensor,
    divisor: float = 1.0,
    accumulate: bool = False,
    num_ctas: int = 8,
    impl: str = "auto",
    peers: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Launches the reduce-scatter of the module docstring on ``num_ctas`` programs.

    Args:
        table: int64 ``[world]`` addresses of every rank's ``[padded_rows, cols]`` buffer, on
            ``out``'s device (``buffer_ptrs`` of the rendezvous handle, offset to the buffer).
        wire: this rank's buffer (gives the wire dtype and shape; it is ``table[rank]``).
        rank: this rank's index in the group; it owns rows ``[rank*S, (rank+1)*S)``,
            ``S = out.shape[0]``.
        out: contiguous ``[S, cols]``, fp32 (``main_grad``) or any float dtype.
        impl: "triton", "torch" (needs ``peers``, the same buffers as tensors) or "auto"
            (triton when it can run on ``out``'s device).

    Example::

        symm_reduce_scatter(table, buffer, rank, param.main_grad, divisor=n, accumulate=True)
    """
    if not out.is_contiguous() or not wire.is_contiguous():
        raise ValueError("symm_reduce_scatter needs contiguous out and wire buffers")
    world = table.numel()
    if wire.shape[0] != out.shape[0] * world or wire.shape[1:] != out.shape[1:]:
        raise ValueError(f"wire buffer {tuple(wire.shape)} is not {world} x out {tuple(out.shape)}")
    use_triton = impl == "triton" or (impl == "auto" and triton is not None and _triton_runs_on(out))
    if not use_triton:
        if peers is None:
            raise ValueError("impl='torch' needs the peers' buffers as tensors (peers=...)")
        return symm_reduce_scatter_reference(peers, rank, out, divisor, accumulate)
    numel = out.numel()
    block = 4096  # 16 elements per thread at 8 warps: enough loads in flight per CTA
    grid = (max(1, min(num_ctas, cdiv(numel, block))),)
    launch(_symm_rs_kernel, grid, table, wire, out, rank * numel, numel, float(divisor), WORLD=world,
           ACCUMULATE=accumulate, ACC_F64=wire.dtype == torch.float64, BLOCK=block,
           num_warps=8)
    return out


def _triton_runs_on(tensor: torch.Tensor) -> bool:
    import os

    return tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
