"""The GEMMs behind ETP layers: dense linear and grouped (per-expert) linear.

Each op exposes ``forward(x, w, counts)``, ``dgrad(gy, w, counts)`` and
``wgrad(gy, x, counts, out=None)`` so that one autograd Function (``etp.autograd``) serves
both. ``wgrad`` writes into ``out`` (a view of a pooled, padded buffer) when
``writes_into(x, gy)`` says it can, and otherwise returns a new tensor: ``torch._grouped_mm``
has no ``out=``, and copying its result into the pool would cost a full extra pass over the
weight gradient.

A weight the gather format hands over as a ``WeightOperand`` (``etp.formats``) runs
``torch._scaled_mm`` / ``torch._scaled_grouped_mm`` where it says ``fp8_gemm_applies`` (a
tensorwise ``FP8Weight`` on sm90+, see [Note: ETP FP8 gathers]) with bf16 activations quantized
on the fly (one fused pass, one scale per row: ``etp.kernels.quantize_rowwise``), and is
dequantized for the ordinary GEMMs everywhere else. Weight gradients stay in bf16/fp32
unless ``ETPConfig.fp8_wgrad`` (grouped weights only).
Every scaled GEMM accumulates without CUTLASS's periodic promotion to fp32
(``use_fast_accum``, as TransformerEngine's forward GEMM does): faster at the expert shapes,
with the same error against float64 (``tools/diag/bench_fp8_gemms.py`` measures both).

Grouped GEMMs run as ``torch._grouped_mm`` on CUDA for bf16 on sm90+ (its supported case);
everywhere else (CPU, other dtypes, older GPUs) as a per-expert loop of ``torch.mm``, which is
exact and is what the CPU tests compare against an unsharded reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .formats import WeightOperand
from .formats.base import fp8_compute_applies, is_sm90
from .kernels import grouped_colwise_layout, quantize_grouped_colwise, quantize_rowwise
from .kernels.colwise import ALIGN as COLWISE_ALIGN
from .streams import to_device_async
from .version_cache import per_version

__all__ = [
    "DenseGemm", "GroupedGemm", "attach_rowwise_fp8", "fp8_compute_applies", "plain_grouped_linear",
    "grouped_linear_reference", "quantize_activation", "row_amax", "valid_rows_of",
]

# [Note: FP8 operands handed over]
# The kernel that produces an activation can quantize it for the next FP8 GEMM in the same
# pass (``etp.kernels.swiglu``: the SwiGLU output for fc2's forward, its input gradient for
# fc1's). It attaches ``(q, scale_inv)`` to the tensor it returns, and
# ``quantize_activation`` uses them instead of reading the activation again. The attachment
# is a Python attribute, which autograd carries from one Function's backward to the next
# (the tensor object survives the hand-over); it is trusted only while the tensor's
# version, address and shape are those it was made for, so an in-place change or a
# reshaped alias falls back to quantizing. Tested in tests/kernels/test_swiglu.py.
# Each row's amax rides along (also when ``quantize_activation`` quantized the tensor itself,
# then without the FP8 copy, which is not kept alive): the FP8 weight-gradient GEMM makes its
# per-expert scales from it (``row_amax``) instead of reading the activation for its maxima.
_ROWWISE_FP8 = "_etp_rowwise_fp8"


def _scaled_dense_ok(x: torch.Tensor, w) -> bool:
    return isinstance(w, WeightOperand) and w.fp8_gemm_applies(x, False)


def _scaled_grouped_ok(x: torch.Tensor, w) -> bool:
    return isinstance(w, WeightOperand) and w.fp8_gemm_applies(x, True)


def _dense(w, dtype: torch.dtype) -> torch.Tensor:
    """A plain weight in ``dtype``: a format's operand is dequantized (the fallback path)."""
    return w.dequantize(dtype) if isinstance(w, WeightOperand) else w


def attach_rowwise_fp8(x: torch.Tensor, q: torch.Tensor | None, scale_inv: torch.Tensor | None,
                       row_amax: torch.Tensor | None = None) -> torch.Tensor:
    """Hands ``x``'s rowwise FP8 quantization (and each row's amax, when known), made by the
    kernel that produced ``x``, to the FP8 GEMMs that will consume it (see [Note: FP8
    operands handed over]). Returns ``x``. An inference tensor (no version counter to check a
    hand-over against) gets nothing attached: its consumers quantize it themselves."""
    if not x.is_inference():
        setattr(x, _ROWWISE_FP8, (x._version, x.data_ptr(), x.shape, q, scale_inv, row_amax))
    return x


def _handed(x: torch.Tensor):
    if x.is_inference():
        return None
    handed = getattr(x, _ROWWISE_FP8, None)
    return handed if handed is not None and handed[:3] == (x._version, x.data_ptr(), x.shape) else None


def row_amax(x: torch.Tensor) -> torch.Tensor | None:
    """Each row's ``max |x|`` as the rowwise quantization of ``x`` found it, or None when
    ``x`` was not quantized rowwise (or changed since)."""
    handed = _handed(x)
    return None if handed is None else handed[5]


def quantize_activation(x: torch.Tensor, keep: bool = False,
                        valid_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """On-the-fly FP8 (e4m3) quantization of a 2-D activation or gradient, one scale per row,
    in one fused pass: ``(q, scale_inv)`` with ``x ~= q * scale_inv[:, None]``; the attached
    quantization when the producing kernel made one (``attach_rowwise_fp8``). The rows'
    amax stays attached to ``x`` (``row_amax``); the FP8 copy too with ``keep``, for a
    later GEMM (else the one GEMM that consumes it frees it). ``valid_rows``: a padded buffer's
    valid length on the device, past which rows are left unquantized ([Note: valid rows] in
    ``etp.kernels.blockwise``)."""
    handed = _handed(x)
    if handed is not None and handed[3] is not None:
        if not keep:
            # One GEMM consumes a handed-over FP8 copy; dropping it here frees it with that GEMM
            # instead of keeping it alive with x (which backward saves) until backward.
            attach_rowwise_fp8(x, None, None, handed[5])
        return handed[3], handed[4]
    amax = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    q, scale_inv = quantize_rowwise(x.contiguous(), amax_out=amax, inverse=True, valid_rows=valid_rows)
    # The FP8 copy stays attached only with ``keep``: else the one GEMM that consumes it frees it.
    attach_rowwise_fp8(x, q if keep else None, scale_inv if keep else None, amax)
    return q, scale_inv


class DenseGemm:
    """``y = x @ w.T`` with ``x [..., in]`` and ``w [out, in]`` (plain or a ``WeightOperand``)."""

    @staticmethod
    def forward(x: torch.Tensor, w, counts: torch.Tensor | None) -> torch.Tensor:
        if _scaled_dense_ok(x, w):
            xq, x_inv = quantize_activation(x.reshape(-1, x.shape[-1]))
            out = w.data.shape[0]
            y = torch._scaled_mm(xq, w.data.t(), scale_a=x_inv[:, None],
                                 scale_b=w.scale_rows(1, out),
                                 out_dtype=x.dtype, use_fast_accum=True)
            return y.view(*x.shape[:-1], out)
        return F.linear(x, _dense(w, x.dtype))

    @staticmethod
    def dgrad(gy: torch.Tensor, w, counts: torch.Tensor | None) -> torch.Tensor:
        if _scaled_dense_ok(gy, w):
            # The weight operand must be column-major: the transposed copy of the gathered FP8
            # weight (bytes moved, nothing re-quantized).
            gq, g_inv = quantize_activation(gy.reshape(-1, gy.shape[-1]))
            inp = w.data.shape[1]
            dx = torch._scaled_mm(gq, w.data_transposed().t(), scale_a=g_inv[:, None],
                                  scale_b=w.scale_rows(1, inp),
                                  out_dtype=gy.dtype, use_fast_accum=True)
            return dx.view(*gy.shape[:-1], inp)
        return gy.matmul(_dense(w, gy.dtype))

    @staticmethod
    def writes_into(x: torch.Tensor, gy: torch.Tensor) -> bool:
        return True

    @staticmethod
    def quantize_ahead(gy: torch.Tensor, w, counts: torch.Tensor | None) -> None:
        """Nothing: dense weight gradients are never FP8 GEMMs (see ``GroupedGemm``'s)."""

    @staticmethod
    def wgrad(gy, x, counts, out: torch.Tensor | None = None, fp8: bool = False) -> torch.Tensor:
        """``gy^T x``; ``fp8`` applies to grouped weights only (dense weight gradients stay
        in the activations' dtype)."""
        gy2, x2 = gy.reshape(-1, gy.shape[-1]), x.reshape(-1, x.shape[-1])
        if out is None:
            return gy2.t().mm(x2)
        if out.dtype == gy.dtype:
            torch.mm(gy2.t(), x2, out=out)  # straight into the pooled buffer, no copy
        else:
            out.copy_(gy2.t().mm(x2))
        return out


def _use_grouped_mm(x: torch.Tensor, out_features: int, in_features: int) -> bool:
    """``torch._grouped_mm``'s supported case: bf16 on sm90+, and every operand's rows 16-byte
    aligned (``in`` and ``out`` multiples of 8), which its TMA loads need (it raises "strides
    should be multiple of 16 bytes" otherwise); other shapes take the per-expert loop."""
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and out_features % 8 == 0
        and in_features % 8 == 0
        and is_sm90(x)
    )


def _offsets(counts: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The grouped GEMMs' int32 end offsets of ``counts``, made once per counts tensor (and
    version): a layer's six grouped GEMMs (forward, input and weight gradient of fc1 and fc2)
    share one ``counts``, and each made its own cumsum and casts, two to four launches per GEMM
    of host time in eager runs. Kept on the tensor (as [Note: FP8 operands handed over] keeps
    its attachments), so it lives exactly as long as ``counts``."""
    return per_version(counts, ("offsets", device),
                       lambda: torch.cumsum(counts.to(device=device), 0, dtype=torch.int32))


def valid_rows_of(counts: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The rows the grouped GEMMs over ``counts`` read, as a one-element device tensor (the
    last of ``_offsets``): the row-local kernels between them stop there ([Note: valid rows] in
    ``etp.kernels.blockwise``), which matters when the rows are a padded receive buffer.

    Example::

        h = swiglu(gate_up, probs, valid_rows=valid_rows_of(counts, gate_up.device))
    """
    return _offsets(counts, device)[-1:]


def _splits(counts: torch.Tensor) -> list[int]:
    return [int(c) for c in counts.tolist()]


class GroupedGemm:
    """Per-expert ``y_e = x_e @ w_e.T``: ``x [T, in]`` sorted by expert, ``counts [E]`` tokens
    per expert, ``w [E, out, in]``."""

    @staticmethod
    def forward(x: torch.Tensor, w, counts: torch.Tensor) -> torch.Tensor:
        if _scaled_grouped_ok(x, w):
            xq, x_inv = quantize_activation(x, valid_rows=valid_rows_of(counts, x.device))
            scale_b = w.scale_rows(w.data.shape[0], w.data.shape[1])
            return torch._scaled_grouped_mm(xq, w.data.transpose(-2, -1), x_inv, scale_b,
                                            offs=_offsets(counts, x.device), out_dtype=x.dtype,
                                            use_fast_accum=True)
        w = _dense(w, x.dtype)
        if _use_grouped_mm(x, w.shape[-2], w.shape[-1]):
            return torch._grouped_mm(x, w.transpose(-2, -1), offs=_offsets(counts, x.device))
        return grouped_linear_reference(x, w, counts)

    @staticmethod
    def dgrad(gy: torch.Tensor, w, counts: torch.Tensor) -> torch.Tensor:
        if _scaled_grouped_ok(gy, w):
            gq, g_inv = quantize_activation(gy, valid_rows=valid_rows_of(counts, gy.device))
            # [E, out, in] column-major per expert: the transposed copy of the FP8 weight.
            w_col = w.data_transposed().transpose(-2, -1)
            scale_b = w.scale_rows(w.data.shape[0], w.data.shape[2])
            return torch._scaled_grouped_mm(gq, w_col, g_inv, scale_b,
                                            offs=_offsets(counts, gy.device), out_dtype=gy.dtype,
                                            use_fast_accum=True)
        w = _dense(w, gy.dtype)
        if _use_grouped_mm(gy, w.shape[-2], w.shape[-1]):
            return torch._grouped_mm(gy, w, offs=_offsets(counts, gy.device))
        parts = torch.split(gy, _splits(counts))
        return torch.cat([part.mm(w[e]) for e, part in enumerate(parts)])

    @staticmethod
    def writes_into(x: torch.Tensor, gy: torch.Tensor) -> bool:
        return not _use_grouped_mm(x, gy.shape[-1], x.shape[-1])

    @staticmethod
    def quantize_ahead(gy: torch.Tensor, w, counts: torch.Tensor) -> None:
        """Quantizes ``gy`` rowwise now for the FP8 input-gradient GEMM with ``w`` (when it
        will be one) and keeps it attached ([Note: FP8 operands handed over]): ETP's backward
        runs the weight gradient first, and the FP8 weight-gradient GEMM makes its scales from
        the rows' amax, which only this quantization finds in the same read of ``gy``."""
        if _scaled_grouped_ok(gy, w):
            quantize_activation(gy, keep=True, valid_rows=valid_rows_of(counts, gy.device))

    @staticmethod
    def wgrad(gy, x, counts, out: torch.Tensor | None = None, fp8: bool = False) -> torch.Tensor:
        """Per-expert ``gy_e^T x_e``. ``fp8`` (``ETPConfig.fp8_wgrad``): on sm90+ with bf16
        activations, both operands quantized per (expert, column) over the expert's tokens,
        transposed and padded per expert (``quantize_grouped_colwise``), then one FP8
        grouped GEMM. An operand whose
        rows' amax the forward / input-gradient GEMM already found (``row_amax``: always on the
        FP8 path) is quantized per expert instead, from that amax, in one read."""
        if fp8 and gy.dtype == x.dtype and fp8_compute_applies(x, (gy.shape[-1], x.shape[-1]), grouped=True):
            if counts.device != x.device:  # host counts (e.g. a caller's fixed split): copy, never raise
                counts = to_device_async(counts, x.device)
            # Shared by both operands, and by the layer's other FP8 weight gradient (same counts).
            layout = per_version(counts, ("colwise_layout", x.shape[0]),
                                 lambda: grouped_colwise_layout(x.shape[0], counts, COLWISE_ALIGN))
            gq, g_inv, offs = quantize_grouped_colwise(gy, counts, row_amax=row_amax(gy), layout=layout)
            xq, x_inv, _ = quantize_grouped_colwise(x, counts, row_amax=row_amax(x), layout=layout)
            result = torch._scaled_grouped_mm(gq, xq.t(), g_inv.reshape(-1), x_inv.reshape(-1), offs=offs,
                                              out_dtype=x.dtype, use_fast_accum=True)
            return result if out is None else out.copy_(result)
        if _use_grouped_mm(x, gy.shape[-1], x.shape[-1]):
            result = torch._grouped_mm(gy.t(), x, offs=_offsets(counts, x.device))
            return result if out is None else out.copy_(result)
        splits = _splits(counts)
        if out is None:
            out = x.new_empty((len(splits), gy.shape[-1], x.shape[-1]))
        for e, (g, xe) in enumerate(zip(torch.split(gy, splits), torch.split(x, splits))):
            if out.dtype == g.dtype:
                torch.mm(g.t(), xe, out=out[e])
            else:
                out[e].copy_(g.t().mm(xe))
        return out


def grouped_linear_reference(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per-expert loop of ``x_e @ w_e.T`` (differentiable; the unsharded reference)."""
    parts = torch.split(x, _splits(counts))
    if len(parts) != w.shape[0]:
        raise ValueError(f"counts has {len(parts)} experts but the weight has {w.shape[0]}")
    return torch.cat([part.mm(w[e].t()) for e, part in enumerate(parts)])


class _GroupedLinearFunction(torch.autograd.Function):
    """Per-expert linear for a plain (unsharded) stacked weight, with GroupedGemm's kernels."""

    @staticmethod
    def forward(ctx, x, weight, counts):
        ctx.save_for_backward(x, weight, counts)
        return GroupedGemm.forward(x, weight, counts)

    @staticmethod
    def backward(ctx, gy):
        x, weight, counts = ctx.saved_tensors
        gy = gy.contiguous()
        grad_x = GroupedGemm.dgrad(gy, weight, counts) if ctx.needs_input_grad[0] else None
        grad_w = GroupedGemm.wgrad(gy, x, counts) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def plain_grouped_linear(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per-expert ``x_e @ w_e.T`` for a plain stacked weight ``[E, out, in]``: the same GEMM
    kernels as the ETP path (``torch._grouped_mm`` on sm90 bf16), differentiable."""
    if counts.numel() != weight.shape[0]:
        raise ValueError(f"counts has {counts.numel()} experts but the weight has {weight.shape[0]}")
    return _GroupedLinearFunction.apply(x, weight, counts)
