"""Blockwise and rowwise FP8 quantization (the inverse: :mod:`etp.kernels.dequantize`).

Block (1, 128) is the activation format (one scale per row and 128 columns),
(128, 128) the weight format.  3-D inputs ``[E, R, C]`` are blocked per expert.
:func:`quantize_rowwise` is the (1, C) case, one scale per activation row.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from etp.kernels.amax import (
    _DTYPE_CODE,
    EXACT_FP,
    _abs_bits,
    _to_f32,
    cdiv,
    check_input_dtype,
    interpreter_active,
    next_pow2,
    select_impl,
)
from etp.kernels.fp8_convert import _quantize_f32
from etp.kernels.launch import launch
from etp.kernels.reference import (
    FP8_E4M3_MAX,
    blockwise_scale_shape,
    quantize_blockwise_ref,
)

__all__ = ["quantize_blockwise", "quantize_rowwise"]

# Rows per program when block_rows == 1: 32 rows x 128 cols = 4096 elements,
# the same work per program as one (32, 128) block.
_ROWS_PER_PROGRAM = 32
_MAX_GRID_YZ = 65535  # CUDA limit on grid dims 1 and 2
# Largest padded block (elements) the one-pass kernels keep in registers; larger
# blocks (e.g. a 32000-column activation row) go to the two-pass looped kernel.
_ONE_PASS_MAX_ELEMS = 16384
# Elements per chunk of the looped kernel.
_LOOP_CHUNK = 4096


@triton.jit
def _amax_to_scale(amax, FP8_MAX: tl.constexpr):
    """scale = FP8_MAX / amax (correctly rounded), 1.0 where amax == 0.

    div_rn because a plain ``/`` on fp32 lowers to the approximate
    ``div.full.f32`` on NVIDIA GPUs, which would not match torch bit-exactly.
    """
    is_zero = amax == 0
    safe = tl.where(is_zero, 1.0, amax)
    scale = tl.math.div_rn(tl.zeros_like(safe) + FP8_MAX, safe)
    return tl.where(is_zero, 1.0, scale)


@triton.jit
def _reciprocal_rn(x):
    """1 / x, correctly rounded (torch.reciprocal's result; a plain ``/`` is approximate)."""
    return tl.math.div_rn(tl.zeros_like(x) + 1.0, x)


@triton.jit
def rows_below(rows, R, valid_ptr, HAS_VALID: tl.constexpr):
    """The rows a program computes: below R and, with HAS_VALID, below the device scalar at
    valid_ptr ([Note: valid rows])."""
    if HAS_VALID:
        return (rows < R) & (rows < tl.load(valid_ptr))
    return rows < R


@triton.jit
def past_valid(valid_ptr, TR: tl.constexpr):
    """Whether the TR rows of this program (along grid axis 0) all lie at or past the valid
    count: it returns at once (with its rows only masked off it would still run every loop
    step)."""
    return tl.program_id(0) * TR >= tl.load(valid_ptr)


@triton.jit
def _quantize_blockwise_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    amax_ptr,  # HAS_AMAX: each block's amax, stored beside its scale
    valid_ptr,  # HAS_VALID (ROW_MODE): the device scalar bounding the rows computed
    R,
    C,
    NBR,
    NBC,
    DTYPE: tl.constexpr,
    SOFT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BR: tl.constexpr,  # block rows
    BC: tl.constexpr,  # block cols
    TR: tl.constexpr,  # tile rows: rows per program (ROW_MODE) or next_pow2(BR)
    TC: tl.constexpr,  # next_pow2(BC)
    ROW_MODE: tl.constexpr,  # BR == 1: each of the TR tile rows is its own block
    HAS_AMAX: tl.constexpr,
    INVERSE: tl.constexpr = False,  # store 1 / s (what the scaled GEMMs take) instead of s
    HAS_VALID: tl.constexpr = False,
):
    """Per block b of expert e: s = FP8_MAX / max_{i in b} |x_i| (1 where 0),
    q_i = e4m3fn(clamp(x_i * s, -FP8_MAX, FP8_MAX)).

    Grid: (row tiles, column blocks, experts).  The block max is the
    NaN-propagating integer max of |x| bits (see ``_abs_bits``); masked
    elements load 0 and so never change it.
    """
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    e = tl.program_id(2).to(tl.int64)
    if ROW_MODE and HAS_VALID:
        if past_valid(valid_ptr, TR):
            return
    ar = tl.arange(0, TR)
    ac = tl.arange(0, TC)
    if ROW_MODE:
        rows = pid_r * TR + ar
        rmask = rows_below(rows, R, valid_ptr, HAS_VALID)
    else:
        rows = pid_r * BR + ar
        rmask = (ar < BR) & (rows < R)
    cols = pid_c * BC + ac
    cmask = (ac < BC) & (cols < C)
    mask = rmask[:, None] & cmask[None, :]
    offs = e * R * C + rows[:, None].to(tl.int64) * C + cols[None, :]
    x = _to_f32(tl.load(x_ptr + offs, mask=mask, other=0), DTYPE, SOFT)
    bits = _abs_bits(x)
    s_base = s_ptr + e * NBR * NBC
    if ROW_MODE:
        amax = tl.max(bits, axis=1).to(tl.float32, bitcast=True)
        scale = _amax_to_scale(amax, FP8_MAX)
        q = _quantize_f32(x, scale[:, None], FP8_MAX, SOFT)
        tl.store(s_base + rows * NBC + pid_c, _reciprocal_rn(scale) if INVERSE else scale, mask=rmask)
        if HAS_AMAX:
            tl.store(amax_ptr + e * NBR * NBC + rows * NBC + pid_c, amax, mask=rmask)
    else:
        amax = tl.max(tl.max(bits, axis=1), axis=0).to(tl.float32, bitcast=True)
        scale = _amax_to_scale(amax, FP8_MAX)
        q = _quantize_f32(x, scale, FP8_MAX, SOFT)
        tl.store(s_base + pid_r * NBC + pid_c, _reciprocal_rn(scale) if INVERSE else scale)
        if HAS_AMAX:
            tl.store(amax_ptr + e * NBR * NBC + pid_r * NBC + pid_c, amax)
    tl.store(q_ptr + offs, q, mask=mask)


@triton.jit
def _quantize_blockwise_looped_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    amax_ptr,  # HAS_AMAX: each block's amax, stored beside its scale
    R,
    C,
    NBR,
    NBC,
    BR,  # block rows (runtime: one compiled kernel serves every width)
    BC,  # block cols
    DTYPE: tl.constexpr,
    SOFT: tl.constexpr,
    FP8_MAX: tl.constexpr,
    TR: tl.constexpr,  # chunk rows (power of 2, <= next_pow2(BR))
    TC: tl.constexpr,  # chunk cols (power of 2)
    HAS_AMAX: tl.constexpr,
    INVERSE: tl.constexpr = False,  # store 1 / s instead of s
):
    """Same result as ``_quantize_blockwise_kernel`` for blocks too large for registers.

    One program per block (grid: block rows, block cols, experts).  Pass 1
    walks the block in ``TR x TC`` chunks and keeps the running NaN-propagating
    integer max of |x| bits; pass 2 walks it again (mostly from L2) and casts
    with the block's scale.  Used for wide activation rows (``quantize_rowwise``
    of a 32000+ column vocabulary projection) and any block whose padded tile
    would not fit in registers.  Chosen from shapes only: no host sync.
    """
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    e = tl.program_id(2).to(tl.int64)
    ar = tl.arange(0, TR)
    ac = tl.arange(0, TC)
    base = e * R * C
    r0 = pid_r * BR
    c0 = pid_c * BC
    acc = tl.zeros([TR, TC], dtype=tl.int32)
    for rr in range(0, BR, TR):
        rows = r0 + rr + ar
        rmask = ((rr + ar) < BR) & (rows < R)
        roffs = base + rows[:, None].to(tl.int64) * C
        for cc in range(0, BC, TC):
            cols = c0 + cc + ac
            cmask = ((cc + ac) < BC) & (cols < C)
            mask = rmask[:, None] & cmask[None, :]
            x = _to_f32(tl.load(x_ptr + roffs + cols[None, :], mask=mask, other=0), DTYPE, SOFT)
            acc = tl.maximum(acc, _abs_bits(x))
    amax = tl.max(tl.max(acc, axis=1), axis=0).to(tl.float32, bitcast=True)
    scale = _amax_to_scale(amax, FP8_MAX)
    tl.store(s_ptr + e * NBR * NBC + pid_r * NBC + pid_c, _reciprocal_rn(scale) if INVERSE else scale)
    if HAS_AMAX:
        tl.store(amax_ptr + e * NBR * NBC + pid_r * NBC + pid_c, amax)
    for rr in range(0, BR, TR):
        rows = r0 + rr + ar
        rmask = ((rr + ar) < BR) & (rows < R)
        roffs = base + rows[:, None].to(tl.int64) * C
        for cc in range(0, BC, TC):
            cols = c0 + cc + ac
            cmask = ((cc + ac) < BC) & (cols < C)
            mask = rmask[:, None] & cmask[None, :]
            offs = roffs + cols[None, :]
            x = _to_f32(tl.load(x_ptr + offs, mask=mask, other=0), DTYPE, SOFT)
            tl.store(q_ptr + offs, _quantize_f32(x, scale, FP8_MAX, SOFT), mask=mask)


def _soft_view(t: torch.Tensor, soft: bool) -> torch.Tensor:
    """In SOFT (interpreter) mode hand bf16 / fp8 to the kernel as raw integer bits."""
    if not soft:
        return t
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    return t


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(0) if t.dim() == 2 else t


def _check_grid(grid, what: str) -> None:
    if grid[1] > _MAX_GRID_YZ or grid[2] > _MAX_GRID_YZ:
        raise ValueError(f"{what}: grid {grid} exceeds the CUDA limit of {_MAX_GRID_YZ} in dims 1 and 2")


def _one_pass_tile(block_rows: int, block_cols: int) -> Optional[Tuple[int, int]]:
    """(TR, TC) of the one-pass kernel, or None when a whole block does not fit in registers."""
    tc = next_pow2(block_cols)
    if block_rows == 1:
        if tc > _ONE_PASS_MAX_ELEMS:
            return None
        return max(1, min(_ROWS_PER_PROGRAM, 4096 // tc)), tc
    tr = next_pow2(block_rows)
    if tr * tc > _ONE_PASS_MAX_ELEMS:
        return None
    return tr, tc


def _looped_chunk(block_rows: int, block_cols: int) -> Tuple[int, int]:
    """(TR, TC) chunk of the two-pass kernel: about _LOOP_CHUNK elements, powers of 2."""
    tc = min(next_pow2(block_cols), _LOOP_CHUNK)
    tr = max(1, min(next_pow2(block_rows), _LOOP_CHUNK // tc))
    return tr, tc


def _launch_quantize_looped(x3: torch.Tensor, q3: torch.Tensor, s: torch.Tensor,
                            block_rows: int, block_cols: int, soft: bool,
                            amax: Optional[torch.Tensor] = None, inverse: bool = False) -> None:
    n_exp, rows, cols = x3.shape
    nbr, nbc = s.shape[-2], s.shape[-1]
    grid = (nbr, nbc, n_exp)
    _check_grid(grid, "quantize_blockwise")
    tr, tc = _looped_chunk(block_rows, block_cols)
    launch(_quantize_blockwise_looped_kernel, grid,
        _soft_view(x3, soft), _soft_view(q3, soft), s, s if amax is None else amax, rows, cols, nbr, nbc,
        block_rows, block_cols, DTYPE=_DTYPE_CODE[x3.dtype], SOFT=soft, FP8_MAX=FP8_E4M3_MAX, TR=tr, TC=tc,
        HAS_AMAX=amax is not None, INVERSE=inverse, num_warps=8 if tr * tc >= 4096 else 4,
        **EXACT_FP,
    )


def _launch_quantize_blockwise(x: torch.Tensor, block_rows: int, block_cols: int) -> Tuple[torch.Tensor, torch.Tensor]:
    soft = interpreter_active()
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(blockwise_scale_shape(x.shape, block_rows, block_cols), dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        # Some dim is 0, so the scale tensor is empty as well.
        return q, s
    x3, q3 = _as_3d(x), _as_3d(q)
    n_exp, rows, cols = x3.shape
    nbr, nbc = s.shape[-2], s.shape[-1]
    tile = _one_pass_tile(block_rows, block_cols)
    if tile is None:
        _launch_quantize_looped(x3, q3, s, block_rows, block_cols, soft)
        return q, s
    tr, tc = tile
    row_mode = block_rows == 1
    grid = (cdiv(rows, tr) if row_mode else nbr, nbc, n_exp)
    _check_grid(grid, "quantize_blockwise")
    launch(_quantize_blockwise_kernel, grid,
        _soft_view(x3, soft), _soft_view(q3, soft), s, s, s, rows, cols, nbr, nbc,
        DTYPE=_DTYPE_CODE[x.dtype], SOFT=soft, FP8_MAX=FP8_E4M3_MAX,
        BR=block_rows, BC=block_cols, TR=tr, TC=tc, ROW_MODE=row_mode, HAS_AMAX=False,
        num_warps=8 if tr * tc >= 8192 else 4,
        **EXACT_FP,
    )
    return q, s


def quantize_blockwise(
    x: torch.Tensor, block_rows: int, block_cols: int = 128, *, impl: str = "auto"
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize to float8_e4m3fn with one float32 scale per ``block_rows x block_cols`` block.

    Per block: ``scale = 448 / amax(block)`` (correctly rounded float32
    division; 1.0 for an all-zero block) and
    ``q = float8_e4m3fn(clamp(x * scale, -448, 448))`` rounded to nearest even.
    Ragged edge blocks only cover existing elements.  A block containing NaN
    gets a NaN scale (all its q are NaN); a block containing +-inf gets scale 0
    (its finite values become 0, the infs NaN), as in the reference.

    Args:
        x: contiguous bf16 / fp16 / fp32 tensor ``[R, C]`` or ``[E, R, C]`` (blocked per expert).
        block_rows: rows per block (1 for activations, 128 for weights).
        block_cols: columns per block (128).
        impl: ``"auto"`` (Triton on CUDA tensors, torch reference otherwise),
            ``"triton"`` (CPU tensors only under ``TRITON_INTERPRET=1``) or ``"torch"``.

    Returns:
        ``(q, scales)``: q like x in float8_e4m3fn; scales float32
        ``[ceil(R / block_rows), ceil(C / block_cols)]`` (leading E for 3-D input).

    Example::

        q, s = quantize_blockwise(weight, 128, 128)          # weights
        qa, sa = quantize_blockwise(activation, 1, 128)      # activations
        w = dequantize_fp8(q, s, block=(128, 128))
    """
    check_input_dtype(x, "x")
    if x.dim() not in (2, 3):
        raise ValueError(f"quantize_blockwise expects a 2-D or 3-D tensor, got shape {tuple(x.shape)}")
    if block_rows < 1 or block_cols < 1:
        raise ValueError(f"block sizes must be >= 1, got ({block_rows}, {block_cols})")
    if not x.is_contiguous():
        raise ValueError("x is not contiguous; call .contiguous() first")
    if not select_impl(impl, x.device):
        return quantize_blockwise_ref(x, block_rows, block_cols)
    if x.device.type == "cuda" and interpreter_active():
        # The interpreter copies tensor arguments itself; stage anyway so every
        # op behaves the same way under TRITON_INTERPRET=1.
        q, s = _launch_quantize_blockwise(x.cpu(), block_rows, block_cols)
        return q.to(x.device), s.to(x.device)
    return _launch_quantize_blockwise(x, block_rows, block_cols)


def check_row_amax_out(amax_out: Optional[torch.Tensor], rows: int, device: torch.device) -> None:
    """The rowwise quantizing kernels' ``amax_out``: None, or a contiguous float32 ``[rows]``."""
    if amax_out is not None and (amax_out.shape != (rows,) or amax_out.dtype != torch.float32
                                 or amax_out.device != device or not amax_out.is_contiguous()):
        raise ValueError(f"amax_out must be a contiguous float32 [{rows}] tensor on {device}, got "
                         f"{amax_out.dtype} {tuple(amax_out.shape)} on {amax_out.device}")


# [Note: valid rows]
# Captured expert parallelism hands the experts a static ``[capacity, h]`` receive buffer whose
# valid length, the sum of the per-expert token counts, lives only on the device (a host read
# would be a synchronization a CUDA graph cannot hold). The grouped GEMMs already stop at their
# last offset; the row-local kernels between them (the rowwise FP8 quantization, the SwiGLU
# and its backward) take that count as ``valid_rows``, a one-element device tensor, and compute
# only the rows below it, leaving the others unwritten: at expert parallel size EP the
# capacity holds about EP x the valid rows, every one of which an unbounded kernel would read
# and write. Rows past it are never read by the GEMMs, the per-expert quantizations or the
# dispatcher's combine, so their contents do not matter.


def check_valid_rows(valid_rows: Optional[torch.Tensor], device: torch.device) -> None:
    """``valid_rows``: None, or a one-element int32 / int64 tensor on ``device`` (see [Note:
    valid rows])."""
    if valid_rows is not None and (valid_rows.numel() != 1 or valid_rows.dtype not in (torch.int32, torch.int64)
                                   or valid_rows.device != device):
        raise ValueError(f"valid_rows must be a one-element int32 / int64 tensor on {device}, got "
                         f"{valid_rows.dtype} {tuple(valid_rows.shape)} on {valid_rows.device}: pass the "
                         "grouped GEMMs' last offset, e.g. torch.cumsum(counts, 0)[-1:]")


def fill_row_amax(amax_out: Optional[torch.Tensor], x: torch.Tensor) -> None:
    """The reference paths' ``amax_out``: each row's max |x| (exact in x's dtype; NaN
    propagates; 0 for zero-width rows)."""
    if amax_out is None:
        return
    if x.numel() == 0:
        amax_out.zero_()
    else:
        amax_out.copy_(x.abs().amax(dim=1))


def quantize_rowwise(x: torch.Tensor, *, amax_out: Optional[torch.Tensor] = None, inverse: bool = False,
                     valid_rows: Optional[torch.Tensor] = None, impl: str = "auto") -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D activation to float8_e4m3fn with one float32 scale per row.

    ``scale_r = 448 / amax(x[r, :])`` (1.0 for an all-zero or zero-width row) and
    ``q[r, c] = float8_e4m3fn(clamp(x[r, c] * scale_r, -448, 448))``: the (1, C) case of
    :func:`quantize_blockwise`.  Rows of up to ``16384`` elements are handled in one pass
    (one or a few whole rows per program, the row's maximum and its cast from one read of
    x); wider rows (vocabulary projections: 32000, 128256, 152064 columns) by a two-pass
    kernel, one program per row looping over column chunks, first for the row's maximum,
    then for the cast (the second read mostly hits L2).  The path is chosen from the shape
    alone, never from values (no host synchronization).  0 rows give empty outputs without
    a launch.  This is the activation side of the FP8 GEMMs (``torch._scaled_mm`` /
    ``torch._scaled_grouped_mm`` with rowwise scales).

    Args:
        x: contiguous bf16 / fp16 / fp32 ``[R, C]``, any R >= 0 and C >= 0.
        amax_out: optional float32 ``[R]`` on x's device that receives each row's
            ``max |x[r, :]|`` (0 for an all-zero row) from the same pass: per-expert scales
            are made from it (``quantize_grouped_colwise(row_amax=...)``).
        inverse: return ``1 / scale_r`` (correctly rounded, as ``torch.reciprocal``), the
            dequantization factor the scaled GEMMs take, stored by the kernel itself instead
            of a separate reciprocal pass (two launches and their host time per GEMM).
        valid_rows: optional one-element integer tensor on x's device: rows at and past it
            may be left unwritten ([Note: valid rows]; rows over 16384 wide: every row written).
        impl: ``"auto"``, ``"triton"`` or ``"torch"`` as for the other ops.

    Returns:
        ``(q, scales)``: q ``[R, C]`` float8_e4m3fn, scales float32 ``[R]`` (``scale_r``, or
        ``1 / scale_r`` with ``inverse``).

    Example::

        q, s = quantize_rowwise(activation)      # dequantized value: q / s[:, None]
        q, s_inv = quantize_rowwise(activation, inverse=True)   # q * s_inv[:, None]
    """
    check_input_dtype(x, "x")
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"quantize_rowwise expects a contiguous 2-D tensor, got shape {tuple(x.shape)}")
    rows, cols = x.shape
    device = x.device
    check_row_amax_out(amax_out, rows, device)
    check_valid_rows(valid_rows, device)
    if cols == 0:
        # max over an empty row is 0, so the scale is 1.0 (as for an all-zero row; 1 / 1 = 1).
        if amax_out is not None:
            amax_out.zero_()
        return (torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=device),
                torch.ones(rows, dtype=torch.float32, device=device))
    if not select_impl(impl, device) or rows == 0:
        q, s = quantize_blockwise_ref(x, 1, cols)
        fill_row_amax(amax_out, x)
        s = s.reshape(rows)
        return q, (s.reciprocal() if inverse else s)
    soft = interpreter_active()
    staged = soft and device.type == "cuda"
    valid = valid_rows.cpu() if staged and valid_rows is not None else valid_rows
    x = x.cpu() if staged else x
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(rows, dtype=torch.float32, device=x.device)
    amax = (torch.empty(rows, dtype=torch.float32) if staged else amax_out) if amax_out is not None else None
    tc = next_pow2(cols)
    if tc > _ONE_PASS_MAX_ELEMS:
        _launch_quantize_looped(x.unsqueeze(0), q.unsqueeze(0), s.view(1, rows, 1), 1, cols, soft,
                                amax=None if amax is None else amax.view(1, rows, 1), inverse=inverse)
    else:
        tr = max(1, 8192 // tc)  # ~8K elements in registers per program
        # NBC = 1, so the kernel's [rows, 1] scale layout is s's [rows].
        launch(_quantize_blockwise_kernel, (cdiv(rows, tr), 1, 1),
            _soft_view(x, soft), _soft_view(q, soft), s, s if amax is None else amax, s if valid is None else valid,
            rows, cols, rows, 1, DTYPE=_DTYPE_CODE[x.dtype], SOFT=soft, FP8_MAX=FP8_E4M3_MAX,
            BR=1, BC=cols, TR=tr, TC=tc, ROW_MODE=True, HAS_AMAX=amax is not None, INVERSE=inverse,
            HAS_VALID=valid is not None, num_warps=8, **EXACT_FP,
        )
    if not staged:
        return q, s
    if amax is not None:
        amax_out.copy_(amax)
    return q.to(device), s.to(device)
