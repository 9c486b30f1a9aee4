"""Fused multi-tensor amax (``max(|x|)`` of many tensors in one launch).

Also holds the pieces shared by the other kernel modules: impl selection,
interpreter detection, the per-launch tensor table and the numeric helpers
that keep the Triton interpreter bit-exact.

Why "soft" conversions exist: the Triton interpreter (checked on 3.6 and 3.9)
does not convert floats the way the GPU does.  fp32 -> bf16 truncates instead
of rounding to nearest even, fp32 -> fp8e4nv rounds half away from zero and
can corrupt the exponent on mantissa carry, bf16 -> fp32 mishandles
subnormals, and fp8e4nv -> fp32 decodes NaN (0x7F) as 480.  When the kernels
run under the interpreter they therefore load/store those types as raw
integers and convert with integer bit manipulation (``SOFT=True``); compiled
kernels use the hardware conversions (``SOFT=False``), which on sm90 are
round-to-nearest-even (``cvt.rn.satfinite.e4m3x2.f32``, ``cvt.rn.bf16.f32``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from etp.kernels.launch import launch
from etp.kernels.reference import SUPPORTED_INPUT_DTYPES, multi_tensor_amax_ref
from etp.streams import current_raw_stream

__all__ = ["multi_tensor_amax"]

_IMPLS = ("auto", "triton", "torch")

# Dtype codes used as tl.constexpr flags by all kernels.
_DTYPE_CODE = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}

# Up to this many tensors per launch a program finds its tensor with one
# vector load of all block starts; above it a binary search over the table is
# cheaper than loading the whole table in every program.
_LINEAR_SEARCH_MAX_TENSORS = 128

# Default tiling of the flat multi-tensor kernels: each program reduces
# BLOCK * ITERS contiguous elements (16384 = 32 KiB of bf16), large enough that
# the per-program table lookup and the single atomic are noise next to the
# streaming loads.
_FLAT_BLOCK = 4096
_FLAT_ITERS = 4
_FLAT_WARPS = 8
# Eviction policy of the streaming loads: every input byte is read exactly once,
# so marking the lines evict-first keeps L2 for the small table / outputs.
_FLAT_EVICT = "evict_first"

# Launch options of every kernel here: no FMA contraction, so each float op
# rounds exactly like the torch reference (explicit, also because Triton 3.9
# warns that its default is about to change).
EXACT_FP = {"enable_fp_fusion": False}


# --------------------------------------------------------------------------
# Shared Triton helpers
# --------------------------------------------------------------------------


@triton.jit
def _to_f32(raw, DTYPE: tl.constexpr, SOFT: tl.constexpr):
    """Widen a loaded bf16/fp16/fp32 block to float32 (exact for all inputs).

    In SOFT mode bf16 data arrives as int16 bits and is widened as
    ``bits << 16`` (exact, including subnormals and NaN); everything else
    uses the regular cast, which the interpreter does correctly for fp16/fp32.
    """
    if DTYPE == 0:
        if SOFT:
            x = (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            x = raw.to(tl.float32)
    else:
        x = raw.to(tl.float32)
    return x


@triton.jit
def _abs_bits(x):
    """|x| as int32 bits: ``bits(x) & 0x7FFFFFFF``.

    For non-negative floats the int32 order equals the float order, and every
    NaN pattern (> 0x7F800000) compares above +inf, so an integer max over
    these bits is a NaN-propagating float max of |x|.
    """
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _find_tensor(start_ptr, pid, T, LINEAR: tl.constexpr, T_POW2: tl.constexpr):
    """Index i of the tensor owning program ``pid``: largest i with start[i] <= pid.

    ``start`` is the exclusive prefix sum of per-tensor block counts (strictly
    increasing because empty tensors are never put in the table).
    """
    if LINEAR:
        idx = tl.arange(0, T_POW2)
        starts = tl.load(start_ptr + idx, mask=idx < T, other=0)
        hit = (starts <= pid) & (idx < T)
        tid = tl.sum(hit.to(tl.int32), axis=0) - 1
    else:
        # Invariant: start[lo] <= pid < start[hi] (start[T] taken as +inf).
        lo = pid * 0
        hi = lo + T
        while hi - lo > 1:
            mid = (lo + hi) // 2
            go = tl.load(start_ptr + mid) <= pid
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        tid = lo
    return tid


# --------------------------------------------------------------------------
# Host-side helpers shared by the kernel modules
# --------------------------------------------------------------------------


def _is_interpreter(kernel) -> bool:
    # triton.jit returns an InterpretedFunction when TRITON_INTERPRET=1 was set
    # before the decoration; checking the object is exact on every version and
    # does not depend on knob APIs that moved between 3.6 and 3.9.
    return type(kernel).__name__ == "InterpretedFunction"


def interpreter_active() -> bool:
    """True when the Triton kernels of this package run in the Triton interpreter."""
    return _INTERPRETED


def check_impl(impl: str) -> None:
    if impl not in _IMPLS:
        raise ValueError(f"impl={impl!r} is not supported; expected one of {', '.join(map(repr, _IMPLS))}")


def select_impl(impl: str, device: torch.device) -> bool:
    """Validate ``impl`` and return True if the Triton path must be used."""
    check_impl(impl)
    if impl == "torch":
        return False
    if impl == "auto":
        return device.type == "cuda"
    if device.type == "cuda":
        return True
    if device.type == "cpu" and interpreter_active():
        return True
    raise RuntimeError(
        f"impl='triton' needs CUDA tensors (got device {device}) or the Triton interpreter; "
        "set TRITON_INTERPRET=1 before triton / etp.kernels is first imported to run Triton on CPU"
    )


def needs_staging(device: torch.device) -> bool:
    """True if Triton kernels must run on CPU copies of CUDA tensors.

    Under the interpreter the kernels dereference the raw addresses in their
    tensor tables on the host, so device memory must be staged through the CPU.
    """
    return device.type == "cuda" and interpreter_active()


def common_device(tensors: Sequence[torch.Tensor], what: str = "tensors") -> torch.device:
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"all {what} must be on one device, got {sorted(map(str, devices))}")
    return next(iter(devices)) if devices else torch.device("cpu")


def check_input_dtype(t: torch.Tensor, what: str) -> None:
    if t.dtype not in SUPPORTED_INPUT_DTYPES:
        raise TypeError(f"{what} has dtype {t.dtype}; supported: bfloat16, float16, float32")


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the torch references sum in: float64 for float64 data, float32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for launch grids: ``triton.cdiv`` unwraps constexprs first, which costs
    microseconds of host time per launch in the eager step's hot wrappers."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def group_by_dtype(tensors: Sequence[torch.Tensor]) -> Dict[torch.dtype, List[int]]:
    """Indices of the non-empty tensors, grouped by dtype (insertion ordered)."""
    groups: Dict[torch.dtype, List[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel() > 0:
            groups.setdefault(t.dtype, []).append(i)
    return groups


def upload_tables(
    tables: Sequence[Sequence[Sequence[int]]], device: torch.device, zero_words: int = 0
) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """Pack per-launch int64 tables, plus ``zero_words`` zeroed int64 words, into one device buffer.

    Each table is a list of equally long int64 columns and comes back as a
    flat ``[n_cols * T]`` view (column-major: column k starts at k * T).  One
    host-to-device copy serves every launch of a call, and the zeroed tail
    lets callers carve their (zero-initialised) outputs out of the same copy
    instead of launching a separate fill.

    Rebuilt on every call: keying a cache on data_ptr/numel is unsafe because
    the caching allocator reuses addresses.  The host buffer is pinned so the
    non_blocking copy is truly asynchronous (a pageable source may make the
    driver wait for the stream); PyTorch's pinned-memory cache keeps the host
    block alive until the copy has run.
    """
    flat: List[int] = []
    sizes = []
    for cols in tables:
        start = len(flat)
        for col in cols:
            flat.extend(col)
        sizes.append((start, len(flat)))
    host = torch.tensor(flat + [0] * zero_words, dtype=torch.int64)
    if device.type == "cuda":
        buf = host.pin_memory().to(device, non_blocking=True)
    else:
        buf = host.to(device)
    return [buf[a:b] for a, b in sizes], buf[len(flat):]


def block_starts(block_counts: Sequence[int]) -> Tuple[List[int], int]:
    starts, total = [], 0
    for n in block_counts:
        starts.append(total)
        total += n
    return starts, total


def load_ty(dtype: torch.dtype, soft: bool):
    """Pointer element type used to load ``dtype`` (int16 bits for bf16 in SOFT mode)."""
    if dtype == torch.bfloat16:
        return tl.int16 if soft else tl.bfloat16
    if dtype == torch.float16:
        return tl.float16
    return tl.float32


# --------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------


@triton.jit
def _multi_tensor_amax_kernel(
    table_ptr,  # int64 [4, T]: address, numel, output index, first block
    out_bits_ptr,  # int32 view of the float32 output (zero-initialised)
    T,  # number of tensors in this launch
    IN_TY: tl.constexpr,  # pointer element type for the loads
    DTYPE: tl.constexpr,  # 0 bf16, 1 fp16, 2 fp32
    SOFT: tl.constexpr,  # integer-bit conversions (interpreter)
    ALIGNED: tl.constexpr,  # every address is 16-byte aligned
    LINEAR_SEARCH: tl.constexpr,
    T_POW2: tl.constexpr,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
    EVICT: tl.constexpr,  # eviction policy of the streaming loads ("" or "evict_first")
):
    """out[k] = max over i of |x_t[i]| for the tensor t with output index k.

    Program ``pid`` owns elements ``[c*CHUNK, (c+1)*CHUNK)`` of tensor t where
    ``c = pid - first_block[t]`` and ``CHUNK = BLOCK * ITERS``; it reduces them
    to ``m = max(bits(|x|))`` and does ``atomic_max(out_bits[k], m)``.  The
    integer max on |x| bits equals the float max and makes NaN win (see
    ``_abs_bits``), so the float32 result is NaN iff the tensor has a NaN.
    """
    pid = tl.program_id(0)
    tid = _find_tensor(table_ptr + 3 * T, pid, T, LINEAR_SEARCH, T_POW2)
    addr = tl.load(table_ptr + tid)
    numel = tl.load(table_ptr + T + tid)
    out_idx = tl.load(table_ptr + 2 * T + tid)
    first = tl.load(table_ptr + 3 * T + tid)
    base = addr.to(tl.pointer_type(IN_TY))
    if ALIGNED:
        # The hint must sit on the pointer: a hint on the int64 address is not
        # propagated through int-to-pointer, and without it loads are scalar.
        base = tl.multiple_of(base, 16)
    start = (pid - first) * (BLOCK * ITERS)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    # static_range unrolls, so the ITERS loads are independent instructions the
    # compiler can issue back to back (more bytes in flight per SM); a plain
    # range() is a loop whose next load waits for the previous iteration.
    if start + BLOCK * ITERS <= numel:
        # Full chunk: unmasked loads vectorise to 16-byte accesses.
        for i in tl.static_range(ITERS):
            raw = tl.load(base + (start + i * BLOCK) + offs, eviction_policy=EVICT)
            acc = tl.maximum(acc, _abs_bits(_to_f32(raw, DTYPE, SOFT)))
    else:
        for i in tl.static_range(ITERS):
            o = start + i * BLOCK + offs
            raw = tl.load(base + o, mask=o < numel, other=0, eviction_policy=EVICT)
            acc = tl.maximum(acc, _abs_bits(_to_f32(raw, DTYPE, SOFT)))
    # relaxed: the value is only read after the kernel completes, so no
    # ordering with other memory operations is needed.
    tl.atomic_max(out_bits_ptr + out_idx, tl.max(acc, axis=0), sem="relaxed")


# Decided once, when the kernels are decorated (that is when Triton reads
# TRITON_INTERPRET).
_INTERPRETED = _is_interpreter(_multi_tensor_amax_kernel)


class _DeviceTableCache:
    """The amax launch tables already on the device, per (stream, table contents).

    A table holds only (address, numel, output index, first block), so a hit is valid even
    when the tensors behind it were re-allocated at the same addresses.  Keyed by stream as
    well: a table is uploaded (non-blocking) and read on one stream only, so no other stream
    can read it before it lands, and when it is evicted the allocator's stream ordering
    covers every kernel that read it.  Not used while a CUDA graph is being captured: an
    evicted table would leave the graph reading freed memory.
    """

    def __init__(self, capacity: int = 32) -> None:
        self.capacity = capacity
        self._tables: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()

    def get(self, tables: Sequence[Sequence[Sequence[int]]], device: torch.device) -> List[torch.Tensor]:
        stream = current_raw_stream(device)  # no Stream object made (torch.cuda.current_stream makes one)
        key = (stream, tuple(tuple(tuple(col) for col in cols) for cols in tables))
        hit = self._tables.get(key)
        if hit is None:
            hit, _ = upload_tables(tables, device)
            self._tables[key] = hit
            if len(self._tables) > self.capacity:
                self._tables.popitem(last=False)
        else:
            self._tables.move_to_end(key)
        return hit


_TABLE_CACHE = _DeviceTableCache()
# Cached tables + one fill kernel for the output, rather than one upload per call (table and
# zeroed output together): the upload is a host-to-device copy that the kernel waits behind,
# a visible part of the whole op's time next to a kernel that only streams its inputs once.
_CACHE_TABLES = True


def _launch_multi_tensor_amax(
    tensors: Sequence[torch.Tensor],
    out: Optional[torch.Tensor] = None,
    *,
    block: int = _FLAT_BLOCK,
    iters: int = _FLAT_ITERS,
    num_warps: int = _FLAT_WARPS,
    linear_search_max: int = _LINEAR_SEARCH_MAX_TENSORS,
    evict: str = _FLAT_EVICT,
    cache_tables: bool = _CACHE_TABLES,
) -> torch.Tensor:
    """Launch the amax kernel once per input dtype.

    ``out`` (float32 [len(tensors)]) must be zero-filled if given.  By default (CUDA, not
    capturing) the launch tables come from ``_TABLE_CACHE`` and ``out`` is one fill kernel;
    otherwise ``out`` is carved out of the zeroed tail of the tables' upload, so a call costs
    one host-to-device copy plus one kernel per dtype.
    """
    soft = interpreter_active()
    device = tensors[0].device
    chunk = block * iters
    launches, tables = [], []
    for dtype, idxs in group_by_dtype(tensors).items():
        ts = [tensors[i] for i in idxs]
        addrs = [t.data_ptr() for t in ts]
        numels = [t.numel() for t in ts]
        starts, total = block_starts([cdiv(n, chunk) for n in numels])
        tables.append([addrs, numels, idxs, starts])
        launches.append((dtype, len(ts), total, all(a % 16 == 0 for a in addrs)))
    n_out = len(tensors)
    if cache_tables and device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        dev_tables = _TABLE_CACHE.get(tables, device)
        if out is None:
            out = torch.zeros(n_out, dtype=torch.float32, device=device)
    else:
        dev_tables, tail = upload_tables(tables, device, zero_words=0 if out is not None else -(-n_out // 2))
        if out is None:
            # Two float32 results per zeroed int64 word.
            out = tail.view(torch.float32)[:n_out]
    out_bits = out.view(torch.int32)
    for table, (dtype, n_t, total, aligned) in zip(dev_tables, launches):
        launch(_multi_tensor_amax_kernel, (total,),
            table,
            out_bits,
            n_t,
            IN_TY=load_ty(dtype, soft),
            DTYPE=_DTYPE_CODE[dtype],
            SOFT=soft,
            ALIGNED=aligned,
            LINEAR_SEARCH=n_t <= linear_search_max,
            T_POW2=next_pow2(n_t),
            BLOCK=block,
            ITERS=iters,
            EVICT=evict,
            num_warps=num_warps,
            **EXACT_FP,
        )
    return out


# --------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------


def multi_tensor_amax(tensors: Sequence[torch.Tensor], *, impl: str = "auto") -> torch.Tensor:
    """max(|x|) of every tensor, fused into one Triton launch per input dtype.

    ``out[i] = max_j |tensors[i][j]|`` as float32.  Empty tensors give 0,
    all-zero tensors give 0, a tensor containing +-inf gives inf and a tensor
    containing NaN gives NaN (like ``torch.amax``).  Tensors of different sizes
    are handled by one launch over a table of (address, numel) entries; inputs
    of mixed dtypes are grouped and launched once per dtype (the usual
    single-dtype call is exactly one kernel launch; the output is zero-filled
    by the same host-to-device copy that uploads the table).  Because that
    table is uploaded on every call, the Triton path is not CUDA-graph
    capturable.

    Args:
        tensors: contiguous bf16 / fp16 / fp32 tensors of any shape, all on one device.
        impl: ``"auto"`` (Triton on CUDA tensors, torch reference otherwise),
            ``"triton"`` (CPU tensors only under ``TRITON_INTERPRET=1``) or ``"torch"``.

    Returns:
        float32 tensor of shape ``[len(tensors)]`` on the tensors' device.

    Example::

        shards = [torch.randn(1536, 1024, dtype=torch.bfloat16, device="cuda") for _ in range(64)]
        amax = multi_tensor_amax(shards)            # one launch, float32 [64]
        scales = amax_to_scale(amax)
    """
    tensors = list(tensors)
    device = common_device(tensors)
    for i, t in enumerate(tensors):
        check_input_dtype(t, f"tensors[{i}]")
        if not t.is_contiguous():
            raise ValueError(f"tensors[{i}] is not contiguous; call .contiguous() first")
    if not tensors:  # nothing to launch, whatever impl asks for
        return torch.zeros(0, dtype=torch.float32, device=device)
    use_triton = select_impl(impl, device)
    if not use_triton:
        return multi_tensor_amax_ref(tensors)
    if needs_staging(device):
        return _launch_multi_tensor_amax([t.cpu() for t in tensors]).to(device)
    return _launch_multi_tensor_amax(tensors)
