"""Deterministic, capture-safe gradient of an embedding lookup.

``F.embedding``'s CUDA backward sorts the token ids and reads the number of distinct ids on
the host (no CUDA graph can hold that), and ``index_add_`` adds the rows with atomics (the
order, and so the rounding, changes run to run). ``embedding_backward`` does neither: a
stable sort of the ids puts every id's tokens next to each other in token order, a binary
search gives each vocabulary row its range of sorted positions, and one Triton program per
(row, column block) sums that range in order, in fp32 (fp64 for fp64 gradients), and writes
the row (zeros where no token has that id). Every step is a kernel on the current stream:
no host synchronization, no atomics, the same sums in the same order on every call, so a
captured step replays exactly what eager runs. ``embedding_backward_reference`` is the
pure-torch definition.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from etp.kernels.amax import accumulator_dtype, cdiv, check_impl
from etp.kernels.launch import launch

__all__ = ["embedding_backward", "embedding_backward_reference"]

_BLOCK_H = 1024


@triton.jit
def _embedding_grad_kernel(grad_ptr, perm_ptr, bounds_ptr, out_ptr, H, ACC: tl.constexpr, BLOCK_H: tl.constexpr):
    """``out[v, cols] = sum_{j in [bounds[v], bounds[v+1])} grad[perm[j], cols]``, j ascending."""
    v = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    lo = tl.load(bounds_ptr + v)
    hi = tl.load(bounds_ptr + v + 1)
    acc = tl.zeros([BLOCK_H], dtype=ACC)
    for j in range(lo, hi):
        row = tl.load(perm_ptr + j)
        acc += tl.load(grad_ptr + row * H + offs, mask=mask, other=0.0).to(ACC)
    tl.store(out_ptr + tl.cast(v, tl.int64) * H + offs, acc, mask=mask)


def _check(ids: torch.Tensor, grad: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids: expected int32 or int64 token ids, got {ids.dtype}")
    if grad.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise ValueError(f"grad: expected a floating-point gradient, got {grad.dtype}")
    if grad.shape[:-1] != ids.shape:
        raise ValueError(f"grad {tuple(grad.shape)} must be ids {tuple(ids.shape)} + [hidden]")
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows <= 0:
        raise ValueError(f"num_rows={num_rows!r}: expected the embedding's number of rows (a positive int)")
    return ids.reshape(-1), grad.reshape(-1, grad.shape[-1]).contiguous()


def embedding_backward_reference(ids: torch.Tensor, grad: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``[num_rows, H]`` weight gradient of ``F.embedding(ids, weight)`` for the output
    gradient ``grad``: each row the sum of its tokens' gradient rows in token order, in fp32
    (fp64 for fp64 ``grad``). Pure torch; a loop over tokens, for tests of small inputs."""
    flat_ids, flat_grad = _check(ids, grad, num_rows)
    out = torch.zeros(num_rows, flat_grad.shape[1], dtype=accumulator_dtype(grad.dtype), device=grad.device)
    for token in range(flat_ids.numel()):
        row = int(flat_ids[token])
        out[row] += flat_grad[token].to(out.dtype)
    return out


def embedding_backward(ids: torch.Tensor, grad: torch.Tensor, num_rows: int, *, impl: str = "auto") -> torch.Tensor:
    """The weight gradient of ``F.embedding(ids, weight)`` for the output gradient ``grad``:
    deterministic and without host synchronization (see the module doc).

    Args:
        ids: token ids, any shape, int32 / int64, each in ``[0, num_rows)`` (not checked: a
            check would read the device).
        grad: ``ids.shape + [H]``, bf16 / fp16 / fp32 / fp64.
        num_rows: the embedding table's rows.
        impl: "auto" (Triton on CUDA, else the ordered torch loop), "triton" (on CPU under the
            Triton interpreter too) or "torch".

    Returns:
        ``[num_rows, H]`` in fp32 (fp64 for fp64 ``grad``).

    Example::

        weight_grad = embedding_backward(tokens, out_grad, vocab_size).to(weight.dtype)
    """
    check_impl(impl)
    flat_ids, flat_grad = _check(ids, grad, num_rows)
    use_triton = impl == "triton" or (impl == "auto" and grad.is_cuda)
    if not use_triton:
        return embedding_backward_reference(ids, grad, num_rows)
    hidden = flat_grad.shape[1]
    out = torch.empty(num_rows, hidden, dtype=accumulator_dtype(grad.dtype), device=grad.device)
    if hidden == 0:
        return out
    sorted_ids, perm = torch.sort(flat_ids.to(torch.int64), stable=True)  # token order within an id
    rows = torch.arange(num_rows + 1, dtype=torch.int64, device=grad.device)
    bounds = torch.searchsorted(sorted_ids, rows)  # first sorted position of each id; [v, v+1) its range
    block = min(_BLOCK_H, triton.next_power_of_2(hidden))
    launch(_embedding_grad_kernel, (num_rows, cdiv(hidden, block)),
        flat_grad, perm, bounds, out, hidden,
        ACC=tl.float64 if out.dtype == torch.float64 else tl.float32, BLOCK_H=block)
    return out
