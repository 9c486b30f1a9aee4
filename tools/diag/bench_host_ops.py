"""Host time per call of the operations an eager ETP step issues, each alone on one GPU.

An eager step at micro-batch 2 is issue-bound (BENCHMARKS.md: the device waits for the
host), so what each call costs the *host* decides its speed. Here each operation runs
``--calls`` times back to back on tiny operands (the device finishes each in microseconds, so
the launch queue never fills and nothing waits on the device) and the host's wall time per
call is reported, median of ``--rounds`` rounds. Compare with ``tools/diag/host_sampler.py``'s
in-run attribution: a call far slower in the run than here waits on something there.

    python3 tools/diag/bench_host_ops.py --out host_ops.json

Needs CUDA (FP8 GEMMs: sm90+).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: bench_provenance

from bench_provenance import provenance  # noqa: E402 - puts this checkout's etp first on the path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=200, help="calls per timed round")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", type=str, default=None)
    return p.parse_args(argv)


def host_us(fn, calls: int, rounds: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(rounds):
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - began) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per_call)


def cases():
    from etp.formats.fp8 import FP8Weight
    from etp.gemm import DenseGemm, GroupedGemm, quantize_activation
    from etp.kernels import quantize_rowwise, transpose_last2
    from etp.transport.stream_ops import WAIT_GEQ, WRITE, MemoryOps

    dev = torch.device("cuda")
    x = torch.randn(64, 256, device=dev, dtype=torch.bfloat16)
    w = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)
    scale = torch.ones(1, device=dev)
    wq = w.to(torch.float8_e4m3fn)
    fp8w = FP8Weight(wq, scale, scale.clone(), False, wq, 256)
    experts = 4
    xg = torch.randn(experts * 16, 256, device=dev, dtype=torch.bfloat16)
    wg = torch.randn(experts, 256, 256, device=dev, dtype=torch.bfloat16)
    counts = torch.full((experts,), 16, device=dev, dtype=torch.int64)
    wgq = wg.to(torch.float8_e4m3fn)
    fp8wg = FP8Weight(wgq, torch.ones(experts, device=dev), torch.ones(experts, device=dev), False,
                      wgq.view(-1, 256), experts * 256)
    xq, x_inv = quantize_rowwise(x, inverse=True)
    w_rows = fp8w.scale_rows(1, 256)
    xgq, xg_inv = quantize_rowwise(xg, inverse=True)
    wg_rows = fp8wg.scale_rows(experts, 256)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    flag = torch.zeros(16, device=dev, dtype=torch.int32)
    stream = torch.cuda.current_stream()
    handle = stream.cuda_stream
    other = torch.cuda.Stream()
    event = torch.cuda.Event()

    def fresh(t):  # a new tensor each call, as activations are (costs the "x + 0" case)
        return t + 0

    # One push reduce-scatter's flag operations at world 4 (etp.transport.push_reduce): push 3
    # waits + 3 clears, then 3 READY writes; receive 3 waits + 3 clears; release 3 writes.
    flags = [flag.data_ptr() + 4 * k for k in range(3)]
    batches = [[(WAIT_GEQ, f, 0) for f in flags] + [(WRITE, f, 0) for f in flags], [(WRITE, f, 0) for f in flags],
               [(WAIT_GEQ, f, 0) for f in flags] + [(WRITE, f, 0) for f in flags], [(WRITE, f, 0) for f in flags]]
    singles = [MemoryOps([op]) for batch in batches for op in batch]
    laid_out = [MemoryOps(batch) for batch in batches]
    write_one, wait_one = MemoryOps([(WRITE, flag.data_ptr(), 1)]), MemoryOps([(WAIT_GEQ, flag.data_ptr(), 0)])

    def one_by_one():
        for ops in singles:
            ops.enqueue(handle)

    def built_each_time():
        for batch in batches:
            MemoryOps(batch).enqueue(handle)

    def laid_out_once():
        for ops in laid_out:
            ops.enqueue(handle)

    return _launch_cases(wq) | {
        "torch.empty": lambda: torch.empty(64, 256, device=dev, dtype=torch.bfloat16),
        "x + 0 (one elementwise launch)": lambda: x + 0,
        "torch.cuda.current_stream()": torch.cuda.current_stream,
        "event.record()": lambda: event.record(stream),
        "stream.wait_event()": lambda: other.wait_event(event),
        "one flag write (MemoryOps of 1, laid out)": lambda: write_one.enqueue(handle),
        "one flag wait, satisfied (MemoryOps of 1, laid out)": lambda: wait_one.enqueue(handle),
        "a push reduce's 15 flag operations (world 4), a driver call each": one_by_one,
        "the same 15 in 4 batches built at each call": built_each_time,
        "the same 15 in 4 batches laid out once (push_reduce's way)": laid_out_once,
        "1.0 / scale": lambda: 1.0 / scale,
        "F.linear bf16": lambda: F.linear(x, w),
        "DenseGemm.forward bf16": lambda: DenseGemm.forward(x, w, None),
        "torch._scaled_mm alone": lambda: torch._scaled_mm(wq, wq.t(), scale_a=scale, scale_b=scale,
                                                           out_dtype=torch.bfloat16),
        # The call DenseGemm.forward makes: one scale per activation row and per weight row.
        "torch._scaled_mm, rowwise scales (the FP8 GEMMs' call)":
            lambda: torch._scaled_mm(xq, wq.t(), scale_a=x_inv[:, None], scale_b=w_rows, out_dtype=torch.bfloat16,
                                     use_fast_accum=True),
        "torch._scaled_grouped_mm (GroupedGemm.forward's call)":
            lambda: torch._scaled_grouped_mm(xgq, wgq.transpose(-2, -1), xg_inv, wg_rows, offs=offs,
                                             out_dtype=torch.bfloat16, use_fast_accum=True),
        "FP8Weight.scale_rows (kept per version)": lambda: fp8w.scale_rows(1, 256),
        "x_inv[:, None] (a view)": lambda: x_inv[:, None],
        "torch.cuda.is_current_stream_capturing()": torch.cuda.is_current_stream_capturing,
        "quantize_rowwise (Triton launch + wrapper)": lambda: quantize_rowwise(x, inverse=True),
        "quantize_activation (new tensor)": lambda: quantize_activation(fresh(x)),
        "x + 0 then DenseGemm.forward FP8": lambda: DenseGemm.forward(fresh(x), fp8w, None),
        "x + 0 then DenseGemm.dgrad FP8 (transposes the weight)": lambda: DenseGemm.dgrad(fresh(x), fp8w, None),
        "transpose_last2 (Triton launch)": lambda: transpose_last2(wq),
        "torch._grouped_mm bf16 (offsets cached)": lambda: GroupedGemm.forward(xg, wg, counts),
        "x + 0 then GroupedGemm.forward FP8": lambda: GroupedGemm.forward(fresh(xg), fp8wg, counts),
    }


PROBE_TILE = 64


@triton.jit
def _probe_kernel(x_ptr, y_ptr, R, C, TILE: tl.constexpr):
    """y = x over one TILE x TILE tile: the arguments of ``transpose_last2``'s kernel (two
    pointers, two sizes, one constexpr), so its launch costs the host what that one's does."""
    rows = tl.program_id(0) * TILE + tl.arange(0, TILE)
    cols = tl.program_id(1) * TILE + tl.arange(0, TILE)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    offs = rows[:, None].to(tl.int64) * C + cols[None, :]
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)


def _launch_cases(wq: torch.Tensor) -> dict:
    """What a Triton launch costs inside Triton, against its compiled launcher called directly
    (the kernel looked up once) and etp's cached launch: the part a cached launch saves per call."""
    from etp.kernels.launch import launch
    from etp.streams import current_raw_stream, current_stream

    t_in = wq.view(torch.uint8).reshape(256, 256)
    t_out = torch.empty_like(t_in)
    grid = (256 // PROBE_TILE, 256 // PROBE_TILE, 1)
    compiled = _probe_kernel[grid](t_in, t_out, 256, 256, TILE=PROBE_TILE, num_warps=4)
    handle = torch.cuda.current_stream().cuda_stream

    def run(stream_handle):
        compiled.run(grid[0], grid[1], grid[2], stream_handle, compiled.function,
                     compiled.packed_metadata, None, None, None, t_in, t_out, 256, 256, PROBE_TILE)

    return {
        "launch(kernel, ...) (etp's cached launch)":
            lambda: launch(_probe_kernel, grid, t_in, t_out, 256, 256, TILE=PROBE_TILE, num_warps=4),
        "etp.streams.current_stream()": current_stream,
        "etp.streams.current_raw_stream()": current_raw_stream,
        "kernel[grid](...) (Triton's launch path, no wrapper)":
            lambda: _probe_kernel[grid](t_in, t_out, 256, 256, TILE=PROBE_TILE, num_warps=4),
        "compiled.run(...) (the compiled launcher, current stream looked up)":
            lambda: run(torch.cuda.current_stream().cuda_stream),
        "compiled.run(...) (the compiled launcher, raw stream handle)": lambda: run(handle),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_host_ops: needs CUDA", file=sys.stderr)
        return 2
    results = {}
    for name, fn in cases().items():
        try:
            results[name] = round(host_us(fn, args.calls, args.rounds), 2)
        except Exception as exc:  # noqa: BLE001 - one case failing (e.g. no sm90) must not hide the rest
            results[name] = f"failed: {type(exc).__name__}: {exc}"[:200]
        print(f"{name:58s} {results[name]} us", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "benchmark": "host_ops", "provenance": provenance(), "calls": args.calls, "rounds": args.rounds,
            "host_us_per_call": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
