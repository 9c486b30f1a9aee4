"""Pure-torch reference implementations of the FP8 weight-gather kernels.

Every Triton op in :mod:`etp.kernels` has its reference here.  These functions
define the numerics (the Triton kernels are tested bit-exact against them) and
are also the CPU fallback used by ``impl="auto"`` for non-CUDA tensors.

Numerics shared by all ops:

* amax is ``max(|x|)`` computed exactly; NaN anywhere gives NaN, +-inf gives inf,
  an empty input gives 0.
* scale is ``fp8_max / amax`` as a correctly rounded float32 division
  (``torch.div`` of two float32 tensors, *not* ``fp8_max / tensor``, which torch
  evaluates as ``reciprocal(tensor) * fp8_max`` and so rounds twice); amax == 0
  gives scale 1.0.
* quantization is ``float8_e4m3fn(clamp(x.float() * scale, -448, 448))`` with
  round-to-nearest-even.  The product is a float32 multiply; the clamp makes
  +-inf saturate to +-448 and leaves NaN as NaN.
* dequantization is ``(q.float() / scale).to(out_dtype)`` (float32 division,
  round-to-nearest-even cast).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

__all__ = [
    "FP8_E4M3_MAX",
    "SUPPORTED_INPUT_DTYPES",
    "multi_tensor_amax_ref",
    "amax_to_scale_ref",
    "multi_tensor_cast_fp8_ref",
    "quantize_blockwise_ref",
    "dequantize_fp8_ref",
    "blockwise_scale_shape",
    "swiglu_ref",
    "quantize_grouped_colwise_ref",
    "swiglu_backward_ref",
]

#: Largest finite value of ``torch.float8_e4m3fn``.
FP8_E4M3_MAX = 448.0

#: Input dtypes accepted by the amax / cast / blockwise ops.
SUPPORTED_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def multi_tensor_amax_ref(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Reference for :func:`etp.kernels.multi_tensor_amax`.

    Returns a float32 tensor ``[len(tensors)]`` with ``max(|x|)`` of each input
    (0 for empty inputs, NaN if the input holds a NaN).
    """
    if len(tensors) == 0:
        return torch.zeros(0, dtype=torch.float32)
    device = tensors[0].device
    out = torch.zeros(len(tensors), dtype=torch.float32, device=device)
    for i, t in enumerate(tensors):
        if t.numel() > 0:
            # abs/amax are exact in the input dtype; the float32 cast is exact
            # for bf16/fp16/fp32.  torch.amax propagates NaN.
            out[i] = t.abs().amax().float()
    return out


def amax_to_scale_ref(amax: torch.Tensor, fp8_max: float = FP8_E4M3_MAX) -> torch.Tensor:
    """Reference for :func:`etp.kernels.amax_to_scale`: ``fp8_max / amax``, 1.0 where amax == 0."""
    amax = amax.float()
    is_zero = amax == 0
    # Divide by 1.0 where amax == 0 so no inf is ever produced (and no FP
    # warning raised); the where() then selects the 1.0 scale there.
    safe = torch.where(is_zero, torch.ones_like(amax), amax)
    scale = torch.div(torch.full_like(amax, fp8_max), safe)
    return torch.where(is_zero, torch.ones_like(scale), scale)


def _quantize_ref(x: torch.Tensor, scale: torch.Tensor, fp8_max: float = FP8_E4M3_MAX) -> torch.Tensor:
    y = x.float() * scale
    # clamp propagates NaN and saturates +-inf, matching the kernels.
    return y.clamp(-fp8_max, fp8_max).to(torch.float8_e4m3fn)


def multi_tensor_cast_fp8_ref(
    tensors: Sequence[torch.Tensor],
    scales: torch.Tensor,
) -> Tuple[List[torch.Tensor], None]:
    """Reference for :func:`etp.kernels.multi_tensor_cast_fp8`: ``(qs, None)`` with
    ``q_i = float8_e4m3fn(clamp(x_i.float() * scales[i], -448, 448))``."""
    return [_quantize_ref(x, scales[i]) for i, x in enumerate(tensors)], None


def blockwise_scale_shape(shape: Sequence[int], block_rows: int, block_cols: int) -> Tuple[int, ...]:
    """Shape of the scale tensor for a 2-D ``[R, C]`` or 3-D ``[E, R, C]`` input."""
    *lead, rows, cols = shape
    return tuple(lead) + (-(-rows // block_rows), -(-cols // block_cols))


def _expand_block_scales(scale: torch.Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> torch.Tensor:
    # [..., nbr, nbc] -> [..., R, C]: each scale repeated over its block, then the
    # ragged tail cropped.
    full = scale.repeat_interleave(block_rows, dim=-2).repeat_interleave(block_cols, dim=-1)
    return full[..., :rows, :cols]


def quantize_blockwise_ref(
    x: torch.Tensor, block_rows: int, block_cols: int = 128
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`etp.kernels.quantize_blockwise`.

    Per block of ``block_rows x block_cols`` elements (per expert for 3-D input):
    ``scale = 448 / amax(block)`` (1.0 for all-zero blocks) and
    ``q = float8_e4m3fn(clamp(x * scale, -448, 448))``.  Ragged edge blocks only
    cover the elements that exist.
    """
    if x.dim() not in (2, 3):
        raise ValueError(f"quantize_blockwise expects a 2-D or 3-D tensor, got shape {tuple(x.shape)}")
    x3 = x.unsqueeze(0) if x.dim() == 2 else x
    n_exp, rows, cols = x3.shape
    nbr = -(-rows // block_rows)
    nbc = -(-cols // block_cols)
    padded = torch.zeros(
        (n_exp, nbr * block_rows, nbc * block_cols), dtype=torch.float32, device=x.device
    )
    padded[:, :rows, :cols] = x3.float()
    # Zero padding never changes max(|x|) (all |x| >= 0) but does not hide NaN.
    blocks = padded.view(n_exp, nbr, block_rows, nbc, block_cols)
    amax = blocks.abs().amax(dim=(2, 4))
    scale = amax_to_scale_ref(amax)
    q = _quantize_ref(x3, _expand_block_scales(scale, rows, cols, block_rows, block_cols))
    if x.dim() == 2:
        return q[0], scale[0]
    return q, scale


def dequantize_fp8_ref(
    q: torch.Tensor,
    scale: torch.Tensor,
    *,
    block: Optional[Tuple[int, int]] = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Reference for :func:`etp.kernels.dequantize_fp8`: ``(q.float() / scale).to(out_dtype)``.

    ``block=None``: one scale for the whole tensor (``scale.numel() == 1``);
    otherwise ``block=(block_rows, block_cols)`` and ``scale`` has the shape
    returned by :func:`blockwise_scale_shape`.
    """
    qf = q.float()
    if block is None:
        s = scale.float().reshape(())
    else:
        s = _expand_block_scales(scale.float(), q.shape[-2], q.shape[-1], block[0], block[1])
    return torch.div(qf, s).to(out_dtype)


def _rowwise_fp8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rowwise``'s numerics: (q, 1 / scale) with one scale per row (1.0 for an
    all-zero or empty row)."""
    if x.shape[1] == 0:
        return (torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device),
                torch.ones(x.shape[0], dtype=torch.float32, device=x.device))
    q, scale = quantize_blockwise_ref(x, 1, x.shape[1])
    return q, torch.reciprocal(scale.reshape(x.shape[0]))


def swiglu_ref(
    gate_up: torch.Tensor, probs: Optional[torch.Tensor] = None, *, quantize: bool = False
) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Reference of ``etp.kernels.swiglu``: float32 math (float64 for float64 inputs), one
    rounding to the input dtype."""
    math_dtype = torch.promote_types(gate_up.dtype, torch.float32)
    g, u = gate_up.to(math_dtype).chunk(2, dim=-1)
    h = g * torch.sigmoid(g) * u
    if probs is not None:
        h = h * probs.to(math_dtype)[:, None]
    h = h.to(gate_up.dtype)
    if not quantize:
        return h, None, None
    return (h, *_rowwise_fp8(h))


def swiglu_backward_ref(
    gate_up: torch.Tensor, grad_h: torch.Tensor, probs: Optional[torch.Tensor] = None, *,
    probs_grad: bool = False, quantize: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Reference of ``etp.kernels.swiglu_backward``."""
    math_dtype = torch.promote_types(gate_up.dtype, torch.float32)
    g, u = gate_up.to(math_dtype).chunk(2, dim=-1)
    gh = grad_h.to(math_dtype)
    sig = torch.sigmoid(g)
    silu = g * sig
    grad_probs = None
    if probs is not None:
        if probs_grad:
            grad_probs = (gh * silu * u).sum(dim=-1).to(probs.dtype)
        gh = gh * probs.to(math_dtype)[:, None]
    dgu = torch.cat([gh * u * (sig * (1.0 + g * (1.0 - sig))), gh * silu], dim=-1).to(gate_up.dtype)
    if not quantize:
        return dgu, grad_probs, None, None
    return (dgu, grad_probs, *_rowwise_fp8(dgu))


def grouped_colwise_layout(tokens: int, counts: torch.Tensor, align: int) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """(cumulative token ends, cumulative padded ends, static padded width) of
    ``quantize_grouped_colwise``: each expert's segment rounded up to ``align`` tokens; the
    width ``tokens + E * (align - 1)`` rounded up to ``align`` bounds every padded layout
    without reading the counts on the host. The ends are int32, the grouped GEMMs' offset
    type, so the padded ends serve as the GEMM's ``offs`` without a cast."""
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    pends = torch.cumsum((counts + (align - 1)) // align * align, 0, dtype=torch.int32)
    t_pad = -(-(tokens + counts.numel() * (align - 1)) // align) * align
    return ends, pends, t_pad


def quantize_grouped_colwise_ref(
    x: torch.Tensor, counts: torch.Tensor, *, row_amax: torch.Tensor | None = None, align: int = 16
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference of ``etp.kernels.quantize_grouped_colwise`` (the unused tail of ``q_t`` is 0):
    one scale per (expert, column), or per expert from ``row_amax`` (the max over the
    expert's rows) when given."""
    ends, pends, t_pad = grouped_colwise_layout(x.shape[0], counts, align)
    experts, cols = counts.numel(), x.shape[1]
    q = torch.zeros((cols, t_pad), dtype=torch.float8_e4m3fn, device=x.device)
    s_inv = torch.ones((experts, cols), dtype=torch.float32, device=x.device)
    bounds = [0] + ends.tolist()
    pbounds = [0] + pends.tolist()
    for e in range(experts):
        seg = x[bounds[e]:bounds[e + 1]].float()
        if seg.shape[0] == 0 or cols == 0:
            continue
        if row_amax is None:
            amax = seg.abs().amax(dim=0)
        else:
            amax = row_amax[bounds[e]:bounds[e + 1]].float().amax().expand(cols)
        scale = amax_to_scale_ref(amax)
        s_inv[e] = torch.reciprocal(scale)
        q[:, pbounds[e]:pbounds[e] + seg.shape[0]] = _quantize_ref(seg, scale[None, :]).t()
    return q, s_inv, pends.to(torch.int32)
