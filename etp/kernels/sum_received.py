"""The local half of the push reduce-scatter (``etp.transport.push_reduce``): this rank's rows
of its own weight gradient plus the same rows of every peer's, already copied here by the
peers' copy engines, summed in fp32 (16-bit wire bytes) and added into ``main_grad`` in one
pass.

``sum_received_reference`` is the pure-torch definition (and the CPU fallback); with
``TRITON_INTERPRET=1`` the kernel runs on CPU tensors, which is how the tests compare the two.
"""
from __future__ import annotations

import os

import torch

try:  # triton is optional on CPU-only installs; the reference serves there
    import triton
    import triton.language as tl

    from etp.kernels.amax import cdiv
    from etp.kernels.launch import launch
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None

__all__ = ["sum_received", "sum_received_reference"]


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


if triton is not None:

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


def _triton_runs_on(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
