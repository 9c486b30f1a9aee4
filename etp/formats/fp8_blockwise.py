"""``fp8_blockwise``: e4m3 with one scale per 128x128 block, quantized locally (shards are whole
blocks); the GEMMs dequantize it. See [Note: ETP FP8 gathers] in ``etp.formats.fp8``."""
from __future__ import annotations

from typing import Sequence

from ..kernels import quantize_blockwise
from .base import QuantizedShard, ScaleExchange, ShardToQuantize, store_quantized
from .fp8 import BLOCK, FP8Format, FP8Weight

__all__ = ["FP8Blockwise"]


class FP8Blockwise(FP8Format):
    """e4m3, one scale per 128x128 block; needs ``pad_for_alignment`` a multiple of 128.

    Example::

        ETPConfig(etp_size=4, gather_dtype="fp8_blockwise", pad_for_alignment=128)
    """

    name = "fp8_blockwise"
    row_align = BLOCK

    def quantize(self, shards: Sequence[ShardToQuantize], exchange: ScaleExchange,
                 plans: dict) -> list[QuantizedShard]:
        """Local blockwise quantization; one all-gather of every weight's block scales."""
        local = [quantize_blockwise(s.shard, BLOCK, BLOCK) for s in shards]
        full_scales = exchange.all_gather_rows([scales for _, scales in local])
        results = []
        for s, (q, _), full in zip(shards, local, full_scales):
            if s.home is not None and s.previous is None:  # the copy-engine transport gathers from there only
                q = s.home.copy_(q)
            results.append(store_quantized(s, q, full))
        return results

    def operand(self, weight, buffer, quant, rows, compute_dtype) -> FP8Weight:
        return FP8Weight(weight, quant.scale, quant.scale_inv, True, buffer, rows)
