"""Quantized weight gathers: FP8 shards produced once per optimizer step.

[Note: ETP FP8 gathers]
With ``gather_dtype`` ``fp8_tensorwise`` or ``fp8_blockwise`` every ETP weight travels as
float8_e4m3fn (one byte per element instead of two), so an all-gather moves half the bytes.
The FP8 shard is made once per optimizer step by ``quantize_shards`` (never per microbatch):

* ``fp8_tensorwise``: one scale per *scale group*, the whole weight for a dense weight and
  each expert for stacked ``[E, out, in]`` experts. One fused multi-tensor amax launch over
  the pieces of all shards, one coalesced all-reduce(MAX) per ETP group (not one per weight
  or expert: a small all-reduce costs about as much as a large one, its latency), one fused
  cast. Every rank then holds
  the same full set of scales, so the gather moves FP8 bytes only.
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

A gathered weight reaches the GEMMs as an ``FP8Weight``: on sm90+ they run
``torch._scaled_mm`` / ``torch._scaled_grouped_mm`` with the activation quantized on the fly;
elsewhere (CPU included) the weight is dequantized and the ordinary GEMM runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from .collectives import all_gather_tensor
from .derived import per_version
from .kernels import (
    MultiTensorCastPlan,
    amax_to_scale,
    dequantize_fp8,
    multi_tensor_amax,
    quantize_blockwise,
    transpose_last2,
)
from .param import ETPShardedParam
from .streams import to_device_async

__all__ = ["FP8Weight", "QuantizedShard", "cast_tensorwise", "quantize_shards", "scale_rows",
           "prepare_scale_rows", "FP8_DTYPE", "BLOCK"]

FP8_DTYPE = torch.float8_e4m3fn
BLOCK = 128  # rows and columns of one fp8_blockwise weight block


@dataclass(eq=False)
class QuantizedShard:
    """This rank's FP8 shard of one weight and the scales of the *full* weight.

    ``scale`` is what real values were multiplied by before the cast (``448 / amax``):
    ``[groups]`` for tensorwise, ``[padded_rows / 128, ceil(cols / 128)]`` for blockwise;
    ``scale_inv = 1 / scale`` is the dequantization multiplier the scaled GEMMs take.
    """

    data: torch.Tensor
    scale: torch.Tensor
    version: int
    scale_inv: torch.Tensor | None = None
    amax: torch.Tensor | None = None  # tensorwise: the full weight's amax per group (delayed scaling)

    def __post_init__(self) -> None:
        if self.scale_inv is None:  # once per step, not once per GEMM
            self.scale_inv = 1.0 / self.scale


@dataclass(frozen=True, eq=False)
class FP8Weight:
    """A gathered FP8 weight: ``data`` in the logical shape, plus its dequantization scales."""

    data: torch.Tensor
    scale: torch.Tensor
    scale_inv: torch.Tensor
    blockwise: bool
    padded: torch.Tensor  # the gathered [padded_rows, cols] buffer (blockwise dequantizes it)
    rows: int
    # ``data`` with its last two dims swapped, made with it (``multi_tensor_cast_fp8``'s
    # write_transposed) by callers that keep a full FP8 weight for a whole step; otherwise
    # the input-gradient GEMM transposes ``data`` itself.
    transposed: torch.Tensor | None = None

    def scale_rows(self, groups: int, n: int) -> torch.Tensor:
        """``scale_inv`` as the ``[groups, n]`` per-column scales of a rowwise-scaled GEMM's
        weight operand (``scale_rows``)."""
        return scale_rows(self.scale_inv, groups, n)

    def data_transposed(self) -> torch.Tensor:
        """``data`` with its last two dims swapped, contiguous (the input-gradient operand)."""
        return self.transposed if self.transposed is not None else transpose_last2(self.data)

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
    Called right after ``scale_inv`` is rewritten (``quantize_shards``; the expert-stack
    benchmark's replicated FP8 baseline likewise)."""
    if scale_inv.is_cuda and torch.cuda.is_current_stream_capturing():
        return  # a captured GEMM computes its own (per_version does not cache under capture)
    groups = weight_shape[0] if len(weight_shape) == 3 else 1
    for n in weight_shape[-2:]:
        scale_rows(scale_inv, groups, n)


def _groups(param) -> tuple[int, int]:
    """(number of scale groups, logical rows per group) of a weight."""
    shape = param.etp_layout.logical_shape
    if len(shape) == 3:
        return shape[0], shape[1]
    return 1, param.etp_layout.rows


def _pieces(param) -> list[tuple[int, int, int]]:
    """The logical rows of this rank's shard cut at scale-group boundaries:
    ``(group, first local row, end local row)`` for each piece."""
    layout = param.etp_layout
    _, per_group = _groups(param)
    start, stop = layout.row_start, layout.row_start + layout.valid_rows
    pieces = []
    for group in range(start // per_group, -(-stop // per_group)):
        a, b = max(start, group * per_group), min(stop, (group + 1) * per_group)
        if b > a:
            pieces.append((group, a - start, b - start))
    return pieces


def cast_tensorwise(views, slot_index: torch.Tensor, slots: int, out, *, out_transposed=None,
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
        plan = MultiTensorCastPlan(views, write_transposed=out_transposed is not None, out=out,
                                   out_transposed=out_transposed)
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


def _quantize_tensorwise(params, group) -> None:
    """A weight's first quantization: amax (one launch), all-reduce(MAX) (one collective),
    cast (one launch); later ones are delayed: see ``cast_tensorwise``."""
    device = params[0].device
    quantized = {}
    for param in params:
        state = param.etp_runtime.gathers.state(param)
        buffer = state.quant.data if state.quant is not None else state.quant_home
        if buffer is None:  # padding rows stay fp8 zeros (all bits 0) forever
            buffer = torch.zeros(param.shape, dtype=FP8_DTYPE, device=device)
        quantized[id(param)] = buffer
    plan = _tensorwise_plan(params, quantized)

    def reduce_amax(amax: torch.Tensor) -> None:
        if group.size > 1:
            with record_function("etp::all_reduce"):
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group.ag_group)

    # Straight into the stable shard buffers: no temporary, no copy.
    scales, amax = cast_tensorwise(plan.views, plan.slot_index, plan.slots, plan.outs,
                                   prev_amax=_previous_amax(params), reduce_amax=reduce_amax, plan=plan.cast)
    for param in params:
        first, n = plan.first_slot[id(param)], _groups(param)[0]
        _store(param, quantized[id(param)], scales[first : first + n], param._version, amax[first : first + n])
        prepare_scale_rows(param.etp_runtime.gathers.state(param).quant.scale_inv, param.etp_layout.logical_shape)


@dataclass(eq=False)
class _TensorwisePlan:
    """What one group's tensorwise quantization casts, and where to: built once and kept while
    the shards and their FP8 buffers stay where they are (the views read the live shards)."""

    key: tuple
    views: list  # the weight pieces, one per (param, scale group)
    outs: list  # their FP8 destinations
    slot_index: torch.Tensor  # the scale group of each piece (device)
    slots: int
    first_slot: dict  # id(param) -> its first scale group
    cast: MultiTensorCastPlan | None  # views -> outs, its launch tables kept with the plan


def _tensorwise_plan(params, quantized) -> _TensorwisePlan:
    # Kept across steps: rebuilding it slices every piece on the host each step, and its index
    # copy to the device comes from pageable memory, which makes the host wait for the GPU.
    key = tuple((id(p), p.data_ptr(), quantized[id(p)].data_ptr()) for p in params)
    plans = params[0].etp_runtime.quant_plans
    group_key = (params[0].etp_group.ranks, len(params))
    plan = plans.get(group_key)
    if plan is not None and plan.key == key:
        return plan
    first_slot, pieces, slots = {}, [], []
    total = 0
    for param in params:
        first_slot[id(param)] = total
        for g, lo, hi in _pieces(param):
            pieces.append((param, lo, hi))
            slots.append(total + g)
        total += _groups(param)[0]
    views = [param.detach()[lo:hi] for param, lo, hi in pieces]
    outs = [quantized[id(param)][lo:hi] for param, lo, hi in pieces]
    plan = _TensorwisePlan(
        key,
        views=views,
        outs=outs,
        slot_index=to_device_async(torch.tensor(slots, dtype=torch.int64), params[0].device),
        slots=total,
        first_slot=first_slot,
        cast=MultiTensorCastPlan(views, out=outs) if views else None,
    )
    plans[group_key] = plan
    return plan


def _previous_amax(params) -> torch.Tensor | None:
    """The group's amax of the previous quantization when every weight has one (delayed
    scaling), else None (a first quantization: current scaling)."""
    prev = []
    for param in params:
        quant = param.etp_runtime.gathers.state(param).quant
        if quant is None or quant.amax is None:
            return None
        prev.append(quant.amax)
    return torch.cat(prev)


def _quantize_blockwise(params, group) -> None:
    """Local blockwise quantization; one all-gather of every weight's block scales."""
    local = []
    for param in params:
        q, scales = quantize_blockwise(param.detach(), BLOCK, BLOCK)
        local.append((param, q, scales))
    flat = torch.cat([s.reshape(-1) for _, _, s in local])
    gathered = flat.new_empty(flat.numel() * group.size)
    if group.size > 1:
        with record_function("etp::all_gather"):
            all_gather_tensor(gathered, flat, group=group.ag_group)
    else:
        gathered.copy_(flat)
    per_rank = gathered.view(group.size, -1)
    offset = 0
    for param, q, scales in local:
        n = scales.numel()
        full = per_rank[:, offset : offset + n].reshape(group.size * scales.shape[0], scales.shape[1])
        offset += n
        state = param.etp_runtime.gathers.state(param)
        if state.quant_home is not None and state.quant is None:  # the copy-engine transport gathers from there only
            q = state.quant_home.copy_(q)
        _store(param, q, full, param._version)


def _store(param, data: torch.Tensor, scale: torch.Tensor, version: int, amax: torch.Tensor | None = None) -> None:
    """Keeps this step's FP8 shard and scales. After the first step they are written into
    the tensors of the previous step, so their addresses never change: a CUDA graph that
    captured a gather and its scaled GEMMs reads the new step's values at replay."""
    state = param.etp_runtime.gathers.state(param)
    old = state.quant
    if old is not None and old.data.shape == data.shape and old.scale.shape == scale.shape:
        if old.data.data_ptr() != data.data_ptr():
            old.data.copy_(data)
        old.scale.copy_(scale)
        torch.reciprocal(old.scale, out=old.scale_inv)
        old.version = version
        if amax is not None and old.amax is not None and old.amax.shape == amax.shape:
            old.amax.copy_(amax)
        else:
            old.amax = None if amax is None else amax.clone()
    else:
        state.quant = QuantizedShard(data, scale.contiguous(), version,
                                     amax=None if amax is None else amax.clone())


def quantize_shards(model_or_params) -> int:
    """Quantizes every FP8-gathered ETP shard of a model (or an iterable of ETP params) for
    the coming step; a collective over the ETP groups (every rank calls it). Returns the
    number of weights quantized. See [Note: ETP FP8 gathers].

    Example::

        optimizer.step()
        etp.quantize_shards(model)   # optional with torch optimizers: etp notices updates
    """

    params = model_or_params.parameters() if hasattr(model_or_params, "parameters") else model_or_params
    by_group: dict[tuple, list] = {}
    for param in params:
        if isinstance(param, ETPShardedParam) and param.etp_config.gather_dtype.startswith("fp8"):
            by_group.setdefault((param.etp_group.ranks, param.etp_config.gather_dtype), []).append(param)
    with torch.no_grad(), record_function("etp::quantize_shards"):
        for (_, mode), group_params in sorted(by_group.items(), key=lambda kv: kv[0]):
            group = group_params[0].etp_group
            if mode == "fp8_tensorwise":
                _quantize_tensorwise(group_params, group)
            else:
                _quantize_blockwise(group_params, group)
    return sum(len(v) for v in by_group.values())
