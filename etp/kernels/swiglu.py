"""Fused SwiGLU forward and backward, optionally quantizing their output rowwise to FP8.

The routed experts compute ``h = silu(g) * u`` (times the router probability of the token)
between their two grouped GEMMs, ``[g | u] = x W1^T`` and ``y = h W2^T``. In eager torch that
is 4 kernels forward (silu, mul, mul, and a cast) and 6 backward (two muls, silu_backward, a
mul, a cat and the probability's reduction), each a full pass over ``[T, ffn]``
activations: a large share of the expert stack's step, all of it memory traffic. Here each
direction is one pass, computed in float32 and rounded once.

With FP8 expert GEMMs the next GEMM's operand is the FP8 rowwise quantization of this
output (``h`` for fc2's forward, ``d[g | u]`` for fc1's input gradient). ``quantize=True``
produces it in the same kernel: the row's maximum is taken while the output is written,
and a second loop over the row (read back from L2) casts it, so the activation is not
read again from HBM by a separate quantization pass. The quantization is exactly
``quantize_rowwise`` of the (rounded) output.

Numerics (the pure-torch references ``swiglu_ref`` / ``swiglu_backward_ref`` define them):
float32 math on the widened inputs, one rounding to the input dtype; ``silu(g) = g *
sigmoid(g)``, ``d silu / dg = sigmoid(g) * (1 + g * (1 - sigmoid(g)))``. The kernels'
``exp`` may differ from torch's in the last float32 bit, so outputs agree with the
references to one unit of the output dtype, not bit for bit.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from etp.kernels.amax import _DTYPE_CODE, _abs_bits, _to_f32, cdiv, interpreter_active, select_impl
from etp.kernels.blockwise import (
    _amax_to_scale,
    _reciprocal_rn,
    _soft_view,
    check_row_amax_out,
    check_valid_rows,
    fill_row_amax,
    past_valid,
    rows_below,
)
from etp.kernels.fp8_convert import _f32_to_bf16_bits, _quantize_f32
from etp.kernels.launch import launch
from etp.kernels.reference import FP8_E4M3_MAX, SUPPORTED_INPUT_DTYPES, swiglu_backward_ref, swiglu_ref

__all__ = ["swiglu", "swiglu_backward"]

# Elements per loop step of a program (rows x columns); 8 warps. Rows per program shrink as
# the ffn width grows so that a program's row stays short enough to be re-read from L2.
_CHUNK = 4096
_MAX_TC = 1024
_WARPS = 8


@triton.jit
def _round(x, DTYPE: tl.constexpr, SOFT: tl.constexpr):
    """(what to store, its value widened back to float32) for float32 ``x`` rounded to DTYPE."""
    if DTYPE == 0:
        if SOFT:
            bits = _f32_to_bf16_bits(x)
            return bits, (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        b = x.to(tl.bfloat16)
        return b, b.to(tl.float32)
    elif DTYPE == 1:
        h = x.to(tl.float16)
        return h, h.to(tl.float32)
    else:
        return x, x


@triton.jit
def _load_gate_up(gu_rows, cols, mask, FFN, DTYPE: tl.constexpr, SOFT: tl.constexpr):
    """The gate and up halves of a [rows, cols] tile of ``[g | u]``, widened to float32."""
    g = _to_f32(tl.load(gu_rows + cols[None, :], mask=mask, other=0), DTYPE, SOFT)
    u = _to_f32(tl.load(gu_rows + FFN + cols[None, :], mask=mask, other=0), DTYPE, SOFT)
    return g, u


@triton.jit
def _rowwise_fp8(acc, src_rows, q_rows, sinv_ptr, amax_ptr, rows, rows_ok, width, ac, DTYPE: tl.constexpr,
                 SOFT: tl.constexpr, FP8_MAX: tl.constexpr, TC: tl.constexpr, HAS_AMAX: tl.constexpr):
    """The quantizing kernels' tail: each row's scale from the running |x| bits ``acc``, its
    inverse (and with HAS_AMAX the row's amax) stored, then a second loop re-reads the row
    just written and casts it."""
    amax = tl.max(acc, axis=1).to(tl.float32, bitcast=True)
    scale = _amax_to_scale(amax, FP8_MAX)
    tl.store(sinv_ptr + rows, _reciprocal_rn(scale), mask=rows_ok)
    if HAS_AMAX:
        tl.store(amax_ptr + rows, amax, mask=rows_ok)
    tl.debug_barrier()  # the row's values were written by other threads of this program
    for c0 in range(0, width, TC):
        cols = c0 + ac
        mask = rows_ok[:, None] & (cols < width)[None, :]
        x = _to_f32(tl.load(src_rows + cols[None, :], mask=mask, other=0), DTYPE, SOFT)
        tl.store(q_rows + cols[None, :], _quantize_f32(x, scale[:, None], FP8_MAX, SOFT), mask=mask)


@triton.jit
def _swiglu_fwd_kernel(gu_ptr, p_ptr, h_ptr, q_ptr, sinv_ptr, amax_ptr, valid_ptr, R, FFN,
                       DTYPE: tl.constexpr, PDTYPE: tl.constexpr, SOFT: tl.constexpr,
                       FP8_MAX: tl.constexpr, HAS_PROBS: tl.constexpr, QUANT: tl.constexpr,
                       HAS_AMAX: tl.constexpr, HAS_VALID: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr):
    """h[r] = silu(g[r]) * u[r] (* p[r]) for TR rows; with QUANT also the rowwise FP8 of h.
    HAS_VALID: only the rows below the device scalar at valid_ptr."""
    if HAS_VALID:
        if past_valid(valid_ptr, TR):
            return
    rows = tl.program_id(0) * TR + tl.arange(0, TR)
    rows_ok = rows_below(rows, R, valid_ptr, HAS_VALID)
    r64 = rows.to(tl.int64)
    gu_rows = gu_ptr + r64[:, None] * (2 * FFN)
    h_rows = h_ptr + r64[:, None] * FFN
    ac = tl.arange(0, TC)
    if HAS_PROBS:
        p = _to_f32(tl.load(p_ptr + rows, mask=rows_ok, other=0), PDTYPE, SOFT)
    acc = tl.zeros([TR, TC], dtype=tl.int32)
    for c0 in range(0, FFN, TC):
        cols = c0 + ac
        mask = rows_ok[:, None] & (cols < FFN)[None, :]
        g, u = _load_gate_up(gu_rows, cols, mask, FFN, DTYPE, SOFT)
        h = g / (1.0 + tl.exp(-g)) * u
        if HAS_PROBS:
            h = h * p[:, None]
        stored, widened = _round(h, DTYPE, SOFT)
        tl.store(h_rows + cols[None, :], stored, mask=mask)
        if QUANT:
            acc = tl.maximum(acc, _abs_bits(widened))
    if QUANT:
        _rowwise_fp8(acc, h_rows, q_ptr + r64[:, None] * FFN, sinv_ptr, amax_ptr, rows, rows_ok, FFN, ac,
                     DTYPE, SOFT, FP8_MAX, TC, HAS_AMAX)


@triton.jit
def _swiglu_bwd_kernel(gu_ptr, gh_ptr, p_ptr, dgu_ptr, dp_ptr, q_ptr, sinv_ptr, amax_ptr, valid_ptr, R, FFN,
                       DTYPE: tl.constexpr, PDTYPE: tl.constexpr, SOFT: tl.constexpr,
                       FP8_MAX: tl.constexpr, HAS_PROBS: tl.constexpr, PROBS_GRAD: tl.constexpr,
                       QUANT: tl.constexpr, HAS_AMAX: tl.constexpr, HAS_VALID: tl.constexpr, TR: tl.constexpr,
                       TC: tl.constexpr):
    """d[g | u][r] from dh[r]; with PROBS_GRAD dp[r] = sum(dh * silu(g) * u); with QUANT the
    rowwise FP8 of d[g | u] (one scale over both halves of the row)."""
    if HAS_VALID:
        if past_valid(valid_ptr, TR):
            return
    rows = tl.program_id(0) * TR + tl.arange(0, TR)
    rows_ok = rows_below(rows, R, valid_ptr, HAS_VALID)
    r64 = rows.to(tl.int64)
    gu_rows = gu_ptr + r64[:, None] * (2 * FFN)
    dgu_rows = dgu_ptr + r64[:, None] * (2 * FFN)
    gh_rows = gh_ptr + r64[:, None] * FFN
    ac = tl.arange(0, TC)
    if HAS_PROBS:
        p = _to_f32(tl.load(p_ptr + rows, mask=rows_ok, other=0), PDTYPE, SOFT)
    dp = tl.zeros([TR], dtype=tl.float32)
    acc = tl.zeros([TR, TC], dtype=tl.int32)
    for c0 in range(0, FFN, TC):
        cols = c0 + ac
        mask = rows_ok[:, None] & (cols < FFN)[None, :]
        g, u = _load_gate_up(gu_rows, cols, mask, FFN, DTYPE, SOFT)
        gh = _to_f32(tl.load(gh_rows + cols[None, :], mask=mask, other=0), DTYPE, SOFT)
        sig = 1.0 / (1.0 + tl.exp(-g))
        silu = g * sig
        if HAS_PROBS:
            if PROBS_GRAD:
                dp += tl.sum(gh * silu * u, axis=1)
            gh = gh * p[:, None]
        stored_g, wide_g = _round(gh * u * (sig * (1.0 + g * (1.0 - sig))), DTYPE, SOFT)
        stored_u, wide_u = _round(gh * silu, DTYPE, SOFT)
        tl.store(dgu_rows + cols[None, :], stored_g, mask=mask)
        tl.store(dgu_rows + FFN + cols[None, :], stored_u, mask=mask)
        if QUANT:
            acc = tl.maximum(acc, tl.maximum(_abs_bits(wide_g), _abs_bits(wide_u)))
    if PROBS_GRAD:
        tl.store(dp_ptr + rows, dp, mask=rows_ok)
    if QUANT:
        _rowwise_fp8(acc, dgu_rows, q_ptr + r64[:, None] * (2 * FFN), sinv_ptr, amax_ptr, rows, rows_ok,
                     2 * FFN, ac, DTYPE, SOFT, FP8_MAX, TC, HAS_AMAX)


def _launch_shape(ffn: int) -> Tuple[int, int]:
    tc = min(_MAX_TC, triton.next_power_of_2(max(ffn, 1)))
    return max(1, _CHUNK // tc), tc


def _check(gate_up: torch.Tensor, probs: Optional[torch.Tensor]) -> int:
    if not gate_up.dtype.is_floating_point:
        raise TypeError(f"gate_up has dtype {gate_up.dtype}; expected a floating-point tensor")
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or not gate_up.is_contiguous():
        raise ValueError(
            f"gate_up must be a contiguous [tokens, 2 * ffn] tensor, got shape {tuple(gate_up.shape)} "
            f"(contiguous={gate_up.is_contiguous()}); call .contiguous() or check the fc1 width"
        )
    if probs is not None:
        if probs.shape != gate_up.shape[:1] or probs.device != gate_up.device:
            raise ValueError(
                f"probs must be [tokens] = [{gate_up.shape[0]}] on {gate_up.device}, got "
                f"{tuple(probs.shape)} on {probs.device}"
            )
    return gate_up.shape[1] // 2


def _kernel_applies(impl: str, gate_up: torch.Tensor, probs: Optional[torch.Tensor]) -> bool:
    """Triton for bf16 / fp16 / fp32 with at least one element; the reference otherwise
    (float64 included, e.g. the CPU parity tests)."""
    dtypes_ok = all(t is None or t.dtype in SUPPORTED_INPUT_DTYPES for t in (gate_up, probs))
    if impl == "triton" and not dtypes_ok:
        raise TypeError(f"the Triton SwiGLU takes {SUPPORTED_INPUT_DTYPES}, got {gate_up.dtype}")
    return select_impl(impl, gate_up.device) and dtypes_ok and gate_up.numel() > 0


def _staged(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """CUDA tensors run on CPU under the interpreter (it cannot read device memory)."""
    return None if t is None else (t.cpu() if interpreter_active() else t)


def _unstage(out: Optional[torch.Tensor], staged: Optional[torch.Tensor]) -> None:
    """Writes a staged output buffer back into the caller's (a no-op when they are one)."""
    if out is not None and staged is not out:
        out.copy_(staged)


def _check_amax_out(amax_out: Optional[torch.Tensor], quantize: bool, gate_up: torch.Tensor) -> None:
    if amax_out is not None and not quantize:
        raise ValueError("amax_out is filled by the rowwise quantization: pass quantize=True")
    check_row_amax_out(amax_out, gate_up.shape[0], gate_up.device)


def swiglu(gate_up: torch.Tensor, probs: Optional[torch.Tensor] = None, *, quantize: bool = False,
           amax_out: Optional[torch.Tensor] = None, valid_rows: Optional[torch.Tensor] = None,
           impl: str = "auto") -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """``h = silu(gate) * up`` (times ``probs[:, None]`` when given) in one pass.

    Args:
        gate_up: contiguous ``[T, 2 * ffn]`` (gate columns first), bf16 / fp16 / fp32.
        probs: optional ``[T]`` per-token multiplier (megatron-core's router probabilities).
        quantize: also return the rowwise FP8 quantization of ``h`` (``quantize_rowwise``'s
            result, with the inverse scales the scaled GEMMs take).
        amax_out: with ``quantize``, optional float32 ``[T]`` that receives each row's
            ``max |h[t, :]|`` (``quantize_rowwise``'s ``amax_out``).
        valid_rows: optional one-element integer tensor on ``gate_up``'s device: only the rows
            below it are computed, the rest of every output left unwritten (a padded buffer
            whose valid length only the device knows: [Note: valid rows] in
            ``etp.kernels.blockwise``).
        impl: ``"auto"`` (Triton on CUDA, the torch reference elsewhere), ``"triton"`` or ``"torch"``.

    Returns:
        ``(h, q, scale_inv)``: ``h [T, ffn]`` in ``gate_up``'s dtype; ``q [T, ffn]``
        float8_e4m3fn and ``scale_inv [T]`` float32 (``h ~= q * scale_inv[:, None]``) when
        ``quantize``, else None.

    Example::

        h, q, s_inv = swiglu(gate_up, router_probs, quantize=True)
    """
    ffn = _check(gate_up, probs)
    _check_amax_out(amax_out, quantize, gate_up)
    check_valid_rows(valid_rows, gate_up.device)
    if not _kernel_applies(impl, gate_up, probs):
        h, q, s_inv = swiglu_ref(gate_up, probs, quantize=quantize)
        fill_row_amax(amax_out, h)
        return h, q, s_inv
    device, soft = gate_up.device, interpreter_active()
    gate_up, probs, amax, valid = _staged(gate_up), _staged(probs), _staged(amax_out), _staged(valid_rows)
    rows = gate_up.shape[0]
    h = torch.empty((rows, ffn), dtype=gate_up.dtype, device=gate_up.device)
    q = torch.empty((rows, ffn), dtype=torch.float8_e4m3fn, device=h.device) if quantize else h
    s_inv = torch.empty(rows, dtype=torch.float32, device=h.device) if quantize else h
    tr, tc = _launch_shape(ffn)
    launch(_swiglu_fwd_kernel, (cdiv(rows, tr),),
        _soft_view(gate_up, soft), _soft_view(probs, soft) if probs is not None else gate_up,
        _soft_view(h, soft), _soft_view(q, soft), s_inv, s_inv if amax is None else amax,
        s_inv if valid is None else valid, rows, ffn,
        DTYPE=_DTYPE_CODE[gate_up.dtype], PDTYPE=_DTYPE_CODE[probs.dtype] if probs is not None else 2,
        SOFT=soft, FP8_MAX=FP8_E4M3_MAX, HAS_PROBS=probs is not None, QUANT=quantize,
        HAS_AMAX=amax is not None, HAS_VALID=valid is not None, TR=tr, TC=tc, num_warps=_WARPS,
    )
    _unstage(amax_out, amax)
    if not quantize:
        return h.to(device), None, None
    return h.to(device), q.to(device), s_inv.to(device)


def swiglu_backward(
    gate_up: torch.Tensor, grad_h: torch.Tensor, probs: Optional[torch.Tensor] = None, *,
    probs_grad: bool = False, quantize: bool = False, amax_out: Optional[torch.Tensor] = None,
    valid_rows: Optional[torch.Tensor] = None, impl: str = "auto",
) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Gradients of :func:`swiglu` in one pass.

    Args:
        gate_up: the forward's input ``[T, 2 * ffn]``.
        grad_h: gradient of ``h``, ``[T, ffn]``, same dtype as ``gate_up``.
        probs: the forward's ``probs`` or None.
        probs_grad: also return ``d probs`` (float32 sums, in ``probs``' dtype).
        quantize: also return the rowwise FP8 quantization of ``d gate_up`` (one scale per row
            over all ``2 * ffn`` columns) with its inverse scales.
        amax_out: with ``quantize``, optional float32 ``[T]`` for each row's ``max |d gate_up|``.
        valid_rows, impl: as for :func:`swiglu`.

    Returns:
        ``(grad_gate_up, grad_probs, q, scale_inv)``; the last three are None when not asked for.

    Example::

        d_gu, d_p, q, s_inv = swiglu_backward(gate_up, d_h, probs, probs_grad=True, quantize=True)
    """
    ffn = _check(gate_up, probs)
    if grad_h.shape != (gate_up.shape[0], ffn) or grad_h.dtype != gate_up.dtype:
        raise ValueError(
            f"grad_h must be [{gate_up.shape[0]}, {ffn}] {gate_up.dtype}, got {tuple(grad_h.shape)} {grad_h.dtype}"
        )
    if probs_grad and probs is None:
        raise ValueError("probs_grad=True needs probs")
    grad_h = grad_h.contiguous()
    _check_amax_out(amax_out, quantize, gate_up)
    check_valid_rows(valid_rows, gate_up.device)
    if not _kernel_applies(impl, gate_up, probs):
        dgu, grad_probs, q, s_inv = swiglu_backward_ref(gate_up, grad_h, probs, probs_grad=probs_grad,
                                                        quantize=quantize)
        fill_row_amax(amax_out, dgu)
        return dgu, grad_probs, q, s_inv
    device, soft = gate_up.device, interpreter_active()
    gate_up, grad_h, probs, amax = _staged(gate_up), _staged(grad_h), _staged(probs), _staged(amax_out)
    valid = _staged(valid_rows)
    rows = gate_up.shape[0]
    dgu = torch.empty_like(gate_up)
    dp = torch.empty(rows, dtype=torch.float32, device=dgu.device) if probs_grad else dgu
    q = torch.empty(gate_up.shape, dtype=torch.float8_e4m3fn, device=dgu.device) if quantize else dgu
    s_inv = torch.empty(rows, dtype=torch.float32, device=dgu.device) if quantize else dgu
    tr, tc = _launch_shape(ffn)
    launch(_swiglu_bwd_kernel, (cdiv(rows, tr),),
        _soft_view(gate_up, soft), _soft_view(grad_h, soft),
        _soft_view(probs, soft) if probs is not None else gate_up,
        _soft_view(dgu, soft), dp, _soft_view(q, soft), s_inv, s_inv if amax is None else amax,
        s_inv if valid is None else valid, rows, ffn,
        DTYPE=_DTYPE_CODE[gate_up.dtype], PDTYPE=_DTYPE_CODE[probs.dtype] if probs is not None else 2,
        SOFT=soft, FP8_MAX=FP8_E4M3_MAX, HAS_PROBS=probs is not None, PROBS_GRAD=probs_grad,
        QUANT=quantize, HAS_AMAX=amax is not None, HAS_VALID=valid is not None, TR=tr, TC=tc, num_warps=_WARPS,
    )
    _unstage(amax_out, amax)
    grad_probs = dp.to(device=device, dtype=probs.dtype) if probs_grad else None
    if not quantize:
        return dgu.to(device), grad_probs, None, None
    return dgu.to(device), grad_probs, q.to(device), s_inv.to(device)
