"""Tiled transpose of FP8 (or any 1-byte) matrices, batched over a leading expert axis.

The backward GEMMs of FP8 weights need the gathered weight column-major; transposing its
bytes once per backward use is far cheaper than torch's generic strided copy of float8.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from etp.kernels.amax import cdiv, interpreter_active, select_impl
from etp.kernels.launch import launch

__all__ = ["transpose_last2"]

_TILE = 64


@triton.jit
def _transpose_kernel(x_ptr, y_ptr, R, C, TILE: tl.constexpr):
    """y[e, c, r] = x[e, r, c] for one TILE x TILE tile; grid (row tiles, col tiles, E)."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    e = tl.program_id(2).to(tl.int64)
    rows = pid_r * TILE + tl.arange(0, TILE)
    cols = pid_c * TILE + tl.arange(0, TILE)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    base = e * R * C
    tile = tl.load(x_ptr + base + rows[:, None].to(tl.int64) * C + cols[None, :], mask=mask)
    tl.store(y_ptr + base + cols[None, :].to(tl.int64) * R + rows[:, None], tile, mask=mask)


def transpose_last2(x: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """``x.transpose(-2, -1).contiguous()`` for 1-byte dtypes (fp8, uint8), 2-D or 3-D.

    Example::

        w_t = transpose_last2(w_fp8)   # [E, out, in] -> [E, in, out]
    """
    if x.element_size() != 1 or x.dim() not in (2, 3) or not x.is_contiguous():
        raise ValueError(
            f"transpose_last2 takes a contiguous 2-D or 3-D tensor of a 1-byte dtype, got "
            f"{x.dtype} of shape {tuple(x.shape)}"
        )
    device = x.device
    if not select_impl(impl, device) or x.numel() == 0:
        return x.transpose(-2, -1).contiguous()
    *lead, rows, cols = x.shape
    if interpreter_active() and device.type == "cuda":  # the interpreter reads host memory
        return transpose_last2(x.cpu(), impl=impl).to(device)
    # Few host operations: an eager FP8 step runs this once per input-gradient GEMM.
    y = torch.empty((*lead, cols, rows), dtype=x.dtype, device=device)
    launch(_transpose_kernel, (cdiv(rows, _TILE), cdiv(cols, _TILE), lead[0] if lead else 1),
           x.view(torch.uint8), y.view(torch.uint8), rows, cols, TILE=_TILE, num_warps=4)
    return y
