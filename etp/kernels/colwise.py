"""Per-expert, per-column FP8 quantization with a transposed output: the weight-gradient
GEMM's operands.

The weight gradient of a grouped linear, ``dW[e] = gy_e^T x_e``, contracts over each expert's
tokens. Hopper's FP8 tensor cores need the contracted dimension contiguous in both operands,
and scales may vary along the other dimensions only (not per token). So each operand
``x [T, C]`` (tokens sorted by expert) becomes ``q_t [C, T_pad]``: token-contiguous, one scale
per (expert, column) over that expert's tokens, each expert's token segment padded with
zeros to a multiple of ``align`` tokens (the GEMM's 16-byte alignment of each group's
start; zero rows add nothing). This is ``torch._scaled_grouped_mm``'s 2-D x 2-D layout with
``scale [E * C]``.

One program per (expert, column tile) walks its expert's rows twice: the column maxima,
then the cast (re-read mostly from L2) stored transposed. Per-expert scales (``row_amax``
given) need one read: the scale comes from the rows' maxima that the rowwise quantization of
the same tensor already stored (for the forward / input-gradient GEMM; one tiny launch
reduces them per expert), then one program per tile of the padded layout finds each
position's expert by binary search and casts, as many programs in flight as the transposing
weight cast has. e4m3's relative precision does not depend on the scale as long as values
stay above its subnormals, so one scale per expert costs the GEMM no measurable accuracy
(``tools/bench_fp8_gemms.py``'s error column). Expert boundaries come from device tensors
(no host synchronization); the padded width ``T + E * (align - 1)`` rounded up to ``align``
is static.
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
    select_impl,
)
from etp.kernels.blockwise import _amax_to_scale, _reciprocal_rn, _soft_view
from etp.kernels.fp8_convert import _quantize_f32
from etp.kernels.launch import launch
from etp.kernels.reference import FP8_E4M3_MAX, grouped_colwise_layout, quantize_grouped_colwise_ref

__all__ = ["ALIGN", "grouped_colwise_layout", "quantize_grouped_colwise"]

# Launch shapes: the fastest in a sweep of tile shapes and warps on the expert shapes.
_TT = 256  # tokens per tile
_TC = 64   # columns per tile
_WARPS = 8
_UNROLL = 2  # independent tiles per loop step: their loads are in flight together
# Per-expert mode (row_amax given): one program per [padded positions x columns] tile.
ALIGN = 16  # tokens each expert's segment is padded to: the GEMM's 16-byte group alignment
_PE_TP = 128
_PE_TC = 128
_PE_WARPS = 4


@triton.jit
def _grouped_colwise_kernel(x_ptr, ends_ptr, pends_ptr, q_ptr, sinv_ptr, C, T_PAD,
                            DTYPE: tl.constexpr, SOFT: tl.constexpr, FP8_MAX: tl.constexpr,
                            TT: tl.constexpr, TC: tl.constexpr, UNROLL: tl.constexpr):
    e = tl.program_id(0)
    cols = tl.program_id(1) * TC + tl.arange(0, TC)
    cols_ok = cols < C
    prev = tl.maximum(e - 1, 0)
    start = tl.where(e > 0, tl.load(ends_ptr + prev), 0).to(tl.int64)
    end = tl.load(ends_ptr + e).to(tl.int64)
    pstart = tl.where(e > 0, tl.load(pends_ptr + prev), 0).to(tl.int64)
    pend = tl.load(pends_ptr + e).to(tl.int64)
    at = tl.arange(0, TT)
    acc = tl.zeros([TC], dtype=tl.int32)
    # UNROLL independent tiles per loop step (static_range): their loads are in flight together
    # instead of each step waiting for the previous one's.
    for t0 in range(start, end, TT * UNROLL):
        for u in tl.static_range(UNROLL):
            rows = t0 + u * TT + at
            mask = (rows < end)[:, None] & cols_ok[None, :]
            x = _to_f32(tl.load(x_ptr + rows[:, None] * C + cols[None, :], mask=mask, other=0), DTYPE, SOFT)
            acc = tl.maximum(acc, tl.max(_abs_bits(x), axis=0))
    scale = _amax_to_scale(acc.to(tl.float32, bitcast=True), FP8_MAX)
    tl.store(sinv_ptr + e * C + cols, _reciprocal_rn(scale), mask=cols_ok)
    # The padded segment [pstart, pend): this expert's tokens, then zeros.
    for p0 in range(pstart, pend, TT * UNROLL):
        for u in tl.static_range(UNROLL):
            prow = p0 + u * TT + at
            rows = start + (prow - pstart)
            load_ok = (rows < end)[:, None] & cols_ok[None, :]
            x = _to_f32(tl.load(x_ptr + rows[:, None] * C + cols[None, :], mask=load_ok, other=0), DTYPE, SOFT)
            q = _quantize_f32(x, scale[None, :], FP8_MAX, SOFT)
            store_ok = cols_ok[:, None] & (prow < pend)[None, :]
            tl.store(q_ptr + cols[:, None].to(tl.int64) * T_PAD + prow[None, :], tl.trans(q), mask=store_ok)


@triton.jit
def _expert_scale_kernel(ramax_ptr, ends_ptr, scale_ptr, sinv_ptr, C, FP8_MAX: tl.constexpr, TB: tl.constexpr):
    """Program e: expert e's scale from its rows' amax (NaN-propagating integer max of the
    bits), and its inverse written for every column (the GEMM's [E * C] scale vector)."""
    e = tl.program_id(0)
    start = tl.where(e > 0, tl.load(ends_ptr + tl.maximum(e - 1, 0)), 0).to(tl.int64)
    end = tl.load(ends_ptr + e).to(tl.int64)
    at = tl.arange(0, TB)
    acc = tl.zeros([TB], dtype=tl.int32)
    for t0 in range(start, end, TB):
        rows = t0 + at
        acc = tl.maximum(acc, _abs_bits(tl.load(ramax_ptr + rows, mask=rows < end, other=0)))
    scale = _amax_to_scale(tl.max(acc, axis=0).to(tl.float32, bitcast=True), FP8_MAX)
    tl.store(scale_ptr + e, scale)
    sinv = tl.zeros([TB], dtype=tl.float32) + _reciprocal_rn(scale)
    for c0 in range(0, C, TB):
        tl.store(sinv_ptr + e * C + c0 + at, sinv, mask=c0 + at < C)


@triton.jit
def _grouped_per_expert_kernel(x_ptr, ends_ptr, pends_ptr, scale_ptr, q_ptr, C, T_PAD, E,
                               DTYPE: tl.constexpr, SOFT: tl.constexpr, FP8_MAX: tl.constexpr,
                               LOG_E: tl.constexpr, TP: tl.constexpr, TC: tl.constexpr):
    """One [TP padded positions x TC columns] tile of q_t: each position's expert by a binary
    search of the padded ends, its source row, the expert's scale; read once, stored
    transposed. Padding positions store zeros, and so do those past the last segment in the
    tile that holds its end; tiles wholly past it store nothing (the GEMM stops at its last
    offset: a padded receive buffer's tail, [Note: valid rows] in ``etp.kernels.blockwise``)."""
    p0 = tl.program_id(0).to(tl.int64) * TP
    if p0 >= tl.load(pends_ptr + E - 1):
        return  # a tile wholly past the last segment
    p = p0 + tl.arange(0, TP)
    cols = tl.program_id(1) * TC + tl.arange(0, TC)
    cols_ok = cols < C
    # e = the number of padded ends <= p (E for positions past the last segment).
    lo = tl.zeros([TP], dtype=tl.int32)
    hi = lo + E
    for _ in tl.static_range(LOG_E):
        active = lo < hi
        mid = (lo + hi) // 2
        right = active & (tl.load(pends_ptr + mid, mask=active, other=0) <= p)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(active & ~right, mid, hi)
    e = lo
    inside = e < E
    has_prev = inside & (e > 0)
    prev = tl.maximum(e - 1, 0)
    pstart = tl.load(pends_ptr + prev, mask=has_prev, other=0)
    start = tl.load(ends_ptr + prev, mask=has_prev, other=0)
    end = tl.load(ends_ptr + e, mask=inside, other=0)
    rows = start + (p - pstart)
    rows_ok = inside & (rows < end)
    scale = tl.load(scale_ptr + e, mask=inside, other=1.0)
    x = _to_f32(tl.load(x_ptr + rows[:, None] * C + cols[None, :], mask=rows_ok[:, None] & cols_ok[None, :],
                        other=0), DTYPE, SOFT)
    q = _quantize_f32(x, scale[:, None], FP8_MAX, SOFT)
    # Past the last segment x loaded as 0, so the tile's whole width is stored (zeros there): a
    # mask that varies along p per element would keep the store from vectorising (several times
    # slower).
    tl.store(q_ptr + cols[:, None].to(tl.int64) * T_PAD + p[None, :], tl.trans(q),
             mask=cols_ok[:, None] & (p < T_PAD)[None, :])


def quantize_grouped_colwise(
    x: torch.Tensor, counts: torch.Tensor, *, row_amax: Optional[torch.Tensor] = None, align: int = ALIGN,
    layout: Optional[Tuple[torch.Tensor, torch.Tensor, int]] = None, impl: str = "auto",
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP8 (e4m3) of ``x [T, C]`` transposed, one scale per (expert, column), or per expert.

    Args:
        x: contiguous bf16 / fp16 / fp32 ``[T, C]``, rows sorted by expert.
        counts: ``[E]`` integer tokens per expert (on ``x``'s device; sums to at most T: the
            rows past the sum, a padded buffer's tail, are not read).
        row_amax: optional float32 ``[T]``, each row's ``max |x[t, :]|`` (what the rowwise
            quantization of ``x`` for the forward / input-gradient GEMM stored with
            ``amax_out``): then one scale per *expert*, ``448 / max`` over its rows, and x is
            read once instead of twice (the column maxima pass is skipped).
        align: each expert's token segment is padded with zeros to a multiple of this.
        layout: ``grouped_colwise_layout(T, counts, align)``, when the caller quantizes
            several operands over the same counts (a weight gradient's two): computed once.
        impl: ``"auto"`` (Triton on CUDA), ``"triton"`` or ``"torch"``.

    Returns:
        ``(q_t, scale_inv, padded_ends)``: ``q_t [C, T_pad]`` float8_e4m3fn with
        ``q_t[c, p] ~= x[t, c] / scale_inv[e, c]`` for token t of expert e at padded position
        p (the positions past ``padded_ends[-1]``, which the GEMM does not read, unspecified);
        ``scale_inv [E, C]`` float32 (``amax / 448``, 1.0 for an all-zero column; equal
        along C with ``row_amax``);
        ``padded_ends [E]`` int32 cumulative padded segment ends (the GEMM's offsets).

    Example::

        gq, gs, offs = quantize_grouped_colwise(grad_out, counts)
        xq, xs, _ = quantize_grouped_colwise(x, counts)
        dw = torch._scaled_grouped_mm(gq, xq.t(), gs.reshape(-1), xs.reshape(-1), offs=offs,
                                      out_dtype=torch.bfloat16)
    """
    check_input_dtype(x, "x")
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"quantize_grouped_colwise expects a contiguous [T, C] tensor, got shape {tuple(x.shape)}")
    if counts.dim() != 1 or counts.device != x.device or counts.dtype.is_floating_point:
        raise ValueError(f"counts must be a 1-D integer tensor on {x.device}, got {counts.dtype} "
                         f"{tuple(counts.shape)} on {counts.device}")
    if align < 1:
        raise ValueError(f"align={align}: must be >= 1")
    if row_amax is not None and (row_amax.shape != (x.shape[0],) or row_amax.dtype != torch.float32
                                 or row_amax.device != x.device):
        raise ValueError(f"row_amax must be a float32 [{x.shape[0]}] tensor on {x.device}, got "
                         f"{row_amax.dtype} {tuple(row_amax.shape)} on {row_amax.device}")
    if not select_impl(impl, x.device):
        return quantize_grouped_colwise_ref(x, counts, row_amax=row_amax, align=align)
    ends, pends, t_pad = layout if layout is not None else grouped_colwise_layout(x.shape[0], counts, align)
    experts, cols = counts.numel(), x.shape[1]
    q = torch.empty((cols, t_pad), dtype=torch.float8_e4m3fn, device=x.device)
    s_inv = torch.empty((experts, cols), dtype=torch.float32, device=x.device)
    if experts == 0 or cols == 0:
        return q, s_inv, pends.to(torch.int32)
    device, soft = x.device, interpreter_active()
    if soft and device.type == "cuda":
        x, ends, pends, q, s_inv = (t.cpu() for t in (x, ends, pends, q, s_inv))
        row_amax = row_amax.cpu() if row_amax is not None else None
    if row_amax is None:
        launch(_grouped_colwise_kernel, (experts, cdiv(cols, _TC)),
               _soft_view(x, soft), ends, pends, _soft_view(q, soft), s_inv, cols, t_pad,
               DTYPE=_DTYPE_CODE[x.dtype], SOFT=soft, FP8_MAX=FP8_E4M3_MAX, TT=_TT, TC=_TC, UNROLL=_UNROLL,
               num_warps=_WARPS, **EXACT_FP)
    else:
        scale = torch.empty(experts, dtype=torch.float32, device=x.device)
        launch(_expert_scale_kernel, (experts,), row_amax.contiguous(), ends, scale, s_inv, cols,
               FP8_MAX=FP8_E4M3_MAX, TB=1024, num_warps=4, **EXACT_FP)
        launch(_grouped_per_expert_kernel, (cdiv(t_pad, _PE_TP), cdiv(cols, _PE_TC)),
               _soft_view(x, soft), ends, pends, scale, _soft_view(q, soft), cols, t_pad, experts,
               DTYPE=_DTYPE_CODE[x.dtype], SOFT=soft, FP8_MAX=FP8_E4M3_MAX, LOG_E=experts.bit_length(),
               TP=_PE_TP, TC=_PE_TC, num_warps=_PE_WARPS, **EXACT_FP)
    return q.to(device), s_inv.to(device), pends.to(device=device, dtype=torch.int32)
