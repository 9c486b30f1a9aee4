#!/usr/bin/env python
"""Benchmark the FP8 weight-gather kernels of etp.kernels on one GPU.

Workload: 64 bf16 expert shards of [1536, 1024] (1,572,864 elements each,
201,326,592 bytes in total), i.e. the local shards one rank quantizes before
the FP8 weight all-gather.

Measured (median of ``--iters`` runs with CUDA events, after warm-up):

* copy floor: a device-to-device copy of the same bytes.  It moves 2x the
  bytes (read + write), so ``copy_bw = 2 * bytes / copy_ms`` and the
  read-only floor of amax is ``copy_ms / 2``.  A prior measurement on H200
  gave ``copy_ms = 0.095`` (4217 GB/s), reported as an anchor.
* amax: fused ``multi_tensor_amax`` vs ``torch._foreach_norm(ord=inf)`` vs a
  Python loop of ``t.abs().amax()``; fraction of copy bandwidth =
  ``floor_ms / kernel_ms`` (target >= 0.8), plus a small sweep of the
  kernel's tiling.
* fp8 cast: fused ``multi_tensor_cast_fp8`` with and without the transposed
  copy vs the torch reference; floor = (bytes read + bytes written) / copy_bw.
* blockwise quantize: (128, 128) on the stacked [64, 1536, 1024] weights and
  (1, 128) on the same data viewed as [98304, 1024] activations.
* rowwise quantize (``quantize_rowwise``, the FP8 GEMM activation input) on
  bf16 [8192, 32000] (vocabulary projection: the two-pass kernel) and
  [16384, 4096] (one pass); floor = one read of x + the fp8 write.
* the experts' activation kernels on the expert-stack shape ([32768, 2 x 1536] bf16): the
  fused SwiGLU forward / backward (``etp.kernels.swiglu``), each also with its rowwise FP8
  output, against the eager torch composition it replaces (silu, mul, and for the FP8 case
  a separate ``quantize_rowwise`` pass; backward through autograd); floor = the fused
  kernel's bytes.
* ``quantize_grouped_colwise`` (the FP8 weight-gradient operand) on [32768, 4096] bf16 in 16
  experts: floor = one read of x + the fp8 write (its second read is not counted), plus a
  sweep of its launch shape (JSON ``expert_activations.grouped_colwise.sweep``), and its
  per-expert mode (``row_amax`` given: one read of x) with a sweep of its tile
  (``expert_activations.grouped_per_expert.sweep``).
* correctness of every fused result against the torch reference (exact /
  bit-exact; SwiGLU to one bf16 ulp), recorded in the JSON.

Every "fraction of copy bw" is floor_ms / op_ms with floor_ms = the op's bytes
(read + written) at the copy's read+write byte rate measured in the same run.
Targets: amax >= 0.8, cast >= 0.7, cast + transposed copy >= 0.6.

Before each timed run a 256 MiB buffer is zeroed (evicts the 50 MiB L2) and a
spin kernel is queued that outlasts the host's enqueue time of the measured
call (measured first; at least 0.2 ms), so the start event fires only when the
whole call is queued: the events bracket device time only (for launch-bound
baselines such as the Python loops the gaps between their kernels are still
included).  ``host_ms_per_call`` (enqueue time) and ``wall_ms_per_call``
(back-to-back calls, host clock) show the host-inclusive cost.  (Before this,
a fixed 0.2 ms spin let the host time of ``multi_tensor_cast_fp8``'s 64-128
output allocations leak into its "device" time.)

Output: JSON to ``--out`` (default ``$OUT/bench_kernels.json``, or
``./bench_kernels.json`` without ``$OUT``), a markdown table on stdout, and a
block appended to ``--benchmarks-md PATH`` when given.  ``--dry-run`` runs
every step on tiny CPU tensors (torch reference, or the Triton interpreter
under ``TRITON_INTERPRET=1``) to check the script itself.

Example::

    python tools/bench_kernels.py --benchmarks-md BENCHMARKS.md
    TRITON_INTERPRET=1 python tools/bench_kernels.py --dry-run --out /tmp/bench.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402

from etp.kernels import amax as amax_mod  # noqa: E402
from etp.kernels import (  # noqa: E402
    amax_to_scale,
    multi_tensor_amax,
    multi_tensor_cast_fp8,
    quantize_blockwise,
    quantize_grouped_colwise,
    quantize_rowwise,
    swiglu,
    swiglu_backward,
)
from etp.kernels import cast as cast_mod  # noqa: E402
from etp.kernels import colwise as colwise_mod  # noqa: E402
from etp.kernels.reference import (  # noqa: E402
    blockwise_scale_shape,
    quantize_blockwise_ref,
    quantize_grouped_colwise_ref,
    swiglu_ref,
)

ANCHOR_COPY_MS = 0.095  # prior H200 measurement: 2 * 201,326,592 B / 4217 GB/s
AMAX_TARGET_FRACTION = 0.8
CAST_TARGET_FRACTION = 0.7
CAST_T_TARGET_FRACTION = 0.6
FLUSH_BYTES = 256 << 20
SPIN_MIN_MS = 0.2  # the spin ahead of each timed call lasts at least this long (more if the host needs it)
ROWWISE_SHAPES = [(8192, 32000), (16384, 4096)]  # bf16 activations: vocabulary projection, hidden
EXPERT_TOKENS, EXPERT_FFN, EXPERT_HIDDEN, EXPERTS = 32768, 1536, 4096, 16  # the expert stack's shapes

COLWISE_SWEEP = [  # (tokens per tile, columns per program, num_warps, tiles per loop step)
    (64, 64, 4, 1), (128, 64, 4, 1), (128, 64, 4, 4), (256, 64, 8, 1), (256, 64, 8, 2),
    (128, 32, 4, 2), (64, 128, 4, 2), (128, 128, 8, 2),
]
PER_EXPERT_SWEEP = [  # (padded positions per tile, columns, num_warps)
    (128, 128, 4), (64, 128, 4), (128, 64, 4), (64, 64, 4), (256, 128, 8), (128, 256, 8), (256, 64, 4),
]
AMAX_SWEEP = [  # (BLOCK, ITERS, num_warps, eviction policy, cached tables); first = default
    (amax_mod._FLAT_BLOCK, amax_mod._FLAT_ITERS, amax_mod._FLAT_WARPS, amax_mod._FLAT_EVICT, amax_mod._CACHE_TABLES),
    (4096, 4, 8, "evict_first", False),  # session 7's launch: tables and zeroed output uploaded per call
    (4096, 4, 8, "", True),
    (8192, 2, 8, "evict_first", True),
    (2048, 8, 4, "evict_first", True),
    (8192, 4, 8, "evict_first", True),
]
CAST_FLAT_SWEEP = [  # (BLOCK, ITERS, num_warps, eviction policy) of the plain cast; first = default
    (cast_mod._FLAT_BLOCK, cast_mod._FLAT_ITERS, cast_mod._FLAT_WARPS, amax_mod._FLAT_EVICT),
    (4096, 4, 8, ""),
    (4096, 4, 8, "evict_first"),
    (2048, 16, 4, "evict_first"),
    (4096, 2, 4, "evict_first"),
    (8192, 2, 8, "evict_first"),
]
CAST_SWEEP = [  # (tile_r, tile_c, num_warps) of the transposing path; first = default
    (cast_mod._TILE_R, cast_mod._TILE_C, cast_mod._TILE_WARPS),
    (128, 128, 8),
    (64, 64, 4),
    (128, 64, 4),
    (128, 128, 4),
    (64, 128, 8),
]


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=str, default=None, help="JSON output path")
    p.add_argument("--benchmarks-md", type=str, default=None, help="append a result block to this markdown file")
    p.add_argument("--num-tensors", type=int, default=64)
    p.add_argument("--shape", type=int, nargs=2, default=[1536, 1024], metavar=("ROWS", "COLS"))
    p.add_argument("--iters", type=int, default=100, help="timed runs per measurement (>= 50 on GPU)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--no-sweep", action="store_true", help="skip the tiling sweeps")
    p.add_argument("--dry-run", action="store_true", help="tiny CPU run that checks the script end to end")
    args = p.parse_args(argv)
    if args.dry_run:
        args.num_tensors, args.shape, args.iters, args.warmup = min(args.num_tensors, 4), [64, 128], 3, 1
    return args


class Timer:
    """Median device time of ``fn`` (CUDA events) or host time on CPU (dry run).

    Before each timed call a spin kernel is queued that lasts longer than the
    host needs to enqueue ``fn`` (measured during warm-up, at least
    ``SPIN_MIN_MS``), so the start event fires only when the whole call is
    already queued: the events bracket device time, not Python / allocator /
    launch overhead.  That host-inclusive cost is reported separately
    (``host_ms_per_call``: enqueue time; ``wall_ms_per_call``: back-to-back
    calls including the device).
    """

    def __init__(self, device: torch.device, iters: int, warmup: int):
        self.device, self.iters, self.warmup = device, iters, warmup
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(FLUSH_BYTES if self.cuda else 1 << 10, dtype=torch.uint8, device=device)
        self.cycles_per_ms = self._calibrate() if self.cuda else 0.0

    @staticmethod
    def _calibrate() -> float:
        torch.cuda._sleep(100_000)  # warm up
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 2_000_000
        s.record()
        torch.cuda._sleep(cycles)
        e.record()
        torch.cuda.synchronize()
        return cycles / max(s.elapsed_time(e), 1e-3)

    def __call__(self, fn: Callable[[], object]) -> Dict[str, float]:
        t0 = time.perf_counter()
        for _ in range(self.warmup):
            fn()
        host_ms = (time.perf_counter() - t0) * 1e3 / max(self.warmup, 1)
        if not self.cuda:
            times = []
            for _ in range(self.iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return {"median_ms": statistics.median(times), "min_ms": min(times), "runs": self.iters,
                    "wall_ms_per_call": statistics.median(times)}
        torch.cuda.synchronize()
        # Host enqueue time per call, measured with the device idle ahead of each call.
        host = []
        for _ in range(min(self.iters, 20)):
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
        host_ms = statistics.median(host)
        spin_ms = max(SPIN_MIN_MS, 2.0 * max(host) + 0.05)
        spin_cycles = int(spin_ms * self.cycles_per_ms)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.iters)]
        for s, e in zip(starts, ends):
            self.flush.zero_()
            torch.cuda._sleep(spin_cycles)
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
        # Host-inclusive cost: back-to-back calls, no flush.
        t0 = time.perf_counter()
        for _ in range(self.iters):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / self.iters
        return {
            "median_ms": statistics.median(times),
            "min_ms": times[0],
            "p90_ms": times[int(0.9 * (len(times) - 1))],
            "runs": self.iters,
            "host_ms_per_call": host_ms,
            "spin_ms": spin_ms,
            "wall_ms_per_call": wall,
        }


def fp8_bit_mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    an, bn = a.float().isnan(), b.float().isnan()
    if not torch.equal(an, bn):
        return int((an != bn).sum())
    return int(((a.view(torch.uint8) != b.view(torch.uint8)) & ~an).sum())


def float_mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    an, bn = a.isnan(), b.isnan()
    return int((an != bn).sum()) + int(((a != b) & ~an & ~bn).sum())


def main(argv: List[str]) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("bench_kernels.py needs a CUDA GPU (use --dry-run to check the script on CPU)", file=sys.stderr)
        return 2
    if cuda and args.iters < 50:
        print("--iters must be >= 50 on GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    # On GPU the fused path is the compiled Triton kernel; in a dry run it is the
    # interpreter when TRITON_INTERPRET=1, else the torch reference.
    fused_impl = "triton" if cuda or amax_mod.interpreter_active() else "torch"
    timer = Timer(device, args.iters, args.warmup)

    rows, cols = args.shape
    n_t = args.num_tensors
    gen = torch.Generator().manual_seed(0)
    stacked = torch.randn((n_t, rows, cols), generator=gen).to(torch.bfloat16).to(device)
    shards = list(stacked.unbind(0))  # contiguous views of one allocation
    shard_bytes = sum(t.numel() * t.element_size() for t in shards)
    n_elem = sum(t.numel() for t in shards)

    result: Dict[str, object] = {
        "argv": sys.argv,
        "command": " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "dry_run": args.dry_run,
        "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()},
        "fused_impl": fused_impl,
        "config": {"num_tensors": n_t, "shape": [rows, cols], "dtype": "bfloat16", "bytes": shard_bytes,
                   "iters": args.iters, "warmup": args.warmup},
    }

    # ---- copy floor ----------------------------------------------------------
    src = torch.empty(shard_bytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    copy = timer(functools.partial(dst.copy_, src))
    copy_bw = 2 * shard_bytes / (copy["median_ms"] * 1e-3) / 1e9  # GB/s, read + write
    result["copy"] = {**copy, "bandwidth_GBps": copy_bw, "anchor_copy_ms": ANCHOR_COPY_MS,
                      "anchor_note": "prior H200 measurement of this copy: 2 * 201,326,592 B / 4217 GB/s"}
    del src, dst

    def floor_ms(bytes_moved: int) -> float:
        return bytes_moved / (copy_bw * 1e9) * 1e3

    rows_md = [("d2d copy (floor ref)", "torch", copy["median_ms"], 2 * shard_bytes, 1.0)]

    # ---- amax ------------------------------------------------------------------
    amax_floor = floor_ms(shard_bytes)
    fused = timer(lambda: multi_tensor_amax(shards, impl=fused_impl))
    foreach = timer(lambda: torch._foreach_norm(shards, ord=float("inf")))
    loop = timer(lambda: [t.abs().amax() for t in shards])
    frac = amax_floor / fused["median_ms"]
    amax_res: Dict[str, object] = {
        "floor_ms": amax_floor,
        "fused": {**fused, "fraction_of_copy_bw": frac},
        "foreach_norm_inf": {**foreach, "fraction_of_copy_bw": amax_floor / foreach["median_ms"]},
        "loop_abs_amax": {**loop, "fraction_of_copy_bw": amax_floor / loop["median_ms"]},
        "target_fraction": AMAX_TARGET_FRACTION,
        "meets_target": frac >= AMAX_TARGET_FRACTION,
    }
    rows_md += [
        ("amax fused", fused_impl, fused["median_ms"], shard_bytes, frac),
        ("amax _foreach_norm(inf)", "torch", foreach["median_ms"], shard_bytes, amax_floor / foreach["median_ms"]),
        ("amax loop abs().amax()", "torch", loop["median_ms"], shard_bytes, amax_floor / loop["median_ms"]),
    ]
    if fused_impl == "triton" and not args.no_sweep:
        sweep = []
        for block, iters, warps, evict, cached in AMAX_SWEEP:
            def run(b=block, i=iters, w=warps, ev=evict, c=cached):
                # out=None: each variant initialises its output its own way (fill or upload)
                amax_mod._launch_multi_tensor_amax(shards, None, block=b, iters=i, num_warps=w, evict=ev,
                                                   cache_tables=c)
            t = timer(run)
            sweep.append({"block": block, "iters": iters, "num_warps": warps, "evict": evict,
                          "cached_tables": cached,
                          "median_ms": t["median_ms"], "min_ms": t["min_ms"],
                          "fraction_of_copy_bw": amax_floor / t["median_ms"]})
        amax_res["sweep"] = sweep
    result["amax"] = amax_res

    # ---- fp8 cast -------------------------------------------------------------
    amax = multi_tensor_amax(shards, impl=fused_impl)
    scales = amax_to_scale(amax)
    cast_res: Dict[str, object] = {}
    for write_t in (False, True):
        key = "transposed" if write_t else "plain"
        moved = shard_bytes + n_elem * (2 if write_t else 1)  # bf16 read + fp8 written (x2 with q^T)
        fl = floor_ms(moved)
        f = timer(lambda w=write_t: multi_tensor_cast_fp8(shards, scales, write_transposed=w, impl=fused_impl))
        r = timer(lambda w=write_t: multi_tensor_cast_fp8(shards, scales, write_transposed=w, impl="torch"))
        cast_res[key] = {"bytes_moved": moved, "floor_ms": fl,
                         "fused": {**f, "fraction_of_copy_bw": fl / f["median_ms"]},
                         "torch_ref": {**r, "fraction_of_copy_bw": fl / r["median_ms"]}}
        rows_md += [(f"fp8 cast {key} fused", fused_impl, f["median_ms"], moved, fl / f["median_ms"]),
                    (f"fp8 cast {key} torch", "torch", r["median_ms"], moved, fl / r["median_ms"])]
    # Delayed weight scaling (ETPConfig.fp8_weight_scaling): the transposing cast that also
    # records each tensor's amax, into given buffers; then the device-decided re-cast when no
    # weight's amax grew (every program exits after one load).
    qs, qts = multi_tensor_cast_fp8(shards, scales, write_transposed=True, impl=fused_impl)
    rec_amax = torch.empty(len(shards), dtype=torch.float32, device=device)
    moved, fl = cast_res["transposed"]["bytes_moved"], cast_res["transposed"]["floor_ms"]
    f = timer(lambda: multi_tensor_cast_fp8(shards, scales, write_transposed=True, out=qs, out_transposed=qts,
                                            amax_out=rec_amax, impl=fused_impl))
    nothing = torch.zeros(len(shards), dtype=torch.bool, device=device)
    n = timer(lambda: multi_tensor_cast_fp8(shards, scales, write_transposed=True, out=qs, out_transposed=qts,
                                            only=nothing, impl=fused_impl))
    cast_res["transposed_amax"] = {"bytes_moved": moved, "floor_ms": fl,
                                   "fused": {**f, "fraction_of_copy_bw": fl / f["median_ms"]},
                                   "recast_nothing_picked": n}
    rows_md += [("fp8 cast transposed + amax (delayed scaling) fused", fused_impl, f["median_ms"], moved,
                 fl / f["median_ms"]),
                ("fp8 re-cast, nothing picked (delayed scaling)", fused_impl, n["median_ms"], 0, 0.0)]
    if fused_impl == "triton" and not args.no_sweep:
        sweep = []
        bits = rec_amax.view(torch.int32)
        for tr, tc, warps in CAST_SWEEP:
            def run(a=tr, b=tc, w=warps):
                cast_mod._launch_multi_tensor_cast_fp8(shards, scales, qs, qts, tile_r=a, tile_c=b, num_warps=w,
                                                       amax_bits=bits)
            t = timer(run)
            sweep.append({"tile_r": tr, "tile_c": tc, "num_warps": warps, "median_ms": t["median_ms"],
                          "fraction_of_copy_bw": fl / t["median_ms"]})
        cast_res["transposed_amax_sweep"] = sweep
    if fused_impl == "triton" and not args.no_sweep:
        sweep = []
        qs, _ = multi_tensor_cast_fp8(shards, scales, impl=fused_impl)
        fl = cast_res["plain"]["floor_ms"]
        for block, iters, warps, evict in CAST_FLAT_SWEEP:
            def run(b=block, i=iters, w=warps, ev=evict):
                cast_mod._launch_multi_tensor_cast_fp8(shards, scales, qs, None, block=b, iters=i, num_warps=w,
                                                       evict=ev)
            t = timer(run)
            sweep.append({"block": block, "iters": iters, "num_warps": warps, "evict": evict,
                          "median_ms": t["median_ms"], "fraction_of_copy_bw": fl / t["median_ms"]})
        cast_res["plain_sweep"] = sweep
        sweep = []
        qs, qts = multi_tensor_cast_fp8(shards, scales, write_transposed=True, impl=fused_impl)
        fl = cast_res["transposed"]["floor_ms"]
        for tr, tc, warps in CAST_SWEEP:
            def run(a=tr, b=tc, w=warps):
                cast_mod._launch_multi_tensor_cast_fp8(shards, scales, qs, qts, tile_r=a, tile_c=b, num_warps=w)
            t = timer(run)
            sweep.append({"tile_r": tr, "tile_c": tc, "num_warps": warps, "median_ms": t["median_ms"],
                          "fraction_of_copy_bw": fl / t["median_ms"]})
        cast_res["transposed_sweep"] = sweep
    result["cast"] = cast_res

    # ---- blockwise --------------------------------------------------------------
    acts = stacked.view(n_t * rows, cols)
    bw_res = {}
    for name, x, block in (("weights_128x128", stacked, (128, 128)), ("activations_1x128", acts, (1, 128))):
        n_scales = math.prod(blockwise_scale_shape(x.shape, *block))
        moved = shard_bytes + n_elem + 4 * n_scales
        fl = floor_ms(moved)
        f = timer(lambda x=x, b=block: quantize_blockwise(x, *b, impl=fused_impl))
        r = timer(lambda x=x, b=block: quantize_blockwise(x, *b, impl="torch"))
        bw_res[name] = {"bytes_moved": moved, "floor_ms": fl,
                        "fused": {**f, "fraction_of_copy_bw": fl / f["median_ms"]},
                        "torch_ref": {**r, "fraction_of_copy_bw": fl / r["median_ms"]}}
        rows_md += [(f"blockwise {name} fused", fused_impl, f["median_ms"], moved, fl / f["median_ms"]),
                    (f"blockwise {name} torch", "torch", r["median_ms"], moved, fl / r["median_ms"])]
    result["blockwise"] = bw_res

    # ---- rowwise activation quantization (the FP8 GEMM input) ---------------------
    rw_res = {}
    rw_inputs = {}
    for r_rows, r_cols in ROWWISE_SHAPES:
        if args.dry_run:
            # Tiny, but the wide shape still takes the two-pass kernel.
            r_rows, r_cols = (2, r_cols + 3) if r_cols > 16384 else (max(2, r_rows // 2048), r_cols // 8 + 3)
        name = f"{r_rows}x{r_cols}"
        x = torch.randn((r_rows, r_cols), generator=gen).to(torch.bfloat16).to(device)
        rw_inputs[name] = x
        moved = x.numel() * 3 + 4 * r_rows  # bf16 read once + fp8 written + scales
        fl = floor_ms(moved)
        f = timer(lambda x=x: quantize_rowwise(x, impl=fused_impl))
        r = timer(lambda x=x: quantize_rowwise(x, impl="torch"))
        rw_res[name] = {"shape": [r_rows, r_cols], "bytes_moved": moved, "floor_ms": fl,
                        "two_pass": r_cols > 16384,
                        "fused": {**f, "fraction_of_copy_bw": fl / f["median_ms"]},
                        "torch_ref": {**r, "fraction_of_copy_bw": fl / r["median_ms"]}}
        rows_md += [(f"rowwise quantize {name} fused", fused_impl, f["median_ms"], moved, fl / f["median_ms"]),
                    (f"rowwise quantize {name} torch", "torch", r["median_ms"], moved, fl / r["median_ms"])]
    result["rowwise"] = rw_res

    # ---- the experts' activation kernels ------------------------------------------
    t_tok, ffn, hid, n_exp = ((256, 48, 64, 4) if args.dry_run else
                              (EXPERT_TOKENS, EXPERT_FFN, EXPERT_HIDDEN, EXPERTS))
    gate_up = torch.randn((t_tok, 2 * ffn), generator=gen).to(torch.bfloat16).to(device)
    grad_h = torch.randn((t_tok, ffn), generator=gen).to(torch.bfloat16).to(device)
    gu_leaf = gate_up.clone().requires_grad_(True)

    def eager_forward(quantize: bool):
        h = torch.nn.functional.silu(gate_up[:, :ffn]) * gate_up[:, ffn:]
        return quantize_rowwise(h, impl=fused_impl) if quantize else h

    def eager_backward(quantize: bool):
        h = torch.nn.functional.silu(gu_leaf[:, :ffn]) * gu_leaf[:, ffn:]
        (d,) = torch.autograd.grad(h, gu_leaf, grad_h)
        return quantize_rowwise(d, impl=fused_impl) if quantize else d

    act_res = {}
    elem = gate_up.numel()
    moves = {"swiglu_fwd": 2 * elem + elem, "swiglu_fwd_fp8": 2 * elem + elem + elem // 2,
             "swiglu_bwd": 2 * elem + elem + 2 * elem, "swiglu_bwd_fp8": 2 * elem + elem + 2 * elem + elem}
    for name, fused_fn, eager_fn in (
        ("swiglu_fwd", lambda: swiglu(gate_up, impl=fused_impl), lambda: eager_forward(False)),
        ("swiglu_fwd_fp8", lambda: swiglu(gate_up, quantize=True, impl=fused_impl), lambda: eager_forward(True)),
        ("swiglu_bwd", lambda: swiglu_backward(gate_up, grad_h, impl=fused_impl), lambda: eager_backward(False)),
        ("swiglu_bwd_fp8", lambda: swiglu_backward(gate_up, grad_h, quantize=True, impl=fused_impl),
         lambda: eager_backward(True)),
    ):
        fl = floor_ms(moves[name])
        f, e = timer(fused_fn), timer(eager_fn)
        act_res[name] = {"bytes_moved": moves[name], "floor_ms": fl,
                         "fused": {**f, "fraction_of_copy_bw": fl / f["median_ms"]},
                         "eager_torch": {**e, "fraction_of_copy_bw": fl / e["median_ms"]}}
        rows_md += [(f"{name} [{t_tok}x{2 * ffn}] fused", fused_impl, f["median_ms"], moves[name], fl / f["median_ms"]),
                    (f"{name} [{t_tok}x{2 * ffn}] eager torch", "torch", e["median_ms"], moves[name],
                     fl / e["median_ms"])]
    x_act = torch.randn((t_tok, hid), generator=gen).to(torch.bfloat16).to(device)
    counts = torch.full((n_exp,), t_tok // n_exp, dtype=torch.int64, device=device)
    moved = x_act.numel() * 3
    fl = floor_ms(moved)
    f = timer(lambda: quantize_grouped_colwise(x_act, counts, impl=fused_impl))
    act_res["grouped_colwise"] = {"bytes_moved": moved, "floor_ms": fl,
                                  "fused": {**f, "fraction_of_copy_bw": fl / f["median_ms"]}}
    rows_md.append((f"grouped colwise quantize [{t_tok}x{hid}], {n_exp} experts", fused_impl, f["median_ms"],
                    moved, fl / f["median_ms"]))
    # Per expert from the rows' amax (what the rowwise pass of the FP8 GEMMs leaves behind):
    # one read of x instead of two.
    x_row_amax = x_act.abs().amax(dim=1).float()
    f = timer(lambda: quantize_grouped_colwise(x_act, counts, row_amax=x_row_amax, impl=fused_impl))
    act_res["grouped_per_expert"] = {"bytes_moved": moved, "floor_ms": fl,
                                     "fused": {**f, "fraction_of_copy_bw": fl / f["median_ms"]}}
    rows_md.append((f"grouped per-expert quantize [{t_tok}x{hid}], {n_exp} experts (row amax given)", fused_impl,
                    f["median_ms"], moved, fl / f["median_ms"]))
    if fused_impl == "triton" and not args.no_sweep:
        # Its tile: (padded positions, columns, warps); first = default.
        defaults = (colwise_mod._PE_TP, colwise_mod._PE_TC, colwise_mod._PE_WARPS)
        sweep = []
        for shape in [defaults] + [c for c in PER_EXPERT_SWEEP if c != defaults]:
            colwise_mod._PE_TP, colwise_mod._PE_TC, colwise_mod._PE_WARPS = shape
            t = timer(lambda: quantize_grouped_colwise(x_act, counts, row_amax=x_row_amax, impl=fused_impl))
            sweep.append({"positions": shape[0], "cols": shape[1], "num_warps": shape[2],
                          "median_ms": t["median_ms"], "fraction_of_copy_bw": fl / t["median_ms"]})
        colwise_mod._PE_TP, colwise_mod._PE_TC, colwise_mod._PE_WARPS = defaults
        act_res["grouped_per_expert"]["sweep"] = sweep
    if fused_impl == "triton" and not args.no_sweep:
        # Its launch shape: (tokens per tile, columns, warps, tiles per loop step); first = default.
        defaults = (colwise_mod._TT, colwise_mod._TC, colwise_mod._WARPS, colwise_mod._UNROLL)
        sweep = []
        for shape in [defaults] + [c for c in COLWISE_SWEEP if c != defaults]:
            colwise_mod._TT, colwise_mod._TC, colwise_mod._WARPS, colwise_mod._UNROLL = shape
            t = timer(lambda: quantize_grouped_colwise(x_act, counts, impl=fused_impl))
            sweep.append({"tokens": shape[0], "cols": shape[1], "num_warps": shape[2], "unroll": shape[3],
                          "median_ms": t["median_ms"], "fraction_of_copy_bw": fl / t["median_ms"]})
        colwise_mod._TT, colwise_mod._TC, colwise_mod._WARPS, colwise_mod._UNROLL = defaults
        act_res["grouped_colwise"]["sweep"] = sweep
    result["expert_activations"] = act_res

    # ---- correctness (fused vs torch reference) ---------------------------------
    ref_amax = multi_tensor_amax(shards, impl="torch")
    foreach_amax = torch.stack(torch._foreach_norm(shards, ord=float("inf"))).float()
    corr: Dict[str, object] = {
        "amax_mismatches_vs_ref": float_mismatches(amax, ref_amax),
        "amax_mismatches_vs_foreach_norm": float_mismatches(amax, foreach_amax),
    }
    qs, qts = multi_tensor_cast_fp8(shards, scales, write_transposed=True, impl=fused_impl)
    rqs, rqts = multi_tensor_cast_fp8(shards, scales, write_transposed=True, impl="torch")
    corr["cast_bit_mismatches"] = sum(fp8_bit_mismatches(a, b) for a, b in zip(qs, rqs))
    corr["cast_transposed_bit_mismatches"] = sum(fp8_bit_mismatches(a, b) for a, b in zip(qts, rqts))
    rec_amax = torch.empty(len(shards), dtype=torch.float32, device=device)
    multi_tensor_cast_fp8(shards, scales, write_transposed=True, out=qs, out_transposed=qts, amax_out=rec_amax,
                          impl=fused_impl)
    corr["cast_recorded_amax_mismatches"] = float_mismatches(rec_amax, ref_amax)
    corr["cast_transposed_amax_bit_mismatches"] = sum(fp8_bit_mismatches(a, b) for a, b in zip(qts, rqts))
    (q_plain,), _ = multi_tensor_cast_fp8(shards[:1], scales[:1], impl=fused_impl)
    corr["cast_plain_bit_mismatches"] = fp8_bit_mismatches(q_plain, rqs[0])
    for name, x, block in (("weights_128x128", stacked, (128, 128)), ("activations_1x128", acts, (1, 128))):
        q, s = quantize_blockwise(x, *block, impl=fused_impl)
        rq, rs = quantize_blockwise(x, *block, impl="torch")
        corr[f"blockwise_{name}_bit_mismatches"] = fp8_bit_mismatches(q, rq) + float_mismatches(s, rs)
    for name, x in rw_inputs.items():
        q, s = quantize_rowwise(x, impl=fused_impl)
        rq, rs = quantize_blockwise_ref(x, 1, x.shape[1])
        corr[f"rowwise_{name}_bit_mismatches"] = fp8_bit_mismatches(q, rq) + float_mismatches(s, rs.reshape(-1))
    h, hq, hs = swiglu(gate_up, quantize=True, impl=fused_impl)
    rh, _, _ = swiglu_ref(gate_up)
    hq_ref, hs_ref = quantize_rowwise(h, impl="torch")
    # The kernel's exp may differ from torch's in the last float32 bit: one bf16 ulp.
    corr["swiglu_beyond_one_ulp"] = int(((h.float() - rh.float()).abs() > rh.float().abs() * 2 ** -7 + 1e-30).sum())
    corr["swiglu_fp8_bit_mismatches"] = fp8_bit_mismatches(hq, hq_ref) + float_mismatches(hs, 1.0 / hs_ref)
    cq, cs, ends = quantize_grouped_colwise(x_act, counts, impl=fused_impl)
    rcq, rcs, _ = quantize_grouped_colwise_ref(x_act, counts)
    used = int(ends[-1])  # past the last padded segment the kernel leaves the buffer unwritten
    corr["grouped_colwise_bit_mismatches"] = fp8_bit_mismatches(cq[:, :used], rcq[:, :used]) + float_mismatches(cs, rcs)
    cq, cs, _ = quantize_grouped_colwise(x_act, counts, row_amax=x_row_amax, impl=fused_impl)
    rcq, rcs, _ = quantize_grouped_colwise_ref(x_act, counts, row_amax=x_row_amax)
    corr["grouped_per_expert_bit_mismatches"] = (fp8_bit_mismatches(cq[:, :used], rcq[:, :used])
                                                 + float_mismatches(cs, rcs))
    corr["all_exact"] = all(v == 0 for v in corr.values())
    result["correctness"] = corr

    # ---- output -------------------------------------------------------------------
    out_path = Path(args.out) if args.out else Path(os.environ.get("OUT", ".")) / "bench_kernels.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")

    table = ["| op | impl | median ms | GB/s | fraction of copy bw |", "|---|---|---:|---:|---:|"]
    for name, impl, ms, moved, fr in rows_md:
        table.append(f"| {name} | {impl} | {ms:.4f} | {moved / (ms * 1e-3) / 1e9:.0f} | {fr:.2f} |")
    cast_frac = cast_res["plain"]["fused"]["fraction_of_copy_bw"]
    cast_t_frac = cast_res["transposed"]["fused"]["fraction_of_copy_bw"]
    targets = {"amax": (frac, AMAX_TARGET_FRACTION), "cast": (cast_frac, CAST_TARGET_FRACTION),
               "cast_transposed": (cast_t_frac, CAST_T_TARGET_FRACTION)}
    result["targets"] = {k: {"fraction_of_copy_bw": v, "target": t, "met": v >= t} for k, (v, t) in targets.items()}

    def verdict(k: str) -> str:
        v, t = targets[k]
        return f"{v:.2f} (target {t}, {'met' if v >= t else 'NOT met'})"

    summary = (
        f"fraction of copy bandwidth: amax {verdict('amax')}, cast {verdict('cast')}, "
        f"cast+transposed {verdict('cast_transposed')}; "
        f"copy {copy['median_ms']:.4f} ms (anchor {ANCHOR_COPY_MS} ms); "
        f"correctness: {'exact' if corr['all_exact'] else 'MISMATCH'}"
    )
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    sys.stdout.write("\n".join(table) + "\n\n" + summary + "\n")
    if args.benchmarks_md:
        block = [
            f"\n## bench_kernels {result['timestamp']} ({result['device']})\n",
            f"`{result['command']}`  \n",
            f"torch {torch.__version__}, triton {triton.__version__}; {n_t} x {rows}x{cols} bf16 "
            f"= {shard_bytes:,} bytes; median of {args.iters} runs{' (DRY RUN, CPU)' if args.dry_run else ''}\n\n",
            "\n".join(table) + "\n\n",
            summary + "\n",
        ]
        with open(args.benchmarks_md, "a") as f:
            f.writelines(block)
    return 0 if corr["all_exact"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
