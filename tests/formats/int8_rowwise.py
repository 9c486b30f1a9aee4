"""int8 weights with one scale per row: a gather format added in one file.

The rows of a shard are whole rows of the weight, so each rank scales its own rows without a
reduction; the per-row scales travel once per step (one all-gather per ETP group), the gathers
move one byte per element, and the GEMMs dequantize. Name it by its import path, with this
directory on ``sys.path`` (``PYTHONPATH`` for torchrun ranks)::

    ETPConfig(etp_size=2, gather_dtype="int8_rowwise:Int8Rowwise")
    etp-train --recipe recipes/tiny_moe_cpu.yaml --set etp.gather_dtype=int8_rowwise:Int8Rowwise
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from etp.formats import GatherFormat, WeightOperand, store_quantized

INT8_MAX = 127


@dataclass(frozen=True, eq=False)
class Int8Weight(WeightOperand):
    """A gathered int8 weight (logical shape) and each padded row's dequantization multiplier."""

    data: torch.Tensor
    scale_inv: torch.Tensor  # [padded_rows]
    rows: int

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        per_row = self.data.reshape(self.rows, -1).to(self.scale_inv.dtype)
        return (per_row * self.scale_inv[: self.rows, None]).to(dtype).view(self.data.shape)


class Int8Rowwise(GatherFormat):
    """int8, ``scale = 127 / amax`` per row, computed in the shard's dtype (at least fp32)."""

    name = "int8_rowwise"
    dtype = torch.int8
    quantized = True

    def quantize(self, shards, exchange, plans):
        local = []
        for s in shards:
            w = s.shard.to(torch.promote_types(s.shard.dtype, torch.float32))
            amax = w.abs().amax(dim=1)
            scale = torch.where(amax > 0, INT8_MAX / amax, torch.ones_like(amax))  # padding rows: 1
            local.append(((w * scale[:, None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale))
        full_scales = exchange.all_gather_rows([scale for _, scale in local])
        results = []
        for s, (q, _), scale in zip(shards, local, full_scales):
            if s.home is not None and s.previous is None:  # the copy-engine transport gathers from there
                q = s.home.copy_(q)
            results.append(store_quantized(s, q, scale))
        return results

    def operand(self, weight, buffer, quant, rows, compute_dtype):
        return Int8Weight(weight, quant.scale_inv, rows)
