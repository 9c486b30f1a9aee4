"""Fused multi-tensor FP8 (e4m3fn) cast: ``q_i = e4m3fn(clamp(x_i * scales[i], -448, 448))`` for
many tensors in one launch per input dtype, optionally recording each input's max |x| from the
same read (delayed scaling) and skipping the inputs a device-side mask leaves out (its re-cast).

Three layers, top to bottom of this file:

* the Triton kernel ``_multi_tensor_cast_fp8_kernel``: one program per chunk of one input,
  found in a launch table;
* the launch: the tables (``_CastTables``: every input's and destination's address, size and
  first program, one table per input dtype), the output buffers (``_alloc_outputs``), the
  checks of caller-given destinations (``_check_out``) and ``_launch_multi_tensor_cast_fp8``;
* the API: ``multi_tensor_cast_fp8`` (one call) and ``MultiTensorCastPlan`` (fixed
  destinations, the tables built once: what ``etp.quantize_shards`` runs every step).

The numerics are :func:`etp.kernels.reference.multi_tensor_cast_fp8_ref`'s (the kernel equals
it bit for bit); the conversions shared with the other FP8 kernels live in
:mod:`etp.kernels.fp8_convert`. The cast writes no transposed copy: the input-gradient GEMM
transposes the gathered weight itself (``etp.kernels.transpose_last2``).
"""

from __future__ import annotations

import math
import warnings
from typing import List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from etp.kernels.amax import (
    _DTYPE_CODE,
    _FLAT_EVICT,
    _LINEAR_SEARCH_MAX_TENSORS,
    EXACT_FP,
    _abs_bits,
    _find_tensor,
    _to_f32,
    block_starts,
    cdiv,
    check_impl,
    check_input_dtype,
    common_device,
    group_by_dtype,
    interpreter_active,
    load_ty,
    needs_staging,
    next_pow2,
    select_impl,
    upload_tables,
)
from etp.kernels.fp8_convert import _quantize_f32
from etp.kernels.launch import launch
from etp.kernels.reference import FP8_E4M3_MAX, amax_to_scale_ref, multi_tensor_amax_ref, multi_tensor_cast_fp8_ref

__all__ = ["FP8_E4M3_MAX", "MultiTensorCastPlan", "amax_to_scale", "multi_tensor_cast_fp8"]

# The cast's own launch shape, not the amax's: it writes as well as reads, so fewer warps and
# more unrolled iterations per program keep more loads in flight per byte stored (chosen by a
# sweep of block, iterations and warps; the kernels' byte rates: BENCHMARKS.md, 'Kernels').
_FLAT_BLOCK = 2048
_FLAT_ITERS = 8
_FLAT_WARPS = 4
# Outputs share one allocation; each starts at a multiple of this many bytes so
# the kernel keeps its 16-byte-aligned (vectorised) path.
_OUT_ALIGN = 16


# --------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------


@triton.jit
def _multi_tensor_cast_fp8_kernel(
    table_ptr,  # int64 [5, T]: in addr, out addr, numel, first program, scale index
    scales_ptr,  # float32 [N]
    amax_ptr,  # HAS_AMAX: int32 bits of float32 [N], each tensor's max |x| (atomic max)
    only_ptr,  # ONLY: uint8 [N + 1], tensors whose entry is 0 are skipped; [N]: any entry set
    N,
    T,
    IN_TY: tl.constexpr,
    OUT_TY: tl.constexpr,
    DTYPE: tl.constexpr,
    SOFT: tl.constexpr,
    ALIGNED: tl.constexpr,  # every address 16-B aligned
    LINEAR_SEARCH: tl.constexpr,
    T_POW2: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
    EVICT: tl.constexpr,  # eviction policy of the streaming input loads
    HAS_AMAX: tl.constexpr,
    ONLY: tl.constexpr,
):
    """q_t = e4m3fn(clamp(x_t * scales[s_t], -FP8_MAX, FP8_MAX)) for every table entry t.

    Every tensor is processed flat, ``BLOCK * ITERS`` consecutive elements per program;
    static_range unrolls the ITERS steps so their loads are independent and all in flight at
    once. HAS_AMAX: each program also folds the max |x| of what it read (integer bits,
    NaN-propagating, see ``_abs_bits``) into ``amax[s_t]``, one atomic per program: the
    delayed-scaling cast records the amax of the next step's scale from its own read.
    ONLY: programs of tensors with ``only[s_t] == 0`` do nothing.
    """
    if ONLY:
        # Usually nothing is picked (delayed scaling's re-cast): one load, not the table
        # search's chain of dependent loads, before each of the many programs exits.
        if tl.load(only_ptr + N) == 0:
            return
    pid = tl.program_id(0)
    tid = _find_tensor(table_ptr + 3 * T, pid, T, LINEAR_SEARCH, T_POW2)
    idx = tl.load(table_ptr + 4 * T + tid)
    if ONLY:
        if tl.load(only_ptr + idx) == 0:
            return
    in_base = tl.load(table_ptr + tid).to(tl.pointer_type(IN_TY))
    out_base = tl.load(table_ptr + T + tid).to(tl.pointer_type(OUT_TY))
    if ALIGNED:
        # Hints on the pointers (not the int64 addresses) so accesses vectorise.
        in_base = tl.multiple_of(in_base, 16)
        out_base = tl.multiple_of(out_base, 16)
    numel = tl.load(table_ptr + 2 * T + tid)
    start = (pid - tl.load(table_ptr + 3 * T + tid)) * (BLOCK * ITERS)
    scale = tl.load(scales_ptr + idx)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    if start + BLOCK * ITERS <= numel:
        # Full chunk: unmasked accesses vectorise.
        for i in tl.static_range(ITERS):
            o = start + i * BLOCK + offs
            x = _to_f32(tl.load(in_base + o, eviction_policy=EVICT), DTYPE, SOFT)
            acc = tl.maximum(acc, _abs_bits(x))
            tl.store(out_base + o, _quantize_f32(x, scale, FP8_MAX, SOFT))
    else:
        for i in tl.static_range(ITERS):
            o = start + i * BLOCK + offs
            m = o < numel
            x = _to_f32(tl.load(in_base + o, mask=m, other=0, eviction_policy=EVICT), DTYPE, SOFT)
            acc = tl.maximum(acc, _abs_bits(x))
            tl.store(out_base + o, _quantize_f32(x, scale, FP8_MAX, SOFT), mask=m)
    if HAS_AMAX:
        tl.atomic_max(amax_ptr + idx, tl.max(acc, axis=0), sem="relaxed")


# --------------------------------------------------------------------------
# Launch: tables, outputs, the launcher
# --------------------------------------------------------------------------


class _CastTables:
    """The cast's launch tables for one set of inputs and destinations, on the device: one
    flat int64 table per input dtype (the kernel's five columns), and each launch's
    (dtype, tensors, programs, aligned)."""

    def __init__(self, tensors: Sequence[torch.Tensor], qs: Sequence[torch.Tensor]) -> None:
        chunk = _FLAT_BLOCK * _FLAT_ITERS
        self.launches = []
        tables = []
        for dtype, idxs in group_by_dtype(tensors).items():
            ins = [tensors[i].data_ptr() for i in idxs]
            outs = [qs[i].data_ptr() for i in idxs]
            numels = [tensors[i].numel() for i in idxs]
            starts, total = block_starts([cdiv(n, chunk) for n in numels])
            tables.append([ins, outs, numels, starts, list(idxs)])
            aligned = all(a % 16 == 0 for a in ins + outs)
            self.launches.append((dtype, len(idxs), total, aligned))
        self.device_tables = upload_tables(tables, tensors[0].device)[0] if tables else []


def _alloc_outputs(tensors: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """All outputs as views of one allocation (16-byte aligned pieces).

    One ``torch.empty`` instead of one per output: each call into the caching allocator
    costs host time, and for many shards the allocations alone would take longer than the
    kernel.
    """
    if not tensors:
        return []
    sizes = [-(-t.numel() // _OUT_ALIGN) * _OUT_ALIGN for t in tensors]
    buf = torch.empty(sum(sizes), dtype=torch.float8_e4m3fn, device=tensors[0].device)
    return [p[: math.prod(t.shape)].view(t.shape) for p, t in zip(buf.split(sizes), tensors)]


def _check_out(out: Sequence[torch.Tensor], shapes, device: torch.device, what: str) -> List[torch.Tensor]:
    """The caller's destinations ``out`` as a list, each checked to be a contiguous
    float8_e4m3fn tensor of its input's shape on ``device``."""
    out = list(out)
    if len(out) != len(shapes):
        raise ValueError(f"{what} has {len(out)} tensors for {len(shapes)} inputs")
    for i, (o, shape) in enumerate(zip(out, shapes)):
        if o.dtype != torch.float8_e4m3fn or tuple(o.shape) != tuple(shape) or not o.is_contiguous() or o.device != device:
            raise ValueError(
                f"{what}[{i}] must be a contiguous float8_e4m3fn tensor of shape {tuple(shape)} on {device}, "
                f"got {o.dtype} {tuple(o.shape)} (contiguous={o.is_contiguous()}) on {o.device}"
            )
    return out


def _launch_multi_tensor_cast_fp8(
    tensors: Sequence[torch.Tensor],
    scales: torch.Tensor,
    qs: Sequence[torch.Tensor],
    *,
    amax_bits: Optional[torch.Tensor] = None,
    only: Optional[torch.Tensor] = None,
    tables: Optional[_CastTables] = None,
) -> None:
    """One launch per input dtype; writes into the preallocated ``qs`` (and folds each
    tensor's max |x| into ``amax_bits``, int32 bits of zeroed float32, when given; skips
    tensors whose ``only`` entry, uint8, is 0). ``tables``: built before for exactly these
    inputs and destinations (``MultiTensorCastPlan``), else built here."""
    soft = interpreter_active()
    if tables is None:
        tables = _CastTables(tensors, qs)
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
            LINEAR_SEARCH=n_t <= _LINEAR_SEARCH_MAX_TENSORS,
            T_POW2=next_pow2(n_t),
            FP8_MAX=FP8_E4M3_MAX,
            BLOCK=_FLAT_BLOCK,
            ITERS=_FLAT_ITERS,
            EVICT=_FLAT_EVICT,
            HAS_AMAX=amax_bits is not None,
            ONLY=only is not None,
            num_warps=_FLAT_WARPS,
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


# The keywords of the transposed copy the cast used to write beside ``q`` (no product path
# read it: backward transposes the gathered weight). Passed asking for nothing they still work,
# with a warning, for callers written against the old signature; asking for the copy is refused.
_REMOVED_KEYWORDS = ("write_transposed", "out_transposed")


def _refuse_removed(removed: dict, what: str) -> None:
    for name, value in removed.items():
        if name not in _REMOVED_KEYWORDS:
            raise TypeError(f"{what} got an unexpected keyword argument {name!r}")
        if value is not None and value is not False:
            raise ValueError(f"{name}= is gone: the cast writes no transposed copy; transpose its output with "
                             "etp.kernels.transpose_last2(q)")
        warnings.warn(f"{name}= is deprecated and does nothing (the cast writes no transposed copy); drop it",
                      DeprecationWarning, stacklevel=3)


def multi_tensor_cast_fp8(
    tensors: Sequence[torch.Tensor],
    scales: torch.Tensor,
    *,
    out: Optional[Sequence[torch.Tensor]] = None,
    amax_out: Optional[torch.Tensor] = None,
    only: Optional[torch.Tensor] = None,
    impl: str = "auto",
    **removed,
) -> Tuple[List[torch.Tensor], None]:
    """Cast many tensors to float8_e4m3fn with per-tensor scales in one launch per dtype.

    ``q_i = float8_e4m3fn(clamp(x_i.float() * scales[i], -448, 448))`` with
    round-to-nearest-even, bit-exact to the torch reference.  +-inf saturates
    to +-448; NaN stays NaN (the NaN's sign bit is not guaranteed to survive on
    GPU).  Inputs of mixed dtypes are grouped, one launch per dtype.  The tensor
    table is uploaded on every call, so this one-shot form is not CUDA-graph
    capturable (``MultiTensorCastPlan`` keeps it, and is).  On the Triton path
    all outputs are views of one allocation (one allocator call per call
    instead of one per output), so holding any of them keeps that whole buffer
    alive; copy out what must outlive the rest.

    Args:
        tensors: contiguous bf16 / fp16 / fp32 tensors with 1, 2 or 3 dims, on one device.
        scales: float32 tensor ``[len(tensors)]`` on the same device.
        out: contiguous float8_e4m3fn destinations, one per input with its shape (views into
            the buffers the casts live in, e.g. a stable FP8 weight): the cast writes there
            directly, no allocation and no copy afterwards.
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
        ``(qs, None)``: the fp8 tensors (the second element, always None, held the
        transposed copies the cast no longer writes; callers that unpack two keep working).

    Example::

        scales = amax_to_scale(multi_tensor_amax(shards))
        qs, _ = multi_tensor_cast_fp8(shards, scales)
    """
    _refuse_removed(removed, "multi_tensor_cast_fp8")
    plan = MultiTensorCastPlan(tensors, out=out, impl=impl, devices=[scales])
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

    Args: as ``multi_tensor_cast_fp8`` (``scales``, ``amax_out`` and ``only`` go to ``run``);
    ``devices``: tensors that must share the inputs' device (the one-shot call's scales).

    Example::

        plan = MultiTensorCastPlan(shards, out=fp8_shards)   # once, while the buffers stay
        plan.run(amax_to_scale(multi_tensor_amax(shards)))   # every step: one launch
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        *,
        out: Optional[Sequence[torch.Tensor]] = None,
        impl: str = "auto",
        devices: Sequence[torch.Tensor] = (),
        **removed,
    ) -> None:
        _refuse_removed(removed, "MultiTensorCastPlan")
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
        self.tensors, self.device, self.impl, self.out = tensors, device, impl, out
        self._triton = select_impl(impl, device) and not needs_staging(device)
        self._tables: Optional[_CastTables] = None

    def _tables_for(self, qs) -> Optional[_CastTables]:
        """The kept launch tables (fixed destinations only); built at the first run outside a
        CUDA graph capture."""
        if self.out is None:
            return None
        if self._tables is None:
            tables = _CastTables(self.tensors, qs)
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
    ) -> Tuple[List[torch.Tensor], None]:
        """Casts with ``scales`` (float32 ``[len(tensors)]``); ``amax_out`` and ``only`` as
        for ``multi_tensor_cast_fp8``. Returns ``(qs, None)``."""
        tensors, device, out = self.tensors, self.device, self.out
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
            return self._run_reference(scales, amax_out, only), None
        qs = _alloc_outputs(tensors) if out is None else list(out)
        amax_bits = None
        if amax_out is not None:
            amax_out.zero_()
            amax_bits = amax_out.view(torch.int32)
        if only is not None:  # [N + 1]: the flags, then whether any is set (checked first)
            only = torch.cat([only, only.any().view(1)]).view(torch.uint8)
        if tensors:
            _launch_multi_tensor_cast_fp8(tensors, scales.contiguous(), qs, amax_bits=amax_bits, only=only,
                                          tables=self._tables_for(qs))
        return qs, None

    def _run_reference(self, scales, amax_out, only) -> List[torch.Tensor]:
        """The torch reference (``impl="torch"``, CPU) or the Triton kernel staged on the CPU
        (``TRITON_INTERPRET=1`` with CUDA tensors)."""
        tensors, device, out = self.tensors, scales.device, self.out
        picked = [True] * len(tensors) if only is None else only.tolist()  # the reference path may sync
        if not select_impl(self.impl, device):
            qs, _ = multi_tensor_cast_fp8_ref(tensors, scales)
            if amax_out is not None:
                amax_out.copy_(torch.where(torch.tensor(picked, device=device),
                                           multi_tensor_amax_ref(tensors).to(device), 0.0))
        else:
            staged_amax = None if amax_out is None else torch.zeros(len(tensors))
            qs, _ = multi_tensor_cast_fp8([t.cpu() for t in tensors], scales.cpu(), amax_out=staged_amax,
                                          impl="triton")
            if amax_out is not None:
                amax_out.copy_(torch.where(torch.tensor(picked), staged_amax, 0.0))
        if out is None:
            return [q.to(device) for q in qs]
        for dst, q, keep in zip(out, qs, picked):  # bytes: uint8 views copy FP8 on every torch version
            if keep:
                dst.view(torch.uint8).copy_(q.view(torch.uint8))
        return list(out)
