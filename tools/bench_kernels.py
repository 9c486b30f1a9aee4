#!/usr/bin/env python
"""etp's FP8 and activation kernels against the copy bandwidth of the same GPU (one GPU;
BENCHMARKS.md, "FP8 kernels against copy bandwidth").

Workload: 64 bf16 expert shards of [1536, 1024] (201,326,592 bytes: the shards one rank
quantizes before an FP8 weight gather), rowwise activations [16384, 4096] and [8192, 32000]
(the vocabulary projection: the two-pass kernel), and the expert stack's activations
[32768, 2 x 1536] / [32768, 4096] in 16 experts. Each op beside what it replaces (torch's own
composition) and the copy floor:

* copy: a device-to-device copy of the shards' bytes; ``copy_bw`` = read + written bytes / ms.
* amax (fused ``multi_tensor_amax`` vs ``torch._foreach_norm(inf)`` vs a Python loop), fp8
  cast, the cast into kept buffers that records the amax (delayed scaling, as
  ``etp.quantize_shards`` runs it), its re-cast when no amax grew; blockwise 128x128 / 1x128
  and rowwise quantization; the fused SwiGLU forward / backward (each also with its rowwise FP8 output);
  the FP8 weight-gradient operands (``quantize_grouped_colwise``, per column and per expert).
* "fraction of copy bw" = floor ms / op ms, floor = the op's bytes read + written at
  ``copy_bw`` (targets: amax 0.8, cast 0.7).
* correctness of every fused result against the torch reference (bit-exact; SwiGLU to one bf16
  ulp).

Two times per op. *Device ms* is the mean of ``--iters`` runs between CUDA events, each run
after an L2 flush and behind a spin kernel that outlasts the host's enqueue of the call, so the
events bracket device time only: it EXCLUDES the host's cost. *Host wall ms per call* is
``--iters`` calls back to back timed with the host clock (launches, allocation and the device
together): what an issue-bound step pays. JSON to ``--out`` with a ``provenance`` block; the
table on stdout. ``--dry-run`` checks the script on CPU (torch references, or the Triton
interpreter under ``TRITON_INTERPRET=1``).

Example::

    python3 tools/bench_kernels.py --out kernels.json
    python3 tools/bench_kernels.py --dry-run --out /tmp/kernels.json
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/: bench_provenance

from bench_provenance import provenance  # noqa: E402 - puts this checkout's etp first on the path

from etp.kernels import (  # noqa: E402
    MultiTensorCastPlan,
    amax_to_scale,
    multi_tensor_amax,
    multi_tensor_cast_fp8,
    quantize_blockwise,
    quantize_grouped_colwise,
    quantize_rowwise,
    swiglu,
    swiglu_backward,
)
from etp.kernels.amax import interpreter_active  # noqa: E402
from etp.kernels.reference import (  # noqa: E402
    blockwise_scale_shape,
    quantize_blockwise_ref,
    quantize_grouped_colwise_ref,
    swiglu_ref,
)

TARGETS = {"amax": 0.8, "cast": 0.7}  # fraction of copy bandwidth
FLUSH_BYTES = 256 << 20  # zeroed before each timed run: evicts the 50 MiB L2
SPIN_MIN_MS = 0.2
ROWWISE_SHAPES = [(16384, 4096), (8192, 32000)]
EXPERT_TOKENS, EXPERT_FFN, EXPERT_HIDDEN, EXPERTS = 32768, 1536, 4096, 16  # the expert stack's shapes


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench_kernels.json", help="JSON path")
    p.add_argument("--num-tensors", type=int, default=64)
    p.add_argument("--shape", type=int, nargs=2, default=[1536, 1024], metavar=("ROWS", "COLS"))
    p.add_argument("--iters", type=int, default=100, help="timed runs per op (>= 50 on GPU)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--dry-run", action="store_true", help="tiny CPU run that checks the script end to end")
    args = p.parse_args(argv)
    if args.dry_run:
        args.num_tensors, args.shape, args.iters, args.warmup = min(args.num_tensors, 4), [64, 128], 3, 1
    return args


class Timer:
    """Device time (mean of CUDA-event runs, host cost excluded) and host wall time per call."""

    def __init__(self, device: torch.device, iters: int, warmup: int):
        self.device, self.iters, self.warmup = device, iters, warmup
        self.cuda = device.type == "cuda"
        self.flush = torch.empty(FLUSH_BYTES if self.cuda else 1 << 10, dtype=torch.uint8, device=device)
        self.cycles_per_ms = self._calibrate() if self.cuda else 0.0

    @staticmethod
    def _calibrate() -> float:
        torch.cuda._sleep(100_000)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.cuda._sleep(2_000_000)
        e.record()
        torch.cuda.synchronize()
        return 2_000_000 / max(s.elapsed_time(e), 1e-3)

    def _wall(self, fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        for _ in range(self.iters):
            fn()
        if self.cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3 / self.iters

    def _device(self, fn: Callable[[], object]) -> list[float]:
        enqueue = []  # the host's enqueue time of one call, the device idle ahead of it
        for _ in range(min(self.iters, 20)):
            start = time.perf_counter()
            fn()
            enqueue.append((time.perf_counter() - start) * 1e3)
            torch.cuda.synchronize()
        spin_cycles = int(max(SPIN_MIN_MS, 2.0 * max(enqueue) + 0.05) * self.cycles_per_ms)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.iters)]
        for s, e in events:
            self.flush.zero_()
            torch.cuda._sleep(spin_cycles)  # the whole call is queued before ``s`` fires
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in events]

    def __call__(self, fn: Callable[[], object]) -> dict:
        for _ in range(self.warmup):
            fn()
        wall = self._wall(fn)
        times = self._device(fn) if self.cuda else [wall] * self.iters
        return {"device_ms": statistics.fmean(times), "device_ms_median": statistics.median(times),
                "device_ms_stdev": statistics.stdev(times) if len(times) > 1 else 0.0, "runs": self.iters,
                "host_wall_ms_per_call": wall}


class Bench:
    """The run's timer and copy floor, and the rows it has measured."""

    def __init__(self, timer: Timer, impl: str):
        self.timer, self.impl, self.rows, self.copy_bw = timer, impl, [], None

    def floor_ms(self, moved: int) -> float:
        return moved / (self.copy_bw * 1e9) * 1e3

    def op(self, name: str, impl: str, fn: Callable[[], object], moved: int) -> dict:
        """Times ``fn``, adds its table row, returns its figures with the fraction of copy bw."""
        t = self.timer(fn)
        t["fraction_of_copy_bw"] = self.floor_ms(moved) / t["device_ms"] if moved else None
        t["bytes_moved"] = moved
        self.rows.append((name, impl, t))
        return t

    def pair(self, name: str, fused: Callable, reference: Callable, moved: int, ref_label: str = "torch") -> dict:
        return {"fused": self.op(f"{name}, fused", self.impl, fused, moved),
                "reference": self.op(f"{name}, {ref_label}", "torch", reference, moved)}


def measure_copy(bench: Bench, nbytes: int, device: torch.device) -> dict:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    t = bench.timer(lambda: dst.copy_(src))
    bench.copy_bw = 2 * nbytes / (t["device_ms"] * 1e-3) / 1e9  # GB/s, read + write
    t.update(bandwidth_GBps=bench.copy_bw, fraction_of_copy_bw=1.0, bytes_moved=2 * nbytes)
    bench.rows.append(("d2d copy (the floor)", "torch", t))
    return t


def measure_amax(bench: Bench, shards: list[torch.Tensor], nbytes: int) -> dict:
    return {
        "fused": bench.op("amax, fused multi-tensor", bench.impl, lambda: multi_tensor_amax(shards, impl=bench.impl),
                          nbytes),
        "foreach_norm_inf": bench.op("amax, torch._foreach_norm(inf)", "torch",
                                     lambda: torch._foreach_norm(shards, ord=float("inf")), nbytes),
        "loop": bench.op("amax, Python loop of abs().amax()", "torch", lambda: [t.abs().amax() for t in shards],
                         nbytes),
    }


def measure_cast(bench: Bench, shards: list[torch.Tensor], scales: torch.Tensor) -> dict:
    nbytes, n_elem = sum(t.numel() * t.element_size() for t in shards), sum(t.numel() for t in shards)
    moved = nbytes + n_elem  # bf16 read, fp8 written
    result = {"plain": bench.pair("fp8 cast", lambda: multi_tensor_cast_fp8(shards, scales, impl=bench.impl),
                                  lambda: multi_tensor_cast_fp8(shards, scales, impl="torch"), moved)}
    # Delayed weight scaling as etp.quantize_shards runs it: a plan over kept buffers casts and
    # records each tensor's amax, then the device-decided re-cast when no amax grew (every
    # program exits after one load).
    plan = MultiTensorCastPlan(shards, out=multi_tensor_cast_fp8(shards, scales, impl=bench.impl)[0],
                               impl=bench.impl)
    amax = torch.empty(len(shards), dtype=torch.float32, device=scales.device)
    none = torch.zeros(len(shards), dtype=torch.bool, device=scales.device)
    result["amax_recorded"] = bench.op("fp8 cast into kept buffers + amax recorded (delayed scaling)", bench.impl,
                                       lambda: plan.run(scales, amax_out=amax), moved)
    result["recast_nothing_picked"] = bench.op("fp8 re-cast, no amax grew (delayed scaling)", bench.impl,
                                               lambda: plan.run(scales, only=none), 0)
    return result


def measure_quantize(bench: Bench, stacked: torch.Tensor, rowwise: dict) -> dict:
    rows, cols = stacked.shape[-2:]
    result = {}
    for name, x, block in (("blockwise 128x128 (weights)", stacked, (128, 128)),
                           ("blockwise 1x128 (activations)", stacked.view(-1, cols), (1, 128))):
        moved = x.numel() * 3 + 4 * math.prod(blockwise_scale_shape(x.shape, *block))
        result[name] = bench.pair(name, lambda x=x, b=block: quantize_blockwise(x, *b, impl=bench.impl),
                                  lambda x=x, b=block: quantize_blockwise(x, *b, impl="torch"), moved)
    for name, x in rowwise.items():
        moved = x.numel() * 3 + 4 * x.shape[0]  # bf16 read once, fp8 written, scales
        result[f"rowwise {name}"] = bench.pair(f"rowwise quantize {name}",
                                               lambda x=x: quantize_rowwise(x, impl=bench.impl),
                                               lambda x=x: quantize_rowwise(x, impl="torch"), moved)
    return result


def measure_swiglu(bench: Bench, gate_up: torch.Tensor, grad_h: torch.Tensor) -> dict:
    ffn, elem = grad_h.shape[1], gate_up.numel()
    leaf = gate_up.clone().requires_grad_(True)

    def eager_forward(quantize: bool):
        h = torch.nn.functional.silu(gate_up[:, :ffn]) * gate_up[:, ffn:]
        return quantize_rowwise(h, impl=bench.impl) if quantize else h

    def eager_backward(quantize: bool):
        h = torch.nn.functional.silu(leaf[:, :ffn]) * leaf[:, ffn:]
        (d,) = torch.autograd.grad(h, leaf, grad_h)
        return quantize_rowwise(d, impl=bench.impl) if quantize else d

    shape = f"[{gate_up.shape[0]}x{gate_up.shape[1]}]"
    return {
        "forward": bench.pair(f"SwiGLU forward {shape}", lambda: swiglu(gate_up, impl=bench.impl),
                              lambda: eager_forward(False), 3 * elem, "eager torch"),
        "forward_fp8": bench.pair(f"SwiGLU forward + rowwise FP8 {shape}",
                                  lambda: swiglu(gate_up, quantize=True, impl=bench.impl),
                                  lambda: eager_forward(True), 3 * elem + elem // 2, "eager torch"),
        "backward": bench.pair(f"SwiGLU backward {shape}", lambda: swiglu_backward(gate_up, grad_h, impl=bench.impl),
                               lambda: eager_backward(False), 5 * elem, "eager torch (autograd)"),
        "backward_fp8": bench.pair(f"SwiGLU backward + rowwise FP8 {shape}",
                                   lambda: swiglu_backward(gate_up, grad_h, quantize=True, impl=bench.impl),
                                   lambda: eager_backward(True), 6 * elem, "eager torch (autograd)"),
    }


def measure_wgrad_operands(bench: Bench, x: torch.Tensor, counts: torch.Tensor, row_amax: torch.Tensor) -> dict:
    shape = f"[{x.shape[0]}x{x.shape[1]}], {counts.numel()} experts"
    moved = x.numel() * 3  # one read of x and the fp8 write (the per-column mode's second read is not counted)
    return {
        "per_column": bench.op(f"FP8 wgrad operand per (expert, column) {shape}", bench.impl,
                               lambda: quantize_grouped_colwise(x, counts, impl=bench.impl), moved),
        "per_expert": bench.op(f"FP8 wgrad operand per expert from the rows' amax {shape}", bench.impl,
                               lambda: quantize_grouped_colwise(x, counts, row_amax=row_amax, impl=bench.impl),
                               moved),
    }


def _fp8_mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    an, bn = a.float().isnan(), b.float().isnan()
    if not torch.equal(an, bn):
        return int((an != bn).sum())
    return int(((a.view(torch.uint8) != b.view(torch.uint8)) & ~an).sum())


def _float_mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    an, bn = a.isnan(), b.isnan()
    return int((an != bn).sum()) + int(((a != b) & ~an & ~bn).sum())


def check_fp8(impl: str, shards, scales, stacked) -> dict:
    """The FP8 weight kernels against the torch reference, bit for bit."""
    amax = multi_tensor_amax(shards, impl=impl)
    found = {"amax": _float_mismatches(amax, multi_tensor_amax(shards, impl="torch"))}
    qs, _ = multi_tensor_cast_fp8(shards, scales, impl=impl)
    rqs, _ = multi_tensor_cast_fp8(shards, scales, impl="torch")
    found["cast"] = sum(_fp8_mismatches(a, b) for a, b in zip(qs, rqs))
    for q in qs:  # NaN bytes: what the plan below does not write shows as a mismatch
        q.view(torch.uint8).fill_(0x7F)
    recorded = torch.empty(len(shards), dtype=torch.float32, device=scales.device)
    MultiTensorCastPlan(shards, out=qs, impl=impl).run(scales, amax_out=recorded)
    found["cast_recorded_amax"] = _float_mismatches(recorded, amax)
    found["cast_into_kept_buffers"] = sum(_fp8_mismatches(a, b) for a, b in zip(qs, rqs))
    for name, x, block in (("blockwise_128x128", stacked, (128, 128)),
                           ("blockwise_1x128", stacked.view(-1, stacked.shape[-1]), (1, 128))):
        (q, s), (rq, rs) = quantize_blockwise(x, *block, impl=impl), quantize_blockwise(x, *block, impl="torch")
        found[name] = _fp8_mismatches(q, rq) + _float_mismatches(s, rs)
    return found


def check_activations(impl: str, rowwise: dict, gate_up, x_act, counts, row_amax) -> dict:
    """The activation kernels against the torch reference (SwiGLU to one bf16 ulp)."""
    found = {}
    for name, x in rowwise.items():
        (q, s), (rq, rs) = quantize_rowwise(x, impl=impl), quantize_blockwise_ref(x, 1, x.shape[1])
        found[f"rowwise_{name}"] = _fp8_mismatches(q, rq) + _float_mismatches(s, rs.reshape(-1))
    h, hq, hs = swiglu(gate_up, quantize=True, impl=impl)
    rh = swiglu_ref(gate_up)[0].float()
    # The kernel's exp may differ from torch's in the last float32 bit: one bf16 ulp.
    found["swiglu_beyond_one_ulp"] = int(((h.float() - rh).abs() > rh.abs() * 2 ** -7 + 1e-30).sum())
    hq_ref, hs_ref = quantize_rowwise(h, impl="torch")
    found["swiglu_fp8"] = _fp8_mismatches(hq, hq_ref) + _float_mismatches(hs, 1.0 / hs_ref)
    for mode, amax in (("per_column", None), ("per_expert", row_amax)):
        cq, cs, ends = quantize_grouped_colwise(x_act, counts, row_amax=amax, impl=impl)
        rcq, rcs, _ = quantize_grouped_colwise_ref(x_act, counts, row_amax=amax)
        used = int(ends[-1])  # past the last padded segment the kernel leaves the buffer unwritten
        found[f"wgrad_operand_{mode}"] = _fp8_mismatches(cq[:, :used], rcq[:, :used]) + _float_mismatches(cs, rcs)
    return found


def table(bench: Bench) -> str:
    lines = ["| op | impl | device ms (mean) | host wall ms / call | GB/s (device) | fraction of copy bw |",
             "|---|---|---:|---:|---:|---:|"]
    for name, impl, t in bench.rows:
        gbps = t["bytes_moved"] / (t["device_ms"] * 1e-3) / 1e9 if t["bytes_moved"] else None
        frac = t["fraction_of_copy_bw"]
        lines.append(f"| {name} | {impl} | {t['device_ms']:.4f} | {t['host_wall_ms_per_call']:.4f} | "
                     f"{'–' if gbps is None else f'{gbps:.0f}'} | {'–' if frac is None else f'{frac:.2f}'} |")
    return "\n".join(lines)


def run(args, device: torch.device, impl: str) -> tuple[dict, Bench]:
    bench = Bench(Timer(device, args.iters, args.warmup), impl)
    gen = torch.Generator().manual_seed(0)
    randn = lambda *shape: torch.randn(shape, generator=gen).to(torch.bfloat16).to(device)  # noqa: E731
    stacked = randn(args.num_tensors, *args.shape)
    shards = list(stacked.unbind(0))
    nbytes = stacked.numel() * stacked.element_size()
    tokens, ffn, hidden, experts = (256, 48, 64, 4) if args.dry_run else (EXPERT_TOKENS, EXPERT_FFN,
                                                                           EXPERT_HIDDEN, EXPERTS)
    shapes = [(2, 32003), (8, 515)] if args.dry_run else ROWWISE_SHAPES  # the wide one: the two-pass kernel
    rowwise = {f"{r}x{c}": randn(r, c) for r, c in shapes}
    gate_up, grad_h, x_act = randn(tokens, 2 * ffn), randn(tokens, ffn), randn(tokens, hidden)
    counts = torch.full((experts,), tokens // experts, dtype=torch.int64, device=device)
    row_amax = x_act.abs().amax(dim=1).float()
    scales = amax_to_scale(multi_tensor_amax(shards, impl=impl))
    result = {"copy": measure_copy(bench, nbytes, device), "amax": measure_amax(bench, shards, nbytes),
              "cast": measure_cast(bench, shards, scales), "quantize": measure_quantize(bench, stacked, rowwise),
              "swiglu": measure_swiglu(bench, gate_up, grad_h),
              "wgrad_operands": measure_wgrad_operands(bench, x_act, counts, row_amax)}
    mismatches = {**check_fp8(impl, shards, scales, stacked),
                  **check_activations(impl, rowwise, gate_up, x_act, counts, row_amax)}
    result["correctness"] = {"mismatches": mismatches, "all_exact": not any(mismatches.values())}
    fractions = {"amax": result["amax"]["fused"], "cast": result["cast"]["plain"]["fused"]}
    result["targets"] = {k: {"fraction_of_copy_bw": t["fraction_of_copy_bw"], "target": TARGETS[k],
                             "met": t["fraction_of_copy_bw"] >= TARGETS[k]} for k, t in fractions.items()}
    return result, bench


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("bench_kernels.py needs a CUDA GPU (--dry-run checks the script on CPU)", file=sys.stderr)
        return 2
    if cuda and args.iters < 50:
        print("--iters must be >= 50 on GPU", file=sys.stderr)
        return 2
    # On GPU the fused path is the compiled Triton kernel; in a dry run the interpreter under
    # TRITON_INTERPRET=1, else the torch reference.
    impl = "triton" if cuda or interpreter_active() else "torch"
    result, bench = run(args, torch.device("cuda" if cuda else "cpu"), impl)
    report = {"benchmark": "kernels", "provenance": provenance(), "dry_run": args.dry_run, "fused_impl": impl,
              "config": {"num_tensors": args.num_tensors, "shape": args.shape, "dtype": "bfloat16",
                         "iters": args.iters, "warmup": args.warmup}, **result}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    verdicts = ", ".join(f"{k} {v['fraction_of_copy_bw']:.2f} (target {v['target']})"
                         for k, v in result["targets"].items())
    print(f"{table(bench)}\n\nfraction of copy bandwidth: {verdicts}; correctness: "
          f"{'exact' if result['correctness']['all_exact'] else 'MISMATCH'}\nJSON: {out}")
    return 0 if result["correctness"]["all_exact"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
