"""Tiled transpose of FP8 (or any 1-byte) matrices, batched over a leading expert axis.

The backward GEMMs of FP8 weights need the gathered weight column-major; transposing its
bytes once per backward use is far cheaper than torch's generic strided copy of float8.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from etp.kernels.amax import cdiv, check_impl, interpreter_active, select_impl

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
    check_impl(impl)
    if x.element_size() != 1 or x.dim() not in (2, 3) or not x.is_contiguous():
        raise ValueError(
            f"transpose_last2 takes a contiguous 2-D or 3-D tensor of a 1-byte dtype, got "
            f"{x.dtype} of shape {tuple(x.shape)}"
        )
    if not select_impl(impl, x.device) or x.numel() == 0:
        return x.transpose(-2, -1).contiguous()
    device = x.device
    src = x.cpu() if device.type == "cuda" and interpreter_active() else x
    x3 = src.view(torch.uint8).reshape(-1, *src.shape[-2:])
    y3 = torch.empty((x3.shape[0], x3.shape[2], x3.shape[1]), dtype=torch.uint8, device=src.device)
    rows, cols = x3.shape[1], x3.shape[2]
    _transpose_kernel[(cdiv(rows, _TILE), cdiv(cols, _TILE), x3.shape[0])](
        x3, y3, rows, cols, TILE=_TILE, num_warps=4,
    )
    out = y3.view(x.dtype).reshape(*x.shape[:-2], cols, rows)
    return out.to(device)
