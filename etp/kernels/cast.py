"""Fused multi-tensor FP8 (e4m3fn) cast with an optional transposed copy (the conversions
it shares with the other FP8 kernels: :mod:`etp.kernels.fp8_convert`)."""

from __future__ import annotations

import math
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

# The cast's own launch shape (not the amax's: it writes as well as reads). H200 sweep of
# 2026-11-23 (64 x 1536x1024 bf16, tools/bench_kernels.py, device time): block 2048 x 8 iters
# with 4 warps reached 0.835 of copy bandwidth, the amax's 4096 x 4 with 8 warps 0.69.
_FLAT_BLOCK = 2048
_FLAT_ITERS = 8
_FLAT_WARPS = 4
# Tile of the transposing path: 128 x 128 (0.81 of copy bandwidth with 4 warps; 64 x 128
# reached 0.75). 8 warps since the sweep of commit 9f4a1d8 (bench_kernels.py, H200): 0.847
# against 0.805 with 4, and 0.742 against 0.727 when the cast also records the amax.
_TILE_R = 128
_TILE_C = 128
_TILE_WARPS = 8
# Outputs share one allocation; each starts at a multiple of this many bytes so
# the kernel keeps its 16-byte-aligned (vectorised) path.
_OUT_ALIGN = 16


@triton.jit
def _cast_flat_chunk(
    in_base, out_base, start, numel, scale,
    DTYPE: tl.constexpr, SOFT: tl.constexpr, FP8_MAX: tl.constexpr,
    BLOCK: tl.constexpr, ITERS: tl.constexpr, EVICT: tl.constexpr,
):
    """Quantize elements [start, start + BLOCK * ITERS) of one flat tensor; returns the
    chunk's max |x| as integer bits (NaN-propagating, see ``_abs_bits``).

    static_range unrolls the ITERS steps so their loads are independent and can
    all be in flight at once.
    """
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
    return tl.max(acc, axis=0)


# --------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------


@triton.jit
def _multi_tensor_cast_fp8_kernel(
    table_ptr,  # int64 [8, T]: in addr, out addr, out^T addr, numel, rows, cols, first block, scale index
    scales_ptr,  # float32 [N]
    amax_ptr,  # HAS_AMAX: int32 bits of float32 [N], each tensor's max |x| (atomic max)
    only_ptr,  # ONLY: uint8 [N + 1], tensors whose entry is 0 are skipped; [N]: any entry set
    N,
    T,
    IN_TY: tl.constexpr,
    OUT_TY: tl.constexpr,
    DTYPE: tl.constexpr,
    SOFT: tl.constexpr,
    ALIGNED: tl.constexpr,  # addresses 16-B aligned and, for matrices, rows % 16 == cols % 16 == 0
    LINEAR_SEARCH: tl.constexpr,
    T_POW2: tl.constexpr,
    WRITE_T: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
    TILE_R: tl.constexpr,
    TILE_C: tl.constexpr,
    EVICT: tl.constexpr,  # eviction policy of the streaming input loads
    HAS_AMAX: tl.constexpr,
    ONLY: tl.constexpr,
):
    """q_t = e4m3fn(clamp(x_t * scales[s_t], -FP8_MAX, FP8_MAX)) for every table entry t.

    HAS_AMAX: each program also folds the max |x| of what it read into ``amax[s_t]`` (one
    atomic per program): the delayed-scaling cast records the amax of the next step's scale
    from its own read. ONLY: programs of tensors with ``only[s_t] == 0`` do nothing.

    Without WRITE_T every tensor is processed flat, ``BLOCK * ITERS`` elements
    per program.  With WRITE_T, tensors with ``rows > 0`` are viewed as
    ``[B, rows, cols]`` and processed in ``TILE_R x TILE_C`` tiles; each tile is
    read once and stored twice, at ``[b, r, c]`` in q and at ``[b, c, r]`` in
    q^T (the layout change happens on chip).  1-D tensors (``rows == 0``) are
    processed flat and have no separate transposed copy.
    """
    if ONLY:
        # Usually nothing is picked (delayed scaling's re-cast): one load, not the table
        # search's chain of dependent loads, before each of the many programs exits.
        if tl.load(only_ptr + N) == 0:
            return
    pid = tl.program_id(0)
    tid = _find_tensor(table_ptr + 6 * T, pid, T, LINEAR_SEARCH, T_POW2)
    idx = tl.load(table_ptr + 7 * T + tid)
    if ONLY:
        if tl.load(only_ptr + idx) == 0:
            return
    in_addr = tl.load(table_ptr + tid)
    out_addr = tl.load(table_ptr + T + tid)
    numel = tl.load(table_ptr + 3 * T + tid)
    first = tl.load(table_ptr + 6 * T + tid)
    scale = tl.load(scales_ptr + idx)
    in_base = in_addr.to(tl.pointer_type(IN_TY))
    out_base = out_addr.to(tl.pointer_type(OUT_TY))
    if ALIGNED:
        # Hints on the pointers (not the int64 addresses) so accesses vectorise.
        in_base = tl.multiple_of(in_base, 16)
        out_base = tl.multiple_of(out_base, 16)
    local = pid - first
    if WRITE_T:
        rows = tl.load(table_ptr + 4 * T + tid)
        cols = tl.load(table_ptr + 5 * T + tid)
        if rows == 0:
            bits = _cast_flat_chunk(in_base, out_base, local * (BLOCK * ITERS), numel, scale,
                                    DTYPE, SOFT, FP8_MAX, BLOCK, ITERS, EVICT)
        else:
            outt_base = tl.load(table_ptr + 2 * T + tid).to(tl.pointer_type(OUT_TY))
            if ALIGNED:
                outt_base = tl.multiple_of(outt_base, 16)
                rows = tl.multiple_of(rows, 16)
                cols = tl.multiple_of(cols, 16)
            # Tile coordinates in int32 (block counts are < 2^31; int64
            # division is several times slower); element offsets stay int64.
            n_tc = tl.cdiv(cols, TILE_C).to(tl.int32)
            per_mat = tl.cdiv(rows, TILE_R).to(tl.int32) * n_tc
            tile = local.to(tl.int32)
            b = tile // per_mat
            rem = tile - b * per_mat
            tr = rem // n_tc
            tc = rem - tr * n_tc
            r = tr * TILE_R + tl.arange(0, TILE_R)
            c = tc * TILE_C + tl.arange(0, TILE_C)
            mat = b.to(tl.int64) * rows * cols
            offs = mat + r[:, None] * cols + c[None, :]
            offs_t = mat + c[None, :] * rows + r[:, None]
            if ((tr + 1) * TILE_R <= rows) & ((tc + 1) * TILE_C <= cols):
                x = _to_f32(tl.load(in_base + offs, eviction_policy=EVICT), DTYPE, SOFT)
                q = _quantize_f32(x, scale, FP8_MAX, SOFT)
                tl.store(out_base + offs, q)
                tl.store(outt_base + offs_t, q)
            else:
                mask = (r[:, None] < rows) & (c[None, :] < cols)
                x = _to_f32(tl.load(in_base + offs, mask=mask, other=0, eviction_policy=EVICT), DTYPE, SOFT)
                q = _quantize_f32(x, scale, FP8_MAX, SOFT)
                tl.store(out_base + offs, q, mask=mask)
                tl.store(outt_base + offs_t, q, mask=mask)
            bits = tl.max(tl.max(_abs_bits(x), axis=1), axis=0)
    else:
        bits = _cast_flat_chunk(in_base, out_base, local * (BLOCK * ITERS), numel, scale,
                                DTYPE, SOFT, FP8_MAX, BLOCK, ITERS, EVICT)
    if HAS_AMAX:
        tl.atomic_max(amax_ptr + idx, bits, sem="relaxed")


def _matrix_dims(t: torch.Tensor) -> Tuple[int, int]:
    """(rows, cols) of the trailing matrix, (0, 0) for 1-D tensors."""
    if t.dim() < 2:
        return 0, 0
    return t.shape[-2], t.shape[-1]


class _CastTables:
    """The cast's launch tables for one set of inputs and destinations, on the device: one
    flat int64 table per input dtype, and each launch's (dtype, tensors, programs, aligned)."""

    def __init__(self, tensors, qs, qts, block: int, iters: int, tile_r: int, tile_c: int) -> None:
        write_t = qts is not None
        chunk = block * iters
        self.write_t, self.launches = write_t, []
        tables = []
        for dtype, idxs in group_by_dtype(tensors).items():
            cols_tab: List[List[int]] = [[] for _ in range(8)]
            counts = []
            aligned = True
            for i in idxs:
                x, q = tensors[i], qs[i]
                qt = qts[i] if write_t else q
                rows, cols = _matrix_dims(x) if write_t else (0, 0)
                if rows:
                    counts.append((x.numel() // (rows * cols)) * cdiv(rows, tile_r) * cdiv(cols, tile_c))
                    aligned &= rows % 16 == 0 and cols % 16 == 0
                else:
                    counts.append(cdiv(x.numel(), chunk))
                addrs = (x.data_ptr(), q.data_ptr(), qt.data_ptr())
                aligned &= all(a % 16 == 0 for a in addrs)
                for col, v in zip(cols_tab, (*addrs, x.numel(), rows, cols, 0, i)):
                    col.append(v)
            starts, total = block_starts(counts)
            cols_tab[6] = starts
            tables.append(cols_tab)
            self.launches.append((dtype, len(idxs), total, aligned))
        self.device_tables = upload_tables(tables, tensors[0].device)[0] if tables else []


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


def _alloc_outputs(
    tensors: Sequence[torch.Tensor], write_transposed: bool
) -> Tuple[List[torch.Tensor], Optional[List[torch.Tensor]]]:
    """All outputs as views of one allocation (16-byte aligned pieces).

    One ``torch.empty`` instead of one per output: on the GPU the caching
    allocator costs several microseconds of host time per call, which for 64
    shards (128 outputs with the transposed copies) used to exceed the kernel's
    own device time.
    """
    if not tensors:
        return [], ([] if write_transposed else None)
    device = tensors[0].device
    sizes, shapes = [], []
    for t in tensors:
        sizes.append(-(-t.numel() // _OUT_ALIGN) * _OUT_ALIGN)
        shapes.append(t.shape)
    if write_transposed:
        for t in tensors:
            if t.dim() >= 2:
                sizes.append(-(-t.numel() // _OUT_ALIGN) * _OUT_ALIGN)
                shapes.append((*t.shape[:-2], t.shape[-1], t.shape[-2]))
    buf = torch.empty(sum(sizes), dtype=torch.float8_e4m3fn, device=device)
    pieces = buf.split(sizes)
    outs = [p[: math.prod(shape)].view(shape) for p, shape in zip(pieces, shapes)]
    qs = outs[: len(tensors)]
    if not write_transposed:
        return qs, None
    rest = iter(outs[len(tensors):])
    qts = [q if t.dim() < 2 else next(rest) for t, q in zip(tensors, qs)]
    return qs, qts


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
    host-to-device copy. Rebuilding them on every call cost 23 ms of (profiled) host time per
    iteration of the flagship recipe, over 500 expert pieces per rank at ETP 2
    (``etp::quantize_shards``, BENCHMARKS.md session 14), and an upload inside a CUDA graph
    capture is not replayable; a run under capture uses the kept tables (or builds uncached
    ones when none are kept yet).

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


def _check_out(out: Sequence[torch.Tensor], shapes, device: torch.device, what: str) -> List[torch.Tensor]:
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
