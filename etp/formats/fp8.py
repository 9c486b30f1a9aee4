"""What the two FP8 (e4m3) gather formats share: the gathered weight the GEMMs get
(``FP8Weight``), its per-column scales for the rowwise-scaled GEMMs, and the rules of FP8
gathers (bf16 training; FP8 GEMMs on sm90+). The formats themselves are
``etp.formats.fp8_tensorwise`` and ``etp.formats.fp8_blockwise``.

[Note: ETP FP8 gathers]
With ``gather_dtype`` ``fp8_tensorwise`` or ``fp8_blockwise`` every ETP weight travels as
float8_e4m3fn (one byte per element instead of two), so an all-gather moves half the bytes.
The FP8 shard is made once per optimizer step by ``etp.quantize_shards`` (never per microbatch):

* ``fp8_tensorwise``: one scale per *scale group*, the whole weight for a dense weight and
  each expert for stacked ``[E, out, in]`` experts. One fused multi-tensor amax launch over
  the pieces of all shards, one coalesced all-reduce(MAX) per ETP group (not one per weight
  or expert: a small all-reduce costs about as much as a large one, its latency), one fused
  cast. Scales are delayed: the previous step's amax, a weight whose amax grew re-cast with
  its own. Every rank then holds the same full set of scales, so the gather moves FP8 bytes only.
* ``fp8_blockwise``: one scale per 128x128 block. Shards are whole blocks
  (``pad_for_alignment`` a multiple of 128), so each rank quantizes its own shard with no
  reduction; the (tiny) block scales of every weight are all-gathered once per step, in one
  collective per ETP group.

With the copy-engine transport the FP8 shard is written straight into its symmetric-memory
home (``quant_home`` of the runtime's param state), which peers copy from: no extra copy
per step for tensorwise, one FP8-shard copy for blockwise.

``quantize_shards`` runs by itself at the first forward after a shard changed (detected by
the parameter's version counter, which in-place optimizer updates bump); call it explicitly
after the optimizer step when the optimizer writes parameters through other views (as
megatron-core's distributed optimizer does).

A gathered weight reaches the GEMMs as an ``FP8Weight``: on sm90+ a tensorwise one meets
``torch._scaled_mm`` / ``torch._scaled_grouped_mm`` with the activation quantized rowwise on
the fly, its input-gradient GEMM reading the transpose of the gathered bytes
(``transpose_last2``, nothing re-quantized); a blockwise one, and every FP8 weight elsewhere
(CPU included), is dequantized and the ordinary GEMM runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import dequantize_fp8, transpose_last2
from ..version_cache import per_version
from .base import GatherFormat, WeightOperand, fp8_compute_applies

__all__ = ["BLOCK", "FP8_DTYPE", "FP8Format", "FP8Weight", "prepare_scale_rows", "scale_rows"]

FP8_DTYPE = torch.float8_e4m3fn
BLOCK = 128  # rows and columns of one fp8_blockwise weight block


@dataclass(frozen=True, eq=False)
class FP8Weight(WeightOperand):
    """A gathered FP8 weight: ``data`` in the logical shape, plus its dequantization scales."""

    data: torch.Tensor
    scale: torch.Tensor
    scale_inv: torch.Tensor
    blockwise: bool
    padded: torch.Tensor  # the gathered [padded_rows, cols] buffer (blockwise dequantizes it)
    rows: int

    def fp8_gemm_applies(self, x: torch.Tensor, grouped: bool) -> bool:
        # Blockwise scales have no scaled GEMM here: dequantized everywhere.
        return not self.blockwise and fp8_compute_applies(x, self.data.shape, grouped)

    def scale_rows(self, groups: int, n: int) -> torch.Tensor:
        """``scale_inv`` as the ``[groups, n]`` per-column scales of a rowwise-scaled GEMM's
        weight operand (``scale_rows``)."""
        return scale_rows(self.scale_inv, groups, n)

    def data_transposed(self) -> torch.Tensor:
        """``data`` with its last two dims swapped, contiguous (the input-gradient operand)."""
        return transpose_last2(self.data)

    @property
    def groups(self) -> int:
        return 1 if self.data.dim() == 2 else self.data.shape[0]

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in ``dtype``, ``q / scale`` (the fallback path of every FP8 GEMM)."""
        if self.blockwise:
            full = dequantize_fp8(self.padded, self.scale, block=(BLOCK, BLOCK), out_dtype=dtype)
            return full[: self.rows].view(self.data.shape)
        if self.groups == 1:
            return dequantize_fp8(self.data, self.scale.reshape(()), out_dtype=dtype)
        return (self.data.to(torch.float32) / self.scale.view(-1, 1, 1)).to(dtype)


def scale_rows(scale_inv: torch.Tensor, groups: int, n: int) -> torch.Tensor:
    """``scale_inv`` (one per group, or one for the weight) as the contiguous ``[groups, n]``
    per-column scales the rowwise-scaled GEMMs take for their weight operand; made once per
    quantization (which rewrites ``scale_inv`` in place, bumping its version) rather than by an
    expand-and-copy before every GEMM; ``prepare_scale_rows`` makes them at the quantization, in
    the optimizer's phase of the step, where the host is ahead of the device.

    Example::

        rows = scale_rows(quant.scale_inv, 64, 2816)   # [64, 2816]: expert e's 1/scale in row e
    """
    return per_version(scale_inv, ("scale_rows", groups, n),
                       lambda: scale_inv.reshape(groups, 1).expand(groups, n).contiguous())


def prepare_scale_rows(scale_inv: torch.Tensor, weight_shape) -> None:
    """Makes the two ``scale_rows`` the scaled GEMMs of a tensorwise weight of ``weight_shape``
    (``[out, in]`` or ``[E, out, in]``) ask for (forward: one per output row; input gradient:
    one per input column), so no GEMM pays for them in an issue-bound forward or backward.
    Called right after ``scale_inv`` is rewritten (the tensorwise quantization; the
    expert-stack benchmark's replicated FP8 baseline likewise)."""
    if scale_inv.is_cuda and torch.cuda.is_current_stream_capturing():
        return  # a captured GEMM computes its own (per_version does not cache under capture)
    groups = weight_shape[0] if len(weight_shape) == 3 else 1
    for n in weight_shape[-2:]:
        scale_rows(scale_inv, groups, n)


class FP8Format(GatherFormat):
    """The rules both FP8 formats keep: e4m3 on the wire, a quantized shard per step, bf16
    training (the FP8 GEMMs take bf16 activations), FP8 GEMMs on sm90+."""

    dtype = FP8_DTYPE
    quantized = True

    def unsupported(self, param_dtype: torch.dtype) -> str | None:
        if param_dtype != torch.bfloat16:
            return "FP8 gathers need bf16 training (bf16: true; the FP8 GEMMs take bf16 activations)"
        return None

    def not_fast_on(self, sm90: bool) -> str | None:
        return None if sm90 else "FP8 GEMMs need an sm90+ GPU"
