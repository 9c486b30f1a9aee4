"""Each ETP transport's gather and reduce-scatter alone and beside a running grouped GEMM.

The number issue #14 is about: how much a collective running on a side stream slows the
grouped GEMM beside it (NCCL's kernels take SMs and HBM bandwidth; copy-engine gathers take
none), and how long the collective takes meanwhile. One fc1-sized weight, ``[E, 2*ffn,
hidden]`` = ``[16, 3072, 4096]`` bf16 (402.7 MB gathered; each rank holds 1/W of its rows),
beside the GEMM ``16 experts x 2048 tokens, 4096 -> 3072`` (``torch._grouped_mm``).

Operations (each through ``etp.transport``, exactly as the runtime calls it):

* ``gather/nccl`` and ``gather/nccl fp8``: ``all_gather_into_tensor`` of the bf16 / FP8
  (uint8 bytes) shard on etp's AG communicator;
* ``gather/copy_engine`` and ``gather/copy_engine fp8``: peer copies out of a symmetric-memory
  pool, between two flag fences (stream memory operations, no kernel);
* ``reduce/nccl fp32`` (fp32 wgrad, divide, add into fp32 ``main_grad``), ``reduce/nccl bf16``
  (bf16 wgrad), ``reduce/copy_engine_push`` (copy-engine pushes fenced by flags, then the fp32
  sum kernel, here on the side stream too: the worst case for the GEMM).

For each: *alone* is the median over ``--iters`` of the operation on its side stream (the
device otherwise idle); *beside* runs ``K`` GEMMs back to back on the compute stream while the
side stream runs the operation ``M`` times, ``M`` chosen (same on every rank) so that the
operations outlast the GEMMs; GEMM slowdown = (GEMM time beside / GEMM time alone) - 1, with
*GEMM time alone* from K GEMMs back to back right before, the median of ``--rounds`` such
pairs (clocks drift over a run); the collective time beside = side-stream time / M. Each row also says whether the operation
launched any kernel that occupies SMs (from a short profile: NCCL kernels, Triton kernels;
the symmetric-memory barrier's one-CTA signal kernel is counted separately).

Run (2 GPUs)::

    torchrun --nproc-per-node=2 tools/diag/bench_overlap.py --out $OUT/bench_overlap.json

CPU check of the script itself (gloo, tiny shapes; symmetric transports are skipped)::

    torchrun --nproc-per-node=2 tools/diag/bench_overlap.py --cpu-smoke --out /tmp/overlap.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: bench_provenance

from bench_provenance import provenance  # noqa: E402 - puts this checkout's etp first on the path

import etp  # noqa: E402
from etp.gemm import GroupedGemm  # noqa: E402
from etp.layout import ShardLayout  # noqa: E402
from etp.transport.nccl import NCCLGather, NCCLReduce  # noqa: E402

FP8 = torch.float8_e4m3fn


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--tokens-per-expert", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--out-features", type=int, default=3072, help="fc1 rows per expert (2*ffn)")
    p.add_argument("--gemms", type=int, default=20, help="K: GEMMs per beside measurement")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=5,
                   help="(GEMMs alone, GEMMs beside) pairs per operation; the median pair is reported")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--only", type=str, default=None, help="comma-separated substrings of operation names")
    p.add_argument("--out", type=str, default=None)
    p.add_argument("--md", type=str, default=None, help="append the markdown table to this file")
    p.add_argument("--cpu-smoke", action="store_true")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.experts, args.tokens_per_expert, args.hidden, args.out_features = 2, 8, 32, 16
        args.gemms, args.iters, args.warmup, args.rounds = 2, 2, 1, 1
    return args


def init():
    cuda = torch.cuda.is_available() and "--cpu-smoke" not in sys.argv
    backend = "nccl" if cuda else "gloo"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group(backend, device_id=device, timeout=datetime.timedelta(minutes=5))
    else:
        device = torch.device("cpu")
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=5))
    return device



def median_call_ms(fn, iters: int, before=None) -> float:
    """Median device ms of one call of ``fn`` over ``iters`` calls, each between its own event
    pair after a synchronize (and after ``before()``, e.g. a barrier that lines the ranks up)."""
    times = []
    for _ in range(iters):
        if before is not None:
            before()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def back_to_back_ms(fn, k: int) -> float:
    """Device ms per call of ``fn`` over ``k`` calls back to back (one event pair around the
    loop; the caller synchronizes before)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(k):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / k


class Timer:
    """Side-stream timing with CUDA events (host clock on CPU)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.side = torch.cuda.Stream(device, priority=-1) if self.cuda else None

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()
        dist.barrier()

    def alone(self, op, iters) -> float:
        """Median ms of ``op`` on the side stream."""
        if self.cuda:
            with torch.cuda.stream(self.side):
                return median_call_ms(op, iters, before=self.sync)
        times = []
        for _ in range(iters):
            self.sync()
            start = time.perf_counter()
            op()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    def gemms_alone(self, gemm, k) -> float:
        """ms per GEMM of ``k`` GEMMs back to back on the compute stream, nothing beside: the
        same launch pattern as ``beside`` (one GEMM per synchronize, as ``alone`` times an
        operation, would include the GPU's ramp-up after each idle gap)."""
        self.sync()
        return back_to_back_ms(gemm, k)

    def beside(self, gemm, k, op, m) -> tuple[float, float]:
        """(ms per GEMM, ms per op) with k GEMMs on the compute stream and m ops beside."""
        self.sync()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        self.side.wait_stream(torch.cuda.current_stream())
        ev[0].record()
        for _ in range(k):
            gemm()
        ev[1].record()
        with torch.cuda.stream(self.side):
            ev[2].record()
            for _ in range(m):
                op()
            ev[3].record()
        torch.cuda.synchronize()
        return ev[0].elapsed_time(ev[1]) / k, ev[2].elapsed_time(ev[3]) / m


def sm_kernels(op, device) -> dict:
    """Kernel / memcpy names one call of ``op`` launched (a short CUDA profile)."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        op()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    memcpy = [n for n in names if "memcpy" in n.lower()]
    barrier = [n for n in names if "barrier" in n.lower() or "signal" in n.lower()]
    kernels = [n for n in names if n not in memcpy and n not in barrier and "memset" not in n.lower()]
    return {"sm_kernels": sorted(set(kernels)), "memcpy": len(memcpy), "barrier_kernels": len(barrier)}


def build_ops(args, device, group):
    """name -> (callable, bytes moved into this rank, transport info)."""
    world = group.size
    layout = ShardLayout((args.experts, args.out_features, args.hidden), world, group.rank, 16)
    shard_shape, full_shape = layout.shard_shape, layout.padded_shape
    gen = torch.Generator(device="cpu").manual_seed(group.rank)
    ops = {}
    full_bf16 = torch.empty(full_shape, dtype=torch.bfloat16, device=device)
    full_fp8 = torch.empty(full_shape, dtype=FP8, device=device)

    def nbytes(shape, dtype):
        return math.prod(shape) * torch.empty((), dtype=dtype).element_size()

    received = lambda dtype: nbytes(full_shape, dtype) * (world - 1) // world  # noqa: E731
    shard_bf16 = torch.randn(shard_shape, generator=gen).to(device, torch.bfloat16)
    shard_fp8 = shard_bf16.to(FP8)
    nccl = NCCLGather()
    ops["gather/nccl"] = (lambda: nccl.gather(shard_bf16, group, full_bf16, False).wait(),
                          received(torch.bfloat16))
    ops["gather/nccl fp8"] = (lambda: nccl.gather(shard_fp8, group, full_fp8, False).wait(), received(FP8))
    if device.type == "cuda":
        from etp.transport.copy_engine import CopyEngineGather

        ce = CopyEngineGather(group.ag_group, device)
        owners = {d: SimpleNamespace(etp_layout=layout) for d in (torch.bfloat16, FP8)}
        for dtype, owner in owners.items():
            ce.register(owner, dtype)
        ce.materialize()
        home_bf16, home_fp8 = ce.home(owners[torch.bfloat16]), ce.home(owners[FP8])
        home_bf16.copy_(shard_bf16)
        home_fp8.copy_(shard_fp8)
        ops["gather/copy_engine"] = (lambda: ce.gather(home_bf16, group, full_bf16, False).wait(),
                                     received(torch.bfloat16))
        ops["gather/copy_engine fp8"] = (lambda: ce.gather(home_fp8, group, full_fp8, False).wait(), received(FP8))

    wgrad32 = torch.randn(full_shape, generator=gen).to(device)
    wgrad16 = wgrad32.to(torch.bfloat16)
    main_grad = torch.zeros(shard_shape, dtype=torch.float32, device=device)
    reduce = NCCLReduce()
    ops["reduce/nccl fp32"] = (lambda: reduce.reduce_scatter(wgrad32, group, main_grad, True, False).wait(),
                               received(torch.float32))
    ops["reduce/nccl bf16"] = (lambda: reduce.reduce_scatter(wgrad16, group, None, True, False).wait(),
                               received(torch.bfloat16))
    if device.type == "cuda":
        from etp.transport.push_reduce import CopyEnginePushReduce

        push = CopyEnginePushReduce(group.rs_group, device)
        push.reserve(SimpleNamespace(etp_layout=layout), torch.bfloat16)
        push.materialize()
        # Pushes and flags on the side stream, then (as ``wait``) the fp32 sum on the same side
        # stream: the worst case for the GEMM; in training the sum runs between GEMMs.
        ops["reduce/copy_engine_push (sum beside too)"] = (
            lambda: push.reduce_scatter(wgrad16, group, main_grad, True, False).wait(), received(torch.bfloat16))

    return ops


def gemm_op(args, device):
    tokens = args.experts * args.tokens_per_expert
    x = torch.randn(tokens, args.hidden, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    w = torch.randn(args.experts, args.out_features, args.hidden, device=device, dtype=x.dtype)
    counts = torch.full((args.experts,), args.tokens_per_expert, dtype=torch.int64)
    return lambda: GroupedGemm.forward(x, w, counts), 2 * tokens * args.hidden * args.out_features


def main(argv):
    args = parse_args(argv)
    device = init()
    config = etp.ETPConfig(etp_size=dist.get_world_size(), expert_etp_size=dist.get_world_size())
    group = etp.build_etp_groups(config).dense
    timer = Timer(device)
    gemm, gemm_flop = gemm_op(args, device)
    for _ in range(args.warmup):
        gemm()
    gemm_alone = timer.alone(gemm, args.iters)
    ops = build_ops(args, device, group)
    if args.only:
        keys = [k.strip() for k in args.only.split(",")]
        ops = {n: v for n, v in ops.items() if any(k in n for k in keys)}
    rows = []
    for name, (op, received) in ops.items():
        row = {"op": name, "bytes_received": received}
        try:
            for _ in range(args.warmup):
                op()
            row["alone_ms"] = timer.alone(op, args.iters)
            row["alone_GBps"] = received / (row["alone_ms"] * 1e-3) / 1e9
            if device.type == "cuda":
                # Rounds of (K GEMMs alone, K GEMMs beside the op), back to back, and the median
                # of each round's ratio: clocks drift over a run (a single GEMM-alone figure
                # moved by a third within one run), and a pair taken moments apart shares the clock.
                pairs = []
                for _ in range(args.rounds):
                    paired_alone = timer.gemms_alone(gemm, args.gemms)
                    times = torch.tensor([row["alone_ms"], paired_alone], device=device)
                    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # every rank runs the same M
                    m = max(1, math.ceil(1.2 * args.gemms * times[1].item() / times[0].item()))
                    gemm_ms, op_ms = timer.beside(gemm, args.gemms, op, m)
                    pairs.append((gemm_ms / paired_alone, paired_alone, gemm_ms, op_ms, m))
                ratio, paired_alone, gemm_ms, op_ms, m = sorted(pairs)[len(pairs) // 2]
                row.update(gemm_alone_ms=paired_alone, beside_gemm_ms=gemm_ms, beside_op_ms=op_ms, ops_beside=m,
                           gemm_slowdown_pct=100 * (ratio - 1),
                           gemm_slowdown_pct_rounds=[round(100 * (r[0] - 1), 2) for r in pairs])
                try:
                    row.update(sm_kernels(op, device))
                except Exception as exc:  # noqa: BLE001 - the timings above still count
                    row["sm_kernels_error"] = repr(exc)[:200]
            row["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 - one failing transport must not end the run
            row["status"] = f"failed: {type(exc).__name__}: {exc}"[:300]
        rows.append(row)
    result = {
        "provenance": provenance(),
        "world": dist.get_world_size(), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
        "weight": [args.experts, args.out_features, args.hidden],
        "gemm_alone_ms": gemm_alone, "gemm_tflops": gemm_flop / (gemm_alone * 1e-3) / 1e12,
        "ops": rows,
    }
    if dist.get_rank() == 0:
        md = table(result)
        print(md)
        out = args.out or os.path.join(os.environ.get("OUT", "."), "bench_overlap.json")
        Path(out).write_text(json.dumps(result, indent=2))
        if args.md:
            with open(args.md, "a", encoding="utf-8") as f:
                f.write(md + "\n")
        print(f"JSON: {out}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def table(result) -> str:
    lines = [
        f"## bench_overlap ({result['device']}, world {result['world']}, torch {result['torch']}, "
        f"NCCL {result['nccl']})",
        "",
        f"`{result['provenance']['command']}`",
        "",
        f"Weight {result['weight']} bf16; grouped GEMM alone {result['gemm_alone_ms'] * 1e3:.0f} µs "
        f"({result['gemm_tflops']:.0f} TFLOP/s).",
        "",
        "| operation | MB in | alone ms | GB/s | beside: op ms | GEMM µs alone / beside | GEMM slowdown % | SM kernels |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in result["ops"]:
        if r["status"] != "ok":
            lines.append(f"| {r['op']} | {r['status']} | | | | | | |")
            continue
        beside = r.get("beside_op_ms")
        lines.append(
            f"| {r['op']} | {r['bytes_received'] / 1e6:.1f} | {r['alone_ms']:.3f} | {r['alone_GBps']:.0f} | "
            + (f"{beside:.3f} | {r['gemm_alone_ms'] * 1e3:.0f} / {r['beside_gemm_ms'] * 1e3:.0f} | "
               f"{r['gemm_slowdown_pct']:+.1f} | "
               if beside is not None else "– | – | – | ")
            + (", ".join(k[:40] for k in r.get("sm_kernels", [])) or "none") + " |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
