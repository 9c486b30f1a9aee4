"""The Triton kernel of the fused multi-tensor FP8 (e4m3fn) cast and its pieces: a flat chunk,
a transposing tile, and the kernel that walks the launch table (its launcher and public API:
:mod:`etp.kernels.cast`; the tables: :mod:`etp.kernels.cast_tables`; the numerics:
:func:`etp.kernels.reference.multi_tensor_cast_fp8_ref`)."""

from __future__ import annotations

import triton
import triton.language as tl

from etp.kernels.amax import _abs_bits, _find_tensor, _to_f32
from etp.kernels.fp8_convert import _quantize_f32


@triton.jit
def _cast_flat_chunk(
    in_base, out_base, start, numel, scale,
    DTYPE: tl.constexpr, SOFT: tl.constexpr, FP8_MAX: tl.constexpr,
    BLOCK: tl.constexpr, ITERS: tl.constexpr, EVICT: tl.constexpr,
):
    """Quantize elements [start, start + BLOCK * ITERS) of one flat tensor; returns the
    chunk's max |x| as integer bits (NaN-propagating, see ``_abs_bits``).

    static_range unrolls the ITERS steps so their loads are independent and can
    all be in flight at once.
    """
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    if start + BLOCK * ITERS <= numel:
        # Full chunk: unmasked accesses vectorise.
        for i in tl.static_range(ITERS):
            o = start + i * BLOCK + offs
            x = _to_f32(tl.load(in_base + o, eviction_policy=EVICT), DTYPE, SOFT)
            acc = tl.maximum(acc, _abs_bits(x))
            tl.store(out_base + o, _quantize_f32(x, scale, FP8_MAX, SOFT))
    else:
        for i in tl.static_range(ITERS):
            o = start + i * BLOCK + offs
            m = o < numel
            x = _to_f32(tl.load(in_base + o, mask=m, other=0, eviction_policy=EVICT), DTYPE, SOFT)
            acc = tl.maximum(acc, _abs_bits(x))
            tl.store(out_base + o, _quantize_f32(x, scale, FP8_MAX, SOFT), mask=m)
    return tl.max(acc, axis=0)


@triton.jit
def _cast_transposed_tile(
    in_base, out_base, outt_base, rows, cols, local, scale,
    DTYPE: tl.constexpr, SOFT: tl.constexpr, ALIGNED: tl.constexpr, FP8_MAX: tl.constexpr,
    TILE_R: tl.constexpr, TILE_C: tl.constexpr, EVICT: tl.constexpr,
):
    """Quantize tile ``local`` of a tensor viewed as ``[B, rows, cols]``: read once, stored
    at ``[b, r, c]`` in q and at ``[b, c, r]`` in q^T (the layout change happens on chip).
    Returns the tile's max |x| as integer bits."""
    if ALIGNED:
        outt_base = tl.multiple_of(outt_base, 16)
        rows = tl.multiple_of(rows, 16)
        cols = tl.multiple_of(cols, 16)
    # Tile coordinates in int32 (block counts are < 2^31; int64 division is several times
    # slower); element offsets stay int64.
    n_tc = tl.cdiv(cols, TILE_C).to(tl.int32)
    per_mat = tl.cdiv(rows, TILE_R).to(tl.int32) * n_tc
    tile = local.to(tl.int32)
    b = tile // per_mat
    rem = tile - b * per_mat
    tr = rem // n_tc
    tc = rem - tr * n_tc
    r = tr * TILE_R + tl.arange(0, TILE_R)
    c = tc * TILE_C + tl.arange(0, TILE_C)
    mat = b.to(tl.int64) * rows * cols
    offs = mat + r[:, None] * cols + c[None, :]
    offs_t = mat + c[None, :] * rows + r[:, None]
    if ((tr + 1) * TILE_R <= rows) & ((tc + 1) * TILE_C <= cols):
        x = _to_f32(tl.load(in_base + offs, eviction_policy=EVICT), DTYPE, SOFT)
        q = _quantize_f32(x, scale, FP8_MAX, SOFT)
        tl.store(out_base + offs, q)
        tl.store(outt_base + offs_t, q)
    else:
        mask = (r[:, None] < rows) & (c[None, :] < cols)
        x = _to_f32(tl.load(in_base + offs, mask=mask, other=0, eviction_policy=EVICT), DTYPE, SOFT)
        q = _quantize_f32(x, scale, FP8_MAX, SOFT)
        tl.store(out_base + offs, q, mask=mask)
        tl.store(outt_base + offs_t, q, mask=mask)
    return tl.max(tl.max(_abs_bits(x), axis=1), axis=0)


@triton.jit
def _entry_bases(table_ptr, T, tid, IN_TY: tl.constexpr, OUT_TY: tl.constexpr, ALIGNED: tl.constexpr):
    """Table entry ``tid``'s input and output pointers, typed (and hinted 16-byte aligned)."""
    in_base = tl.load(table_ptr + tid).to(tl.pointer_type(IN_TY))
    out_base = tl.load(table_ptr + T + tid).to(tl.pointer_type(OUT_TY))
    if ALIGNED:
        # Hints on the pointers (not the int64 addresses) so accesses vectorise.
        in_base = tl.multiple_of(in_base, 16)
        out_base = tl.multiple_of(out_base, 16)
    return in_base, out_base


@triton.jit
def _multi_tensor_cast_fp8_kernel(
    table_ptr,  # int64 [8, T]: in addr, out addr, out^T addr, numel, rows, cols, first block, scale index
    scales_ptr,  # float32 [N]
    amax_ptr,  # HAS_AMAX: int32 bits of float32 [N], each tensor's max |x| (atomic max)
    only_ptr,  # ONLY: uint8 [N + 1], tensors whose entry is 0 are skipped; [N]: any entry set
    N,
    T,
    IN_TY: tl.constexpr,
    OUT_TY: tl.constexpr,
    DTYPE: tl.constexpr,
    SOFT: tl.constexpr,
    ALIGNED: tl.constexpr,  # addresses 16-B aligned and, for matrices, rows % 16 == cols % 16 == 0
    LINEAR_SEARCH: tl.constexpr,
    T_POW2: tl.constexpr,
    WRITE_T: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
    EVICT: tl.constexpr,  # eviction policy of the streaming input loads
    HAS_AMAX: tl.constexpr,
    ONLY: tl.constexpr,
):
    """q_t = e4m3fn(clamp(x_t * scales[s_t], -FP8_MAX, FP8_MAX)) for every table entry t.

    HAS_AMAX: each program also folds the max |x| of what it read into ``amax[s_t]`` (one
    atomic per program): the delayed-scaling cast records the amax of the next step's scale
    from its own read. ONLY: programs of tensors with ``only[s_t] == 0`` do nothing.

    Without WRITE_T every tensor is processed flat, ``BLOCK * ITERS`` elements per program
    (``_cast_flat_chunk``). With WRITE_T, tensors with ``rows > 0`` are processed in
    ``TILE_R x TILE_C`` tiles written twice (``_cast_transposed_tile``); 1-D tensors
    (``rows == 0``) are processed flat and have no separate transposed copy.
    """
    if ONLY:
        # Usually nothing is picked (delayed scaling's re-cast): one load, not the table
        # search's chain of dependent loads, before each of the many programs exits.
        if tl.load(only_ptr + N) == 0:
            return
    pid = tl.program_id(0)
    tid = _find_tensor(table_ptr + 6 * T, pid, T, LINEAR_SEARCH, T_POW2)
    idx = tl.load(table_ptr + 7 * T + tid)
    if ONLY:
        if tl.load(only_ptr + idx) == 0:
            return
    in_base, out_base = _entry_bases(table_ptr, T, tid, IN_TY, OUT_TY, ALIGNED)
    numel = tl.load(table_ptr + 3 * T + tid)
    local = pid - tl.load(table_ptr + 6 * T + tid)
    scale = tl.load(scales_ptr + idx)
    if WRITE_T:
        rows = tl.load(table_ptr + 4 * T + tid)
        cols = tl.load(table_ptr + 5 * T + tid)
        if rows == 0:
            bits = _cast_flat_chunk(in_base, out_base, local * (BLOCK * ITERS), numel, scale,
                                    DTYPE, SOFT, FP8_MAX, BLOCK, ITERS, EVICT)
        else:
            outt_base = tl.load(table_ptr + 2 * T + tid).to(tl.pointer_type(OUT_TY))
            bits = _cast_transposed_tile(in_base, out_base, outt_base, rows, cols, local, scale,
                                         DTYPE, SOFT, ALIGNED, FP8_MAX, TILE_R, TILE_C, EVICT)
    else:
        bits = _cast_flat_chunk(in_base, out_base, local * (BLOCK * ITERS), numel, scale,
                                DTYPE, SOFT, FP8_MAX, BLOCK, ITERS, EVICT)
    if HAS_AMAX:
        tl.atomic_max(amax_ptr + idx, bits, sem="relaxed")
