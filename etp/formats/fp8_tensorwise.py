"""``fp8_tensorwise``: e4m3 with one scale per dense weight or per expert, delayed scaling,
and FP8 GEMMs on sm90+. See [Note: ETP FP8 gathers] in ``etp.formats.fp8``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..kernels import MultiTensorCastPlan, amax_to_scale, multi_tensor_amax
from ..streams import to_device_async
from .base import QuantizedShard, ScaleExchange, ShardToQuantize, fp8_compute_applies, store_quantized
from .fp8 import FP8_DTYPE, FP8Format, FP8Weight, prepare_scale_rows

__all__ = ["FP8Tensorwise", "cast_tensorwise"]


def cast_tensorwise(views, slot_index: torch.Tensor, slots: int, out, *,
                    prev_amax: torch.Tensor | None = None, reduce_amax=None,
                    plan: MultiTensorCastPlan | None = None):
    """Tensorwise e4m3 of weight pieces into the given buffers: piece ``i`` belongs to scale
    group ``slot_index[i]`` of ``slots``. Returns ``(scales [slots], amax [slots])``.

    Current scaling (``prev_amax`` None): one amax launch, ``reduce_amax(amax)`` (the ETP
    group's all-reduce(MAX), in place), one cast launch. Delayed scaling (``prev_amax``: the
    groups' amax of the previous step): one cast with the previous scales that also records
    this step's amax ([Note: ETP FP8 gathers]), the reduction, then a re-cast, decided on the
    device, of just the groups whose amax grew (with their own scales): no value ever
    saturates, and the amax read pass is gone. No host synchronization either way.

    ``plan``: a ``MultiTensorCastPlan`` made for exactly these ``views`` and destinations
    (kept by a caller that casts the same buffers every step: its launch tables are built
    once); by default one is made for this call.

    Example::

        scales, amax = cast_tensorwise(shards, torch.arange(n, device=dev), n, out=fp8_buffers,
                                       prev_amax=last_amax)
    """
    device = slot_index.device
    reduce_amax = reduce_amax or (lambda amax: None)
    if plan is None and views:
        plan = MultiTensorCastPlan(views, out=out)
    amax = torch.zeros(slots, dtype=torch.float32, device=device)
    if prev_amax is None:
        if views:
            amax.scatter_reduce_(0, slot_index, multi_tensor_amax(views), reduce="amax")
        reduce_amax(amax)
        scales = amax_to_scale(amax)
        if views:
            plan.run(scales[slot_index])
        return scales, amax
    used = amax_to_scale(prev_amax)
    if views:
        piece_amax = torch.empty(len(views), dtype=torch.float32, device=device)
        plan.run(used[slot_index], amax_out=piece_amax)
        amax.scatter_reduce_(0, slot_index, piece_amax, reduce="amax")
    reduce_amax(amax)
    grew = ~(amax <= prev_amax)  # a NaN amax re-casts too (to NaN, as current scaling does)
    fresh = amax_to_scale(amax)
    if views:
        plan.run(fresh[slot_index], only=grew[slot_index])
    return torch.where(grew, fresh, used), amax


def _groups(layout) -> tuple[int, int]:
    """(number of scale groups, logical rows per group) of a weight."""
    shape = layout.logical_shape
    if len(shape) == 3:
        return shape[0], shape[1]
    return 1, layout.rows


def _pieces(layout) -> list[tuple[int, int, int]]:
    """The logical rows of this rank's shard cut at scale-group boundaries:
    ``(group, first local row, end local row)`` for each piece."""
    _, per_group = _groups(layout)
    start, stop = layout.row_start, layout.row_start + layout.valid_rows
    pieces = []
    for group in range(start // per_group, -(-stop // per_group)):
        a, b = max(start, group * per_group), min(stop, (group + 1) * per_group)
        if b > a:
            pieces.append((group, a - start, b - start))
    return pieces


@dataclass(eq=False)
class _TensorwisePlan:
    """What one group's tensorwise quantization casts, and where to: built once and kept while
    the shards and their FP8 buffers stay where they are (the views read the live shards)."""

    key: tuple
    views: list  # the weight pieces, one per (weight, scale group)
    outs: list  # their FP8 destinations
    slot_index: torch.Tensor  # the scale group of each piece (device)
    slots: int
    first_slot: dict  # ident -> the weight's first scale group
    cast: MultiTensorCastPlan | None  # views -> outs, its launch tables kept with the plan


def _tensorwise_plan(shards: Sequence[ShardToQuantize], outs: list, plans: dict) -> _TensorwisePlan:
    # Kept across steps: rebuilding it slices every piece on the host each step, and its index
    # copy to the device comes from pageable memory, which makes the host wait for the GPU.
    key = tuple((s.ident, s.shard.data_ptr(), out.data_ptr()) for s, out in zip(shards, outs))
    plan = plans.get(len(shards))
    if plan is not None and plan.key == key:
        return plan
    first_slot, views, dests, slots = {}, [], [], []
    total = 0
    for s, out in zip(shards, outs):
        first_slot[s.ident] = total
        for g, lo, hi in _pieces(s.layout):
            views.append(s.shard[lo:hi])
            dests.append(out[lo:hi])
            slots.append(total + g)
        total += _groups(s.layout)[0]
    plan = _TensorwisePlan(
        key,
        views=views,
        outs=dests,
        slot_index=to_device_async(torch.tensor(slots, dtype=torch.int64), shards[0].shard.device),
        slots=total,
        first_slot=first_slot,
        cast=MultiTensorCastPlan(views, out=dests) if views else None,
    )
    plans[len(shards)] = plan
    return plan


def _previous_amax(shards: Sequence[ShardToQuantize]) -> torch.Tensor | None:
    """The group's amax of the previous quantization when every weight has one (delayed
    scaling), else None (a first quantization: current scaling)."""
    prev = []
    for s in shards:
        if s.previous is None or s.previous.amax is None:
            return None
        prev.append(s.previous.amax)
    return torch.cat(prev)


class FP8Tensorwise(FP8Format):
    """e4m3, one scale per dense weight or per expert; scaled FP8 GEMMs on sm90+.

    Example::

        ETPConfig(etp_size=4, gather_dtype="fp8_tensorwise")
    """

    name = "fp8_tensorwise"
    fp8_gemms = True

    def fp8_gemm_applies(self, x: torch.Tensor, weight_shape, grouped: bool) -> bool:
        return fp8_compute_applies(x, weight_shape, grouped)

    def quantize(self, shards: Sequence[ShardToQuantize], exchange: ScaleExchange,
                 plans: dict) -> list[QuantizedShard]:
        """A weight's first quantization: amax (one launch), all-reduce(MAX) (one collective),
        cast (one launch); later ones are delayed: see ``cast_tensorwise``. Straight into the
        stable shard buffers (last step's, or the symmetric home): no temporary, no copy."""
        device = shards[0].shard.device
        outs = []
        for s in shards:
            out = s.previous.data if s.previous is not None else s.home
            if out is None:  # padding rows stay fp8 zeros (all bits 0) forever
                out = torch.zeros(s.shard.shape, dtype=FP8_DTYPE, device=device)
            outs.append(out)
        plan = _tensorwise_plan(shards, outs, plans)
        scales, amax = cast_tensorwise(plan.views, plan.slot_index, plan.slots, plan.outs,
                                       prev_amax=_previous_amax(shards), reduce_amax=exchange.all_reduce_max,
                                       plan=plan.cast)
        results = []
        for s, out in zip(shards, outs):
            first, n = plan.first_slot[s.ident], _groups(s.layout)[0]
            quant = store_quantized(s, out, scales[first: first + n], amax[first: first + n])
            prepare_scale_rows(quant.scale_inv, s.layout.logical_shape)
            results.append(quant)
        return results

    def operand(self, weight, buffer, quant, rows, compute_dtype) -> FP8Weight:
        return FP8Weight(weight, quant.scale, quant.scale_inv, False, buffer, rows)
