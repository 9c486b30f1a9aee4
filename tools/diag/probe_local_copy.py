"""Does a device-local copy block a grouped GEMM beside it? (1 GPU)

Traces of the bf16 expert stack showed the compute stream idle for exactly the length of each
copy-engine gather's own-rows copy (``Memcpy DtoD``, 131 us for an
fc1 shard on H100), see [Note: the own-rows copy takes the SMs] in
etp/transport/copy_engine.py. This probe times 201 MB copied within one GPU in several ways:
the copy alone (its bandwidth hints at the engine: copy engines do not reach ~1.4 TB/s), and
one grouped GEMM (the expert stack's fc1, ``torch._grouped_mm``) on the compute stream with
the copy issued on a high-priority side stream at the same time. "serialized" is GEMM alone
+ copy alone: a result near it means the copy and the GEMM did not overlap. Ways:

* ``copy_``: ``Tensor.copy_`` (``cudaMemcpyAsync`` device to device);
* ``cuMemcpyPeerAsync, one context``: the peer-copy entry point with this device on both ends;
* ``16 chunks``: sixteen ``cuMemcpyDtoDAsync`` of 12.6 MB;
* ``cuMemcpyBatchAsync, overlap hint``: ``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE`` (CUDA 12.8+
  drivers; the v2 entry point of CUDA 13 drivers is tried first). Refused on the legacy default
  stream, hence the probe runs on a created stream.

Run (prints a table; a path argument also writes the figures as JSON)::

    python3 tools/diag/probe_local_copy.py [out.json]

On H100 every way serialized (16 chunks overlapped about half of their copy): a device-local
copy runs on the SMs, which is why copy-engine gathers read their own rows in place.
"""
import ctypes
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # runnable from a checkout
from bench_overlap import back_to_back_ms, provenance  # noqa: E402 - one timing loop for both tools

MB_201 = 201 * 2**20
SRC_ORDER_STREAM, LOCATION_DEVICE, PREFER_OVERLAP_WITH_COMPUTE = 0x1, 0x1, 0x1


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation), ("dstLocHint", _MemLocation),
                ("flags", ctypes.c_uint)]


def _ways(dst: torch.Tensor, src: torch.Tensor) -> dict:
    lib = ctypes.CDLL("libcuda.so.1")
    nbytes = src.numel() * src.element_size()
    context = ctypes.c_void_p()
    lib.cuCtxGetCurrent(ctypes.byref(context))
    peer = lib.cuMemcpyPeerAsync
    peer.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t,
                     ctypes.c_void_p]
    dtod = lib.cuMemcpyDtoDAsync_v2
    dtod.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]

    def stream() -> int:
        return torch.cuda.current_stream().cuda_stream

    def check(result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"{what} failed with CUresult {result}")

    def chunked() -> None:
        step = nbytes // 16
        for i in range(16):
            check(dtod(dst.data_ptr() + i * step, src.data_ptr() + i * step, step, stream()), "cuMemcpyDtoDAsync")

    P = ctypes.POINTER
    batch, fail_index = getattr(lib, "cuMemcpyBatchAsync_v2", None), False
    if batch is None:
        batch, fail_index = getattr(lib, "cuMemcpyBatchAsync", None), True
    if batch is not None:
        batch.argtypes = [P(ctypes.c_uint64), P(ctypes.c_uint64), P(ctypes.c_size_t), ctypes.c_size_t,
                          P(_MemcpyAttributes), P(ctypes.c_size_t), ctypes.c_size_t] + (
                              [P(ctypes.c_size_t)] if fail_index else []) + [ctypes.c_void_p]

    def batched() -> None:
        if batch is None:
            raise RuntimeError("no cuMemcpyBatchAsync in this driver (CUDA < 12.8)")
        here = _MemLocation(LOCATION_DEVICE, src.device.index or 0)
        attrs = (_MemcpyAttributes * 1)(_MemcpyAttributes(SRC_ORDER_STREAM, here, here, PREFER_OVERLAP_WITH_COMPUTE))
        args = [(ctypes.c_uint64 * 1)(dst.data_ptr()), (ctypes.c_uint64 * 1)(src.data_ptr()),
                (ctypes.c_size_t * 1)(nbytes), 1, attrs, (ctypes.c_size_t * 1)(0), 1]
        check(batch(*args, *([(ctypes.c_size_t * 1)(0)] if fail_index else []), stream()), "cuMemcpyBatchAsync")

    return {
        "copy_": lambda: dst.copy_(src),
        "cuMemcpyPeerAsync, one context": lambda: check(
            peer(dst.data_ptr(), context, src.data_ptr(), context, nbytes, stream()), "cuMemcpyPeerAsync"),
        "16 chunks": chunked,
        "cuMemcpyBatchAsync, overlap hint": batched,
    }


def _timed(fn, reps: int = 20) -> float:
    """Mean microseconds of ``fn`` over ``reps`` back-to-back calls (one warm-up)."""
    fn()
    torch.cuda.synchronize()
    return back_to_back_ms(fn, reps) * 1e3


def main() -> None:
    dev = torch.device("cuda", 0)
    torch.cuda.set_stream(torch.cuda.Stream(dev))  # not the legacy default stream
    n = MB_201 // 2
    src, dst = torch.randn(n, device=dev, dtype=torch.bfloat16), torch.empty(n, device=dev, dtype=torch.bfloat16)
    experts, tokens, hidden, width = 16, 2048, 4096, 3072
    a = torch.randn(experts * tokens, hidden, device=dev, dtype=torch.bfloat16)
    b = torch.randn(experts, width, hidden, device=dev, dtype=torch.bfloat16).transpose(-2, -1)
    offs = torch.arange(1, experts + 1, device=dev, dtype=torch.int32) * tokens
    side = torch.cuda.Stream(dev, priority=-1)

    def gemm() -> None:
        torch._grouped_mm(a, b, offs=offs)

    def beside(copy):
        def run() -> None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                copy()
            gemm()
            torch.cuda.current_stream().wait_stream(side)
        return run

    for _ in range(3):
        _timed(gemm)
    result = {"provenance": provenance(), "bytes": MB_201}
    print(f"{'way':34s} | copy alone us | GB/s | GEMM alone us | GEMM + copy beside us | serialized us")
    for name, copy in _ways(dst, src).items():
        try:
            alone = _timed(copy)
        except RuntimeError as exc:
            result[name] = {"error": str(exc)}
            print(f"{name:34s} | failed: {exc}")
            continue
        gemm_alone = _timed(gemm)
        both = _timed(beside(copy))
        result[name] = {"copy_alone_us": alone, "copy_GBps": MB_201 / alone / 1e3, "gemm_alone_us": gemm_alone,
                        "gemm_with_copy_beside_us": both, "serialized_us": gemm_alone + alone}
        print(f"{name:34s} | {alone:13.1f} | {MB_201 / alone / 1e3:4.0f} | {gemm_alone:13.1f} | {both:21.1f} | "
              f"{gemm_alone + alone:13.1f}")
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
