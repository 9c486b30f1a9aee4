"""Fused multi-tensor FP8 (e4m3fn) cast with an optional transposed copy: the launcher and
the public API (the Triton kernel: :mod:`etp.kernels.cast_kernel`; its launch tables and
output buffers: :mod:`etp.kernels.cast_tables`; the conversions it shares with the other FP8
kernels: :mod:`etp.kernels.fp8_convert`)."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import triton.language as tl

from etp.kernels.amax import (
    _DTYPE_CODE,
    _FLAT_EVICT,
    _LINEAR_SEARCH_MAX_TENSORS,
    EXACT_FP,
    check_impl,
    check_input_dtype,
    common_device,
    interpreter_active,
    load_ty,
    needs_staging,
    next_pow2,
    select_impl,
)
from etp.kernels.cast_kernel import _multi_tensor_cast_fp8_kernel
from etp.kernels.cast_tables import _alloc_outputs, _CastTables, _check_out
from etp.kernels.launch import launch
from etp.kernels.reference import FP8_E4M3_MAX, amax_to_scale_ref, multi_tensor_amax_ref, multi_tensor_cast_fp8_ref

__all__ = ["FP8_E4M3_MAX", "MultiTensorCastPlan", "amax_to_scale", "multi_tensor_cast_fp8"]

# The cast's own launch shape, not the amax's: it writes as well as reads, so fewer warps and
# more unrolled iterations per program keep more loads in flight per byte stored (chosen by a
# sweep of block, iterations and warps; the kernels' byte rates: BENCHMARKS.md, 'Kernels').
_FLAT_BLOCK = 2048
_FLAT_ITERS = 8
_FLAT_WARPS = 4
# Tile of the transposing path: 128 x 128 tiles with 8 warps move the most bytes per second
# in the same sweep, with the amax recorded or not.
_TILE_R = 128
_TILE_C = 128
_TILE_WARPS = 8


def _launch_multi_tensor_cast_fp8(
    tensors: Sequence[torch.Tensor],
    scales: torch.Tensor,
    qs: Sequence[torch.Tensor],
    qts: Optional[Sequence[torch.Tensor]],
    *,
    block: int = _FLAT_BLOCK,
    iters: int = _FLAT_ITERS,
    tile_r: int = _TILE_R,
    tile_c: int = _TILE_C,
    linear_search_max: int = _LINEAR_SEARCH_MAX_TENSORS,
    num_warps: Optional[int] = None,
    evict: str = _FLAT_EVICT,
    amax_bits: Optional[torch.Tensor] = None,
    only: Optional[torch.Tensor] = None,
    tables: Optional[_CastTables] = None,
) -> None:
    """One launch per input dtype; writes into the preallocated ``qs`` / ``qts`` (and folds
    each tensor's max |x| into ``amax_bits``, int32 bits of zeroed float32, when given;
    skips tensors whose ``only`` entry, uint8, is 0). ``tables``: built before for exactly
    these inputs and destinations (``MultiTensorCastPlan``), else built here."""
    soft = interpreter_active()
    if tables is None:
        tables = _CastTables(tensors, qs, qts, block, iters, tile_r, tile_c)
    if num_warps is None:
        num_warps = _TILE_WARPS if tables.write_t else _FLAT_WARPS
    for table, (dtype, n_t, total, aligned) in zip(tables.device_tables, tables.launches):
        launch(_multi_tensor_cast_fp8_kernel, (total,),
            table,
            scales,
            scales if amax_bits is None else amax_bits,
            scales if only is None else only,
            len(tensors),
            n_t,
            IN_TY=load_ty(dtype, soft),
            OUT_TY=tl.uint8 if soft else tl.float8e4nv,
            DTYPE=_DTYPE_CODE[dtype],
            SOFT=soft,
            ALIGNED=aligned,
            LINEAR_SEARCH=n_t <= linear_search_max,
            T_POW2=next_pow2(n_t),
            WRITE_T=tables.write_t,
            FP8_MAX=FP8_E4M3_MAX,
            BLOCK=block,
            ITERS=iters,
            TILE_R=tile_r,
            TILE_C=tile_c,
            EVICT=evict,
            HAS_AMAX=amax_bits is not None,
            ONLY=only is not None,
            num_warps=num_warps,
            **EXACT_FP,
        )


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


def amax_to_scale(amax: torch.Tensor, fp8_max: float = FP8_E4M3_MAX, *, impl: str = "auto") -> torch.Tensor:
    """Per-tensor FP8 scale from amax: ``fp8_max / amax`` in float32, 1.0 where amax == 0.

    The division is a correctly rounded float32 division (no division by
    zero ever happens).  amax = inf gives scale 0 and amax = NaN gives NaN.
    This is a tiny elementwise op, so both impls run the same torch code; the
    ``impl`` argument is validated for API uniformity.

    Args:
        amax: amax values (any float dtype, any shape), e.g. from :func:`multi_tensor_amax`.
        fp8_max: largest representable value of the target format (448 for e4m3fn).
        impl: ``"auto"``, ``"triton"`` or ``"torch"`` (all use torch here).

    Returns:
        float32 tensor shaped like ``amax``.

    Example::

        amax = multi_tensor_amax(shards)
        scales = amax_to_scale(amax)          # scales[i] * amax[i] ~= 448
    """
    check_impl(impl)
    return amax_to_scale_ref(amax, fp8_max)


def multi_tensor_cast_fp8(
    tensors: Sequence[torch.Tensor],
    scales: torch.Tensor,
    *,
    write_transposed: bool = False,
    out: Optional[Sequence[torch.Tensor]] = None,
    out_transposed: Optional[Sequence[torch.Tensor]] = None,
    amax_out: Optional[torch.Tensor] = None,
    only: Optional[torch.Tensor] = None,
    impl: str = "auto",
) -> Tuple[List[torch.Tensor], Optional[List[torch.Tensor]]]:
    """Cast many tensors to float8_e4m3fn with per-tensor scales in one launch per dtype.

    ``q_i = float8_e4m3fn(clamp(x_i.float() * scales[i], -448, 448))`` with
    round-to-nearest-even, bit-exact to the torch reference.  +-inf saturates
    to +-448; NaN stays NaN (the NaN's sign bit is not guaranteed to survive on
    GPU).  With ``write_transposed`` the same pass also writes ``q_i`` with its
    last two dims swapped (``[out, in] -> [in, out]``,
    ``[E, out, in] -> [E, in, out]``) for the backward GEMM; for 1-D inputs
    that list holds the same tensor object as ``q_i``.  Inputs of mixed dtypes
    are grouped, one launch per dtype.  The tensor table is uploaded on every
    call, so this one-shot form is not CUDA-graph capturable
    (``MultiTensorCastPlan`` keeps them, and is).  On the Triton path
    all outputs are views of one allocation (one allocator call per call
    instead of one per output), so holding any of them keeps that whole buffer
    alive; copy out what must outlive the rest.

    Args:
        tensors: contiguous bf16 / fp16 / fp32 tensors with 1, 2 or 3 dims, on one device.
        scales: float32 tensor ``[len(tensors)]`` on the same device.
        write_transposed: also produce the transposed copies.
        out: contiguous float8_e4m3fn destinations, one per input with its shape (views into
            the buffers the casts live in, e.g. a stable FP8 weight): the cast writes there
            directly, no allocation and no copy afterwards.
        out_transposed: with ``out`` and ``write_transposed``, the transposed destinations
            (ignored for 1-D inputs, whose transposed output is ``out[i]``).
        amax_out: float32 ``[len(tensors)]`` that receives each input's ``max |x|`` (what
            :func:`multi_tensor_amax` returns) from the cast's own read: delayed scaling
            casts with the previous step's scale and records this step's amax in one pass.
        only: bool ``[len(tensors)]`` on the device: inputs whose entry is False are not
            cast at all (their outputs keep their contents, their ``amax_out`` entries are
            0); needs ``out=``. The re-cast of delayed scaling, decided on the device: no
            host synchronization.
        impl: ``"auto"`` (Triton on CUDA tensors, torch reference otherwise),
            ``"triton"`` (CPU tensors only under ``TRITON_INTERPRET=1``) or ``"torch"``.

    Returns:
        ``(qs, qts)``: the fp8 tensors, and the transposed fp8 tensors or None.

    Example::

        scales = amax_to_scale(multi_tensor_amax(shards))
        qs, qts = multi_tensor_cast_fp8(shards, scales, write_transposed=True)
    """
    plan = MultiTensorCastPlan(tensors, write_transposed=write_transposed, out=out,
                               out_transposed=out_transposed, impl=impl, devices=[scales])
    return plan.run(scales, amax_out=amax_out, only=only)


class MultiTensorCastPlan:
    """``multi_tensor_cast_fp8`` of one fixed set of inputs into fixed destinations (``out=``),
    checked once and run many times. On the Triton path its launch tables (every input's and
    destination's address, size and first program) are built and uploaded at the first run
    and kept, so a later run is the launch alone: no Python pass over the inputs, no
    host-to-device copy. Rebuilding them on every call is a host pass over every expert piece
    of the model per iteration (hundreds per rank), which shows up as host time of
    ``etp::quantize_shards``; and an upload inside a CUDA graph capture is not replayable, so
    a run under capture uses the kept tables (or builds uncached ones when none are kept yet).

    The plan holds the tensors (so their addresses stay valid): build a new one when a
    weight or destination moves. Without ``out=`` every run allocates new outputs and builds
    its tables anew.

    Args: as ``multi_tensor_cast_fp8`` (``scales``, ``amax_out`` and ``only`` go to ``run``).

    Example::

        plan = MultiTensorCastPlan(shards, out=fp8_shards)   # once, while the buffers stay
        plan.run(amax_to_scale(multi_tensor_amax(shards)))   # every step: one launch
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        write_transposed: bool = False,
        out: Optional[Sequence[torch.Tensor]] = None,
        out_transposed: Optional[Sequence[torch.Tensor]] = None,
        impl: str = "auto",
        devices: Sequence[torch.Tensor] = (),
    ) -> None:
        tensors = list(tensors)
        device = common_device(tensors + list(devices), "tensors and scales")
        for i, t in enumerate(tensors):
            check_input_dtype(t, f"tensors[{i}]")
            if t.dim() not in (1, 2, 3):
                raise ValueError(f"tensors[{i}] must have 1, 2 or 3 dims, got shape {tuple(t.shape)}")
            if not t.is_contiguous():
                raise ValueError(f"tensors[{i}] is not contiguous; call .contiguous() first")
        if out is not None:
            out = _check_out(out, [t.shape for t in tensors], device, "out")
            if write_transposed:
                if out_transposed is None:
                    raise ValueError("write_transposed with out= needs out_transposed= as well")
                if len(out_transposed) != len(tensors):
                    raise ValueError(f"out_transposed has {len(out_transposed)} tensors for {len(tensors)} inputs")
                # A 1-D input's transposed output is its out[i] (whatever was passed there).
                out_transposed = [o if t.dim() >= 2 else q for t, q, o in zip(tensors, out, out_transposed)]
                transposed_shapes = [(*t.shape[:-2], t.shape[-1], t.shape[-2]) if t.dim() >= 2 else t.shape
                                     for t in tensors]
                out_transposed = _check_out(out_transposed, transposed_shapes, device, "out_transposed")
        self.tensors, self.device, self.impl = tensors, device, impl
        self.write_transposed = write_transposed
        self.out = out
        self.out_transposed = out_transposed if write_transposed else None
        self._triton = select_impl(impl, device) and not needs_staging(device)
        self._tables: Optional[_CastTables] = None

    def _tables_for(self, qs, qts) -> Optional[_CastTables]:
        """The kept launch tables (fixed destinations only); built at the first run outside a
        CUDA graph capture."""
        if self.out is None:
            return None
        if self._tables is None:
            tables = _CastTables(self.tensors, qs, qts, _FLAT_BLOCK, _FLAT_ITERS, _TILE_R, _TILE_C)
            capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            if capturing:
                return tables  # its upload belongs to this capture: not kept for eager runs
            self._tables = tables
        return self._tables

    def run(
        self,
        scales: torch.Tensor,
        *,
        amax_out: Optional[torch.Tensor] = None,
        only: Optional[torch.Tensor] = None,
    ) -> Tuple[List[torch.Tensor], Optional[List[torch.Tensor]]]:
        """Casts with ``scales`` (float32 ``[len(tensors)]``); ``amax_out`` and ``only`` as
        for ``multi_tensor_cast_fp8``. Returns ``(qs, qts)``."""
        tensors, device, write_transposed = self.tensors, self.device, self.write_transposed
        out, out_transposed = self.out, self.out_transposed
        if scales.dtype != torch.float32:
            raise TypeError(f"scales must be float32, got {scales.dtype}")
        if scales.dim() != 1 or scales.numel() != len(tensors):
            raise ValueError(f"scales must have shape [{len(tensors)}], got {tuple(scales.shape)}")
        if tensors and scales.device != device:
            raise ValueError(f"all tensors and scales must be on one device, got {device} and {scales.device}")
        device = scales.device if not tensors else device
        for name, t, dtype in (("amax_out", amax_out, torch.float32), ("only", only, torch.bool)):
            if t is not None and (t.dtype != dtype or t.shape != (len(tensors),) or t.device != device):
                raise ValueError(f"{name} must be a {dtype} tensor of shape [{len(tensors)}] on {device}, "
                                 f"got {t.dtype} {tuple(t.shape)} on {t.device}")
        if only is not None and out is None:
            raise ValueError("only= leaves skipped outputs as they are: pass the destinations with out=")
        if not self._triton:
            return self._run_reference(scales, amax_out, only)
        if out is None:
            qs, qts = _alloc_outputs(tensors, write_transposed)
        else:
            qs, qts = list(out), (list(out_transposed) if write_transposed else None)
        amax_bits = None
        if amax_out is not None:
            amax_out.zero_()
            amax_bits = amax_out.view(torch.int32)
        if only is not None:  # [N + 1]: the flags, then whether any is set (checked first)
            only = torch.cat([only, only.any().view(1)]).view(torch.uint8)
        if tensors:
            _launch_multi_tensor_cast_fp8(tensors, scales.contiguous(), qs, qts, amax_bits=amax_bits, only=only,
                                          tables=self._tables_for(qs, qts))
        return qs, qts

    def _run_reference(self, scales, amax_out, only):
        """The torch reference (``impl="torch"``, CPU) or the Triton kernel staged on the CPU
        (``TRITON_INTERPRET=1`` with CUDA tensors)."""
        tensors, device, write_transposed = self.tensors, scales.device, self.write_transposed
        out, out_transposed = self.out, self.out_transposed
        picked = [True] * len(tensors) if only is None else only.tolist()  # the reference path may sync
        if not select_impl(self.impl, device):
            qs, qts = multi_tensor_cast_fp8_ref(tensors, scales, write_transposed=write_transposed)
            if amax_out is not None:
                amax_out.copy_(torch.where(torch.tensor(picked, device=device),
                                           multi_tensor_amax_ref(tensors).to(device), 0.0))
        else:
            staged_amax = None if amax_out is None else torch.zeros(len(tensors))
            qs, qts = multi_tensor_cast_fp8([t.cpu() for t in tensors], scales.cpu(),
                                            write_transposed=write_transposed, amax_out=staged_amax,
                                            impl="triton")
            if amax_out is not None:
                amax_out.copy_(torch.where(torch.tensor(picked), staged_amax, 0.0))
        if out is None:
            qs = [q.to(device) for q in qs]
            if qts is None:
                return qs, None
            return qs, [qs[i] if t.dim() < 2 else qt.to(device) for i, (t, qt) in enumerate(zip(tensors, qts))]
        for dst, q, keep in zip(out, qs, picked):  # bytes: uint8 views copy FP8 on every torch version
            if keep:
                dst.view(torch.uint8).copy_(q.view(torch.uint8))
        if qts is not None:
            for t, dst, qt, keep in zip(tensors, out_transposed, qts, picked):
                if t.dim() >= 2 and keep:
                    dst.view(torch.uint8).copy_(qt.view(torch.uint8))
        return list(out), (list(out_transposed) if write_transposed else None)
