"""FP8 (float8_e4m3fn) dequantization, tensorwise or blockwise: the inverse of
:func:`etp.kernels.blockwise.quantize_blockwise` (and of the tensorwise cast), bit-exact to
:func:`etp.kernels.reference.dequantize_fp8_ref`.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from etp.kernels.amax import _DTYPE_CODE, EXACT_FP, cdiv, interpreter_active, select_impl
from etp.kernels.blockwise import _as_3d, _check_grid, _soft_view
from etp.kernels.fp8_convert import _e4m3_bits_to_f32, _f32_to_bf16_bits
from etp.kernels.launch import launch
from etp.kernels.reference import blockwise_scale_shape, dequantize_fp8_ref

__all__ = ["dequantize_fp8"]

# Tile and chunk of the dequantize kernels.
_DQ_TILE_R = 64
_DQ_TILE_C = 128
_DQ_BLOCK = 4096
# Output dtype codes (same numbering as the inputs').
_OUT_CODE = _DTYPE_CODE


@triton.jit
def _store_out(ptrs, x, mask, OUT: tl.constexpr, SOFT: tl.constexpr):
    """Store float32 ``x`` as bf16 / fp16 / fp32, rounding to nearest even."""
    if OUT == 0:
        if SOFT:
            tl.store(ptrs, _f32_to_bf16_bits(x), mask=mask)
        else:
            tl.store(ptrs, x.to(tl.bfloat16), mask=mask)
    elif OUT == 1:
        tl.store(ptrs, x.to(tl.float16), mask=mask)
    else:
        tl.store(ptrs, x, mask=mask)


@triton.jit
def _load_e4m3(ptrs, mask, SOFT: tl.constexpr):
    if SOFT:
        q = _e4m3_bits_to_f32(tl.load(ptrs, mask=mask, other=0))
    else:
        q = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return q


@triton.jit
def _dequantize_tensorwise_kernel(q_ptr, s_ptr, out_ptr, N, OUT: tl.constexpr, SOFT: tl.constexpr,
                                  BLOCK: tl.constexpr):
    """out_i = cast_out(q_i / s) with one float32 scale s (correctly rounded division)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    q = _load_e4m3(q_ptr + offs, mask, SOFT)
    s = tl.load(s_ptr)
    _store_out(out_ptr + offs, tl.math.div_rn(q, tl.zeros_like(q) + s), mask, OUT, SOFT)


@triton.jit
def _dequantize_blockwise_kernel(q_ptr, s_ptr, out_ptr, R, C, NBR, NBC,
                                 OUT: tl.constexpr, SOFT: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                                 TILE_R: tl.constexpr, TILE_C: tl.constexpr, ROW_SCALES: tl.constexpr):
    """out[e, r, c] = cast_out(q[e, r, c] / s[e, r // BR, c // BC]) (correctly rounded division).

    ROW_SCALES (BC a multiple of TILE_C): the tile lies in one block column,
    so one scale per tile row is loaded and broadcast; otherwise the scale is
    gathered per element.
    """
    e = tl.program_id(2).to(tl.int64)
    pid_c = tl.program_id(1)
    rows = tl.program_id(0) * TILE_R + tl.arange(0, TILE_R)
    cols = pid_c * TILE_C + tl.arange(0, TILE_C)
    rmask = rows < R
    mask = rmask[:, None] & (cols[None, :] < C)
    offs = e * R * C + rows[:, None].to(tl.int64) * C + cols[None, :]
    q = _load_e4m3(q_ptr + offs, mask, SOFT)
    s_base = s_ptr + e * NBR * NBC
    if ROW_SCALES:
        s_row = tl.load(s_base + (rows // BR) * NBC + (pid_c * TILE_C) // BC, mask=rmask, other=1.0)
        x = tl.math.div_rn(q, tl.zeros_like(q) + s_row[:, None])
    else:
        s = tl.load(s_base + (rows // BR)[:, None] * NBC + (cols // BC)[None, :], mask=mask, other=1.0)
        x = tl.math.div_rn(q, s)
    _store_out(out_ptr + offs, x, mask, OUT, SOFT)


def _launch_dequantize(q: torch.Tensor, scale: torch.Tensor, block: Optional[Tuple[int, int]],
                       out_dtype: torch.dtype) -> torch.Tensor:
    soft = interpreter_active()
    out = torch.empty(q.shape, dtype=out_dtype, device=q.device)
    if q.numel() == 0:
        return out
    scale = scale.float().contiguous()
    if block is None:
        grid = (cdiv(q.numel(), _DQ_BLOCK),)
        launch(_dequantize_tensorwise_kernel, grid,
            _soft_view(q, soft), scale, _soft_view(out, soft), q.numel(),
            OUT=_OUT_CODE[out_dtype], SOFT=soft, BLOCK=_DQ_BLOCK, num_warps=4, **EXACT_FP,
        )
        return out
    q3, o3 = _as_3d(q), _as_3d(out)
    n_exp, rows, cols = q3.shape
    grid = (cdiv(rows, _DQ_TILE_R), cdiv(cols, _DQ_TILE_C), n_exp)
    _check_grid(grid, "dequantize_fp8")
    launch(_dequantize_blockwise_kernel, grid,
        _soft_view(q3, soft), scale, _soft_view(o3, soft), rows, cols, scale.shape[-2], scale.shape[-1],
        OUT=_OUT_CODE[out_dtype], SOFT=soft, BR=block[0], BC=block[1],
        TILE_R=_DQ_TILE_R, TILE_C=_DQ_TILE_C, ROW_SCALES=block[1] % _DQ_TILE_C == 0,
        num_warps=4, **EXACT_FP,
    )
    return out



def dequantize_fp8(
    q: torch.Tensor,
    scale: torch.Tensor,
    *,
    block: Optional[Tuple[int, int]] = None,
    out_dtype: torch.dtype = torch.bfloat16,
    impl: str = "auto",
) -> torch.Tensor:
    """Dequantize float8_e4m3fn: ``x = (q.float() / scale).to(out_dtype)``.

    The division is a correctly rounded float32 division and the final cast
    rounds to nearest even, so the result is bit-exact to the torch reference.
    For a value quantized with RTNE the error is bounded by half an e4m3 ulp:
    ``|x - deq| <= 2^-4 |x|`` for values that were e4m3 normals after scaling,
    ``<= 2^-10 / scale`` for e4m3 subnormals, plus the rounding of
    ``out_dtype`` (``2^-9 |x|`` for bf16).

    Args:
        q: contiguous float8_e4m3fn tensor; ``[R, C]`` or ``[E, R, C]`` when blockwise.
        scale: tensorwise (``block=None``): a tensor with one element; blockwise:
            float32 scales shaped as returned by :func:`quantize_blockwise`.
        block: None for tensorwise, else ``(block_rows, block_cols)``.
        out_dtype: torch.bfloat16, torch.float16 or torch.float32.
        impl: ``"auto"`` (Triton on CUDA tensors, torch reference otherwise),
            ``"triton"`` (CPU tensors only under ``TRITON_INTERPRET=1``) or ``"torch"``.

    Returns:
        Tensor shaped like ``q`` with dtype ``out_dtype``.

    Example::

        q, s = quantize_blockwise(weight, 128, 128)
        w = dequantize_fp8(q, s, block=(128, 128), out_dtype=torch.bfloat16)
    """
    if q.dtype != torch.float8_e4m3fn:
        raise TypeError(f"q must be float8_e4m3fn, got {q.dtype}")
    if out_dtype not in _OUT_CODE:
        raise TypeError(f"out_dtype must be bfloat16, float16 or float32, got {out_dtype}")
    if not q.is_contiguous():
        raise ValueError("q is not contiguous; call .contiguous() first")
    if scale.device != q.device:
        raise ValueError(f"q and scale must be on one device, got {q.device} and {scale.device}")
    if block is None:
        if scale.numel() != 1:
            raise ValueError(f"tensorwise dequantization needs a single scale, got shape {tuple(scale.shape)}")
    else:
        if q.dim() not in (2, 3):
            raise ValueError(f"blockwise dequantization expects a 2-D or 3-D q, got shape {tuple(q.shape)}")
        block = (int(block[0]), int(block[1]))
        expected = blockwise_scale_shape(q.shape, *block)
        if tuple(scale.shape) != expected:
            raise ValueError(f"scale shape {tuple(scale.shape)} does not match {expected} for block {block}")
    if not select_impl(impl, q.device):
        return dequantize_fp8_ref(q, scale, block=block, out_dtype=out_dtype)
    if q.device.type == "cuda" and interpreter_active():
        return _launch_dequantize(q.cpu(), scale.cpu(), block, out_dtype).to(q.device)
    return _launch_dequantize(q, scale, block, out_dtype)
