#!/usr/bin/env python
"""Benchmark the "expert stack" reference workload: replicated vs DDP vs FSDP2 vs ETP.

Workload (DESIGN.md, "Performance targets"): ``--layers`` residual blocks
``x = x + experts(x, tokens_per_expert)`` of ``etp.GroupedSwiGLUExperts`` with ``--experts``
experts per rank, ``--tokens-per-expert`` tokens each (evenly split, already sorted by
expert), hidden ``--hidden``, ffn ``--ffn``, bf16 weights and activations. Each rank draws
its own tokens (data parallel); every rank holds the same full weights before sharding.
Defaults: 8 layers, 16 experts, 2048 tokens per expert (T = 32768 tokens per rank), hidden
4096, ffn 1536: 604 MB of bf16 weights per layer, 4.8 GB in all.

FLOPs per step per GPU = layers * 18 * T * hidden * ffn (forward 6·T·H·I: fc1 2·T·H·2I plus
fc2 2·T·I·H; backward twice that). The input requires grad, so every layer computes its
input gradient and the count is exact.

Variants, side by side in one process group, in this order (each freed before the next):

* ``replicated``: full weights, no communication (the compute ceiling);
* ``ddp``: torch DistributedDataParallel over the world, default buckets, bf16 all-reduce;
* ``fsdp2``: ``fully_shard`` on every layer, then on the root (bf16 gathers);
* ``etp_sync``: ETP over the world, ``prefetch=False, async_reduce=False``;
* ``etp_async``: ETP over the world, ``prefetch=True, async_reduce=True``.

Every variant runs the same grouped-GEMM kernels (``torch._grouped_mm`` for bf16 on sm90,
as etp's sharded path does), so differences are communication and scheduling.
A step is forward + backward (+ ``etp.finalize_grads`` for ETP), timed with CUDA events;
gradients are set to None between steps and no optimizer runs. Reported per variant: median
step ms on rank 0 and the max over ranks of the per-rank medians, TFLOP/s per GPU, % of
``replicated`` throughput, exposed communication (step ms minus replicated step ms), peak
allocated memory (reset before warm-up), parameter bytes per rank and bytes received per
rank per step on the wire (analytic, see ``wire_bytes``).

``--trace DIR`` records one torch.profiler trace of 3 ``etp_async`` steps on rank 0
(``DIR/etp_async_trace.json``) and, from its device timeline, how much NCCL kernel time
overlaps GEMM kernels.

Output: JSON to ``--out`` (default ``$OUT/bench_expert_stack.json``), a markdown table on
rank 0's stdout, and a section appended to ``--benchmarks-md PATH`` when given.

The 8×H200 run::

    torchrun --nproc-per-node=8 tools/bench_expert_stack.py --trace $OUT/trace \\
        --out $OUT/bench_expert_stack.json --benchmarks-md BENCHMARKS.md

CPU check of the script itself (gloo, float32, tiny shapes, host timers)::

    torchrun --nproc-per-node=2 tools/bench_expert_stack.py --cpu-smoke --out /tmp/bench_smoke.json
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

# Runnable as `torchrun tools/bench_expert_stack.py` from a checkout without installing etp.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import etp  # noqa: E402

VARIANTS = ("replicated", "ddp", "fsdp2", "etp_sync", "etp_async")
GPU_DEFAULTS = dict(layers=8, experts=16, tokens_per_expert=2048, hidden=4096, ffn=1536, warmup=5, steps=20)
SMOKE_DEFAULTS = dict(layers=2, experts=4, tokens_per_expert=8, hidden=32, ffn=16, warmup=2, steps=2)
# Measured separately on 2026-11-21 (shared/anchors.md), same workload and machine kind.
ANCHOR_MS = {"replicated": 56.9, "fsdp2": 79.7}
PROFILE_STEPS = 3
NCCL_MARKERS = ("nccl",)
GEMM_MARKERS = ("gemm", "cutlass", "sm90", "nvjet", "groupedmm", "grouped")
GIB = 1024**3


# ----------------------------------------------------------------------------- arguments
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=None, help="residual expert blocks (8)")
    p.add_argument("--experts", type=int, default=None, help="experts per rank (16)")
    p.add_argument("--tokens-per-expert", type=int, default=None, help="tokens per expert (2048)")
    p.add_argument("--hidden", type=int, default=None, help="model width (4096)")
    p.add_argument("--ffn", type=int, default=None, help="expert ffn width (1536)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per variant (5)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant (20)")
    p.add_argument("--variants", type=str, default=",".join(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)} (run in that order)")
    p.add_argument("--trace", type=str, default=None, help="directory for the etp_async profiler trace")
    p.add_argument("--out", type=str, default=None, help="JSON path (default $OUT/bench_expert_stack.json)")
    p.add_argument("--benchmarks-md", type=str, default=None, help="append a result section to this file")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="gloo on CPU, float32, tiny shapes: checks the script, measures nothing")
    args = p.parse_args(argv)
    defaults = SMOKE_DEFAULTS if args.cpu_smoke else GPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
        lowest = 0 if key == "warmup" else 1  # warm-up may be skipped; nothing else may be 0
        if getattr(args, key) < lowest:
            p.error(f"--{key.replace('_', '-')}={getattr(args, key)}: expected an integer >= {lowest}")
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown or not names:
        p.error(f"--variants={args.variants!r}: choose from {','.join(VARIANTS)}")
    args.variants = [v for v in VARIANTS if v in names]  # the fixed order keeps runs comparable
    return args


# ----------------------------------------------------------------------------- process group
@dataclass(frozen=True)
class Env:
    rank: int
    world: int
    device: torch.device
    dtype: torch.dtype

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def _default_single_process_env() -> None:
    # Allows `python tools/bench_expert_stack.py --cpu-smoke` without torchrun (world of 1).
    if "RANK" in os.environ:
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")


def init_distributed(cpu_smoke: bool) -> Env:
    _default_single_process_env()
    if cpu_smoke:
        torch.set_num_threads(1)  # ranks share few cores; oversubscription only adds noise
        dist.init_process_group("gloo")
        return Env(dist.get_rank(), dist.get_world_size(), torch.device("cpu"), torch.float32)
    if not torch.cuda.is_available():
        raise SystemExit("bench_expert_stack: no CUDA device; use --cpu-smoke to check the script on CPU")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return Env(dist.get_rank(), dist.get_world_size(), device, torch.bfloat16)


# ----------------------------------------------------------------------------- model
def _grouped_mm_ok(x: torch.Tensor) -> bool:
    # torch._grouped_mm's supported case (bf16 on sm90+), the rule etp.gemm follows too.
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device)[0] >= 9)


class _GroupedLinear(torch.autograd.Function):
    """``y_e = x_e @ w_e.T`` for a plain stacked weight ``[E, out, in]``.

    On GPU the forward, input-gradient and weight-gradient GEMMs are the three
    ``torch._grouped_mm`` calls etp's grouped GEMM makes; elsewhere a per-expert loop.
    Written out here (not imported from ``etp.gemm``) so the baselines do not move with
    etp's internal GEMM interface.
    """

    @staticmethod
    def forward(ctx, x, weight, counts):
        ctx.save_for_backward(x, weight, counts)
        if _grouped_mm_ok(x):
            return torch._grouped_mm(x, weight.transpose(-2, -1), offs=_offsets(counts))
        return torch.cat([xe.mm(weight[e].t()) for e, xe in enumerate(_split(x, counts))])

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, counts = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        grad_x = grad_w = None
        if _grouped_mm_ok(grad_y):
            offs = _offsets(counts)
            if ctx.needs_input_grad[0]:
                grad_x = torch._grouped_mm(grad_y, weight, offs=offs)
            if ctx.needs_input_grad[1]:
                grad_w = torch._grouped_mm(grad_y.t(), x, offs=offs)
            return grad_x, grad_w, None
        gys = _split(grad_y, counts)
        if ctx.needs_input_grad[0]:
            grad_x = torch.cat([g.mm(weight[e]) for e, g in enumerate(gys)])
        if ctx.needs_input_grad[1]:
            grad_w = torch.stack([g.t().mm(xe) for g, xe in zip(gys, _split(x, counts))])
        return grad_x, grad_w, None


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(counts, 0, dtype=torch.int32)


def _split(x: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.split(x, counts.tolist())


class BenchExperts(etp.GroupedSwiGLUExperts):
    """``GroupedSwiGLUExperts`` whose *unsharded* weights also run grouped GEMMs.

    etp computes a plain (unwrapped) weight with a per-expert ``torch.mm`` loop, its exact
    CPU reference, while ETP shards run ``torch._grouped_mm`` on GPU. The baselines must run
    the same kernels as ETP, or the comparison would measure the GEMM choice instead of
    communication. Sharded weights take etp's own forward unchanged.
    """

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if isinstance(self.fc1_weight, etp.ETPShardedParam):
            return super().forward(x, tokens_per_expert)
        gate_up = _GroupedLinear.apply(x, self.fc1_weight, tokens_per_expert)
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = torch.nn.functional.silu(gate) * up
        return _GroupedLinear.apply(hidden, self.fc2_weight, tokens_per_expert)


class ExpertStack(nn.Module):
    """``layers`` residual expert blocks; the residual lets gradients reach every layer."""

    def __init__(self, args: argparse.Namespace, env: Env) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            BenchExperts(args.experts, args.hidden, args.ffn, dtype=env.dtype, device=env.device)
            for _ in range(args.layers)
        )

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x, tokens_per_expert)
        return x


def build_model(args: argparse.Namespace, env: Env) -> ExpertStack:
    # Same seed on every rank: ETP and FSDP2 shard one full weight, so all ranks must agree.
    torch.manual_seed(1234)
    return ExpertStack(args, env)


@dataclass
class Workload:
    x: torch.Tensor       # [T, hidden], sorted by expert, requires grad
    counts: torch.Tensor  # [experts] tokens per expert, on the compute device
    grad_out: torch.Tensor
    flops: float          # per step per GPU


def make_workload(args: argparse.Namespace, env: Env) -> Workload:
    tokens = args.experts * args.tokens_per_expert
    gen = torch.Generator(device=env.device).manual_seed(1000 + env.rank)  # own data per rank
    # Scaled so that 8 residual SwiGLU blocks (quadratic in their input) stay O(1): the first
    # run with unit inputs grew activations to ~1e25 (harmless for timing, useless as a check).
    x = 0.1 * torch.randn(tokens, args.hidden, generator=gen, device=env.device, dtype=env.dtype)
    grad_out = torch.randn(tokens, args.hidden, generator=gen, device=env.device, dtype=env.dtype)
    counts = torch.full((args.experts,), args.tokens_per_expert, dtype=torch.int64, device=env.device)
    flops = float(args.layers) * 18 * tokens * args.hidden * args.ffn
    return Workload(x.requires_grad_(True), counts, grad_out, flops)


# ----------------------------------------------------------------------------- variants
@dataclass
class Prepared:
    """A variant ready to step: what to call, what completes its gradients, its bytes."""

    module: nn.Module                 # called as module(x, counts)
    model: ExpertStack                # the underlying model (parameters, runtime stats)
    finalize: Callable[[], None]      # after backward, inside the timed region
    param_bytes: int                  # parameter bytes held by this rank
    wire_bytes: int                   # bytes received per rank per step (analytic)
    grads: str                        # after a step: "local" (this rank's own), "mean" (the
                                      # full mean gradient on every rank) or "sharded" (a shard
                                      # of the mean gradient)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def wire_bytes(kind: str, world: int, full_bytes: int) -> int:
    """Bytes each rank receives per step for ``full_bytes`` of full (padded) weights.

    Sharded (ETP, FSDP2): two all-gathers (forward, backward) and one reduce-scatter of the
    gradients, each bringing (W-1)/W of every full weight to every rank. DDP: a ring
    all-reduce of the gradients, 2·(W-1)/W of their bytes. Replicated: nothing.
    """
    if kind == "sharded":
        return 3 * (world - 1) * full_bytes // world
    if kind == "allreduce":
        return 2 * (world - 1) * full_bytes // world
    return 0


def prepare_replicated(args, env, _groups) -> Prepared:
    model = build_model(args, env)
    return Prepared(model, model, lambda: None, _bytes(model.parameters()), 0, "local")


def prepare_ddp(args, env, _groups) -> Prepared:
    from torch.nn.parallel import DistributedDataParallel

    model = build_model(args, env)
    ddp = DistributedDataParallel(model, device_ids=[env.device] if env.cuda else None)
    full = _bytes(model.parameters())
    return Prepared(ddp, model, lambda: None, full, wire_bytes("allreduce", env.world, full), "mean")


def prepare_fsdp2(args, env, _groups) -> Prepared:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build_model(args, env)
    mesh = init_device_mesh(env.device.type, (env.world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    local = _bytes(p.to_local() for p in model.parameters())  # DTensor shards, padding included
    wire = wire_bytes("sharded", env.world, local * env.world)
    return Prepared(model, model, lambda: None, local, wire, "sharded")


def _prepare_etp(args, env, groups_cache: dict, prefetch: bool) -> Prepared:
    cfg = etp.ETPConfig(etp_size=env.world, expert_etp_size=env.world,
                        prefetch=prefetch, async_reduce=prefetch)
    # Groups depend only on the sizes: sharing them keeps both ETP variants on the same
    # communicators instead of paying NCCL setup (and its buffers) twice.
    if "etp" not in groups_cache:
        groups_cache["etp"] = etp.build_etp_groups(cfg)
    groups = groups_cache["etp"]
    model = build_model(args, env)
    summary = etp.wrap_module_params_etp(model, cfg, groups)
    shard_bytes = _bytes(p for p in model.parameters() if isinstance(p, etp.ETPShardedParam))
    return Prepared(
        model, model,
        lambda: etp.finalize_grads(model, cfg, groups, replicate=False),
        summary.bytes_after,
        wire_bytes("sharded", env.world, shard_bytes * env.world),
        "sharded",
    )


def prepare_etp_sync(args, env, groups_cache) -> Prepared:
    return _prepare_etp(args, env, groups_cache, prefetch=False)


def prepare_etp_async(args, env, groups_cache) -> Prepared:
    return _prepare_etp(args, env, groups_cache, prefetch=True)


PREPARE = {
    "replicated": prepare_replicated,
    "ddp": prepare_ddp,
    "fsdp2": prepare_fsdp2,
    "etp_sync": prepare_etp_sync,
    "etp_async": prepare_etp_async,
}


# ----------------------------------------------------------------------------- timing
def run_step(prep: Prepared, work: Workload) -> None:
    out = prep.module(work.x, work.counts)
    out.backward(work.grad_out)
    prep.finalize()


def zero_grads(prep: Prepared, work: Workload) -> None:
    prep.module.zero_grad(set_to_none=True)
    work.x.grad = None


def timed_step(prep: Prepared, work: Workload, env: Env) -> float:
    """Milliseconds of one step: CUDA events on GPU (the device is idle at the start, since
    the previous step ended in a synchronize), the host clock on CPU."""
    zero_grads(prep, work)
    if not env.cuda:
        start = time.perf_counter()
        run_step(prep, work)
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run_step(prep, work)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def reset_memory(env: Env) -> None:
    gc.collect()
    if env.cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def memory_figures(env: Env) -> dict:
    if not env.cuda:
        return {"peak_allocated_gib": None, "peak_reserved_gib": None}
    return {
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
    }


def runtime_stats(model: nn.Module):
    """Cache / pool bytes and counters of etp's engine, when this etp version exposes them
    (``etp.runtime_stats(model)``, else ``etp.runtime_of(model)``); None when it does not."""
    try:
        stats_fn = getattr(etp, "runtime_stats", None)
        if stats_fn is not None:
            return json.loads(json.dumps(stats_fn(model), default=str))
        runtime_of = getattr(etp, "runtime_of", None)
        if runtime_of is None:
            return None
        runtime = runtime_of(model)
        stats, nbytes = getattr(runtime, "stats", None), getattr(runtime, "nbytes", None)
        found = {
            "stats": dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else stats,
            "nbytes": nbytes() if callable(nbytes) else nbytes,
        }
        return json.loads(json.dumps(found, default=str))
    except Exception as exc:  # noqa: BLE001 - statistics must never sink the benchmark
        return f"unavailable: {exc!r}"


def measure(name: str, args, env: Env, work: Workload, groups_cache: dict) -> dict:
    prep = PREPARE[name](args, env, groups_cache)
    reset_memory(env)
    dist.barrier()  # start together, so one rank's setup does not show as another's comm
    for _ in range(args.warmup):
        timed_step(prep, work, env)
    times = [timed_step(prep, work, env) for _ in range(args.steps)]
    result = {
        "status": "ok",
        "step_ms": statistics.median(times),
        "step_ms_all": times,
        **memory_figures(env),
        "param_bytes_per_rank": prep.param_bytes,
        "wire_bytes_per_step_per_rank": prep.wire_bytes,
        "runtime_stats": runtime_stats(prep.model) if name.startswith("etp") else None,
    }
    medians = [None] * env.world
    dist.all_gather_object(medians, result["step_ms"])
    result["step_ms_per_rank"] = medians
    result["step_ms_max_over_ranks"] = max(medians)
    result["check"] = check_step(prep, work, env)
    if name == "etp_async" and args.trace:
        result["profile"] = profile_steps(prep, work, env, args.trace)
    zero_grads(prep, work)
    del prep
    reset_memory(env)
    return result


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor  # FSDP2 DTensor


def check_step(prep: Prepared, work: Workload, env: Env) -> dict:
    """One untimed step whose output sum (over ranks) and mean-gradient norm must agree
    across variants up to rounding: a variant that is fast because it is wrong shows here."""
    zero_grads(prep, work)
    out = prep.module(work.x, work.counts)
    out_sum = out.detach().double().sum()
    out.backward(work.grad_out)
    prep.finalize()
    del out
    sq = torch.zeros((), dtype=torch.float64, device=env.device)
    for param in prep.model.parameters():
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        if grad is None:
            continue
        grad = _local(grad).double()
        if prep.grads == "local":  # make it the mean gradient the other variants hold
            dist.all_reduce(grad)
            grad /= env.world
        sq += grad.square().sum()
    if prep.grads == "sharded":
        dist.all_reduce(sq)
    dist.all_reduce(out_sum)
    zero_grads(prep, work)
    return {"output_sum": out_sum.item(), "grad_norm": sq.sqrt().item()}


# ----------------------------------------------------------------------------- profiler
def profile_steps(prep: Prepared, work: Workload, env: Env, trace_dir: str) -> dict | None:
    """Runs PROFILE_STEPS steps on every rank (they are collectives), recording rank 0 only."""
    from torch.profiler import ProfilerActivity, profile

    if env.rank != 0:
        for _ in range(PROFILE_STEPS):
            timed_step(prep, work, env)
        return None
    os.makedirs(trace_dir, exist_ok=True)
    path = os.path.join(trace_dir, "etp_async_trace.json")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.cuda else [])
    # CPU activity adds the etp:: labels that make the trace readable; no stacks or shapes,
    # which would multiply the file size.
    with profile(activities=activities) as prof:
        for _ in range(PROFILE_STEPS):
            timed_step(prep, work, env)
    prof.export_chrome_trace(path)
    return {"trace": path, "trace_bytes": os.path.getsize(path), "steps": PROFILE_STEPS,
            **kernel_overlap(path, PROFILE_STEPS)}


def classify(kernel_name: str) -> str:
    lowered = kernel_name.lower()
    if any(m in lowered for m in NCCL_MARKERS):
        return "nccl"
    if any(m in lowered for m in GEMM_MARKERS):
        return "gemm"
    return "other"


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of intervals, as sorted disjoint intervals."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length where two unions of disjoint sorted intervals overlap (two pointers)."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def kernel_overlap(trace_path: str, steps: int) -> dict:
    """NCCL kernel time and the part of it overlapped by GEMM kernels, from the device
    timeline of a chrome trace (µs); unions avoid double counting concurrent kernels (an
    all-gather and a reduce-scatter on two streams)."""
    with open(trace_path, encoding="utf-8") as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [e for e in events if e.get("ph") == "X" and str(e.get("cat", "")).lower() == "kernel"]
    spans: dict[str, list[tuple[float, float]]] = {"nccl": [], "gemm": [], "other": []}
    totals: dict[str, list] = {}
    for e in kernels:
        start, dur = float(e["ts"]), float(e.get("dur", 0.0))
        spans[classify(e["name"])].append((start, start + dur))
        entry = totals.setdefault(e["name"], [0.0, 0])
        entry[0] += dur
        entry[1] += 1
    nccl, gemm = merge(spans["nccl"]), merge(spans["gemm"])
    nccl_ms, overlap_ms = length(nccl) / 1e3, intersection(nccl, gemm) / 1e3
    top = sorted(totals.items(), key=lambda kv: -kv[1][0])[:10]
    return {
        "kernels": len(kernels),
        "nccl_kernel_ms_per_step": nccl_ms / steps,
        "nccl_kernel_sum_ms_per_step": length(spans["nccl"]) / 1e3 / steps,
        "gemm_kernel_ms_per_step": length(gemm) / 1e3 / steps,
        "nccl_overlapped_by_gemm_ms_per_step": overlap_ms / steps,
        "nccl_overlap_fraction": overlap_ms / nccl_ms if nccl_ms else None,
        "top_kernels": [
            {"name": name[:300], "class": classify(name), "total_ms": t / 1e3, "count": n}
            for name, (t, n) in top
        ],
    }


# ----------------------------------------------------------------------------- reporting
def add_derived(results: dict, flops: float) -> None:
    """TFLOP/s, fraction of replicated throughput and exposed communication per variant."""
    base = results.get("replicated", {}).get("step_ms")
    for r in results.values():
        if r.get("status") != "ok":
            continue
        r["tflops_per_gpu"] = flops / (r["step_ms"] * 1e-3) / 1e12
        r["fraction_of_replicated"] = base / r["step_ms"] if base else None
        r["exposed_comm_ms"] = r["step_ms"] - base if base else None


def environment(env: Env) -> dict:
    info = {
        "torch": torch.__version__,
        "etp": getattr(etp, "__version__", None),
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "backend": dist.get_backend(),
        "world_size": env.world,
        "dtype": str(env.dtype),
        "git_commit": _git_commit(),
    }
    if env.cuda:
        info.update(
            cuda=torch.version.cuda,
            nccl=_version_string(torch.cuda.nccl.version()),
            gpu=torch.cuda.get_device_name(env.device),
            gpu_capability=".".join(map(str, torch.cuda.get_device_capability(env.device))),
            gpu_memory_gib=torch.cuda.get_device_properties(env.device).total_memory / GIB,
        )
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def _version_string(version) -> str:
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parents[1]
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        return f"{head}{'+dirty' if dirty else ''}" if head else None
    except (OSError, subprocess.SubprocessError):
        return None


def command_line() -> str:
    nnodes = int(os.environ.get("GROUP_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))) // max(
        1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    launcher = f"torchrun --nproc-per-node={os.environ.get('LOCAL_WORLD_SIZE', '1')}"
    if nnodes > 1:
        launcher += f" --nnodes={nnodes}"
    return f"{launcher} {' '.join(sys.argv)}"


def _fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def markdown_table(results: dict) -> str:
    lines = [
        "| variant | step ms | TFLOP/s/GPU | % of replicated | exposed comm ms | peak GiB | wire GB/step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        if r.get("status") != "ok":
            status = r["status"].replace("|", "/")[:120]  # a "|" would split the row
            lines.append(f"| {name} | {status} | | | | | |")
            continue
        frac = r["fraction_of_replicated"]
        lines.append(
            f"| {name} | {r['step_ms']:.2f} (max {r['step_ms_max_over_ranks']:.2f}) "
            f"| {r['tflops_per_gpu']:.1f} | {_fmt(None if frac is None else 100 * frac, '.1f')} "
            f"| {_fmt(r['exposed_comm_ms'], '.2f')} | {_fmt(r['peak_allocated_gib'], '.2f')} "
            f"| {r['wire_bytes_per_step_per_rank'] / 1e9:.3f} |"
        )
    return "\n".join(lines)


def overlap_line(results: dict) -> str | None:
    prof = results.get("etp_async", {}).get("profile")
    if not prof:
        return None
    frac = prof["nccl_overlap_fraction"]
    return (
        f"etp_async profile ({prof['steps']} steps, rank 0): NCCL kernels "
        f"{prof['nccl_kernel_ms_per_step']:.2f} ms/step, of which "
        f"{prof['nccl_overlapped_by_gemm_ms_per_step']:.2f} ms overlap GEMM kernels "
        f"({_fmt(None if frac is None else 100 * frac, '.0f')}%)."
    )


def checks_line(results: dict) -> str:
    parts = [
        f"{name} {r['check']['output_sum']:.6g} / {r['check']['grad_norm']:.6g}"
        for name, r in results.items() if r.get("status") == "ok"
    ]
    return "checks (output sum over ranks / mean-gradient norm; should agree): " + ", ".join(parts)


def append_benchmarks_md(path: str, report: dict, table: str) -> None:
    info = report["environment"]
    device = info.get("gpu", "CPU") + f" × {info['world_size']}"
    smoke = " (CPU smoke run: checks the script, not a measurement)" if report["config"]["cpu_smoke"] else ""
    parts = [
        f"\n## Expert stack fwd+bwd: replicated / DDP / FSDP2 / ETP — {report['date']}{smoke}\n",
        f"{device}; torch {info['torch']}, NCCL {info.get('nccl', '–')}, etp {info['etp']}, "
        f"commit {info['git_commit']}.\n",
        f"```\n{report['command']}\n```\n",
        table + "\n",
        "step ms: median of rank 0 (max over ranks of the per-rank medians in parentheses); "
        "exposed comm = step ms − replicated step ms; wire = bytes received per rank per step "
        "(analytic). Anchors from ../shared/anchors.md were measured separately on 2026-11-21: "
        f"replicated {ANCHOR_MS['replicated']} ms, FSDP2 {ANCHOR_MS['fsdp2']} ms.\n",
    ]
    line = overlap_line(report["results"])
    if line:
        parts.append(line + "\n")
    parts.append(checks_line(report["results"]) + "\n")
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n".join(parts))


# ----------------------------------------------------------------------------- main
def run_variant(name: str, args, env: Env, work: Workload, groups_cache: dict) -> dict:
    try:
        return measure(name, args, env, work, groups_cache)
    except Exception as exc:  # noqa: BLE001 - one broken variant must not hide the others
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        trace = traceback.format_exc()
    # Outside the except block: the traceback no longer pins the failed model's memory.
    reset_memory(env)
    # FSDP2 may not support this CPU/gloo setup; only the smoke run may skip it.
    status = "skipped" if args.cpu_smoke and name == "fsdp2" else "failed"
    if env.rank == 0:
        print(f"[bench_expert_stack] {name} {status}:\n{trace}", file=sys.stderr)
    return {"status": f"{status}: {reason}", "traceback": trace}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    env = init_distributed(args.cpu_smoke)
    work = make_workload(args, env)
    groups_cache: dict = {}
    results = {}
    for name in args.variants:
        results[name] = run_variant(name, args, env, work, groups_cache)
    add_derived(results, work.flops)
    report = {
        "benchmark": "expert_stack",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command_line(),
        "argv": sys.argv,
        "environment": environment(env),
        "config": {
            **{k: getattr(args, k) for k in ("layers", "experts", "tokens_per_expert", "hidden",
                                             "ffn", "warmup", "steps", "variants", "cpu_smoke")},
            "tokens_per_rank": work.x.shape[0],
            "flops_per_step_per_gpu": work.flops,
            "etp": {"etp_size": env.world, "expert_etp_size": env.world},
        },
        "anchors_ms_2026_11_21": ANCHOR_MS,
        "results": results,
    }
    failed = [n for n, r in results.items() if r["status"].startswith("failed")]
    if env.rank == 0:
        write_outputs(args, report)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


def write_outputs(args, report: dict) -> None:
    out = Path(args.out) if args.out else Path(os.environ.get("OUT", ".")) / "bench_expert_stack.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    table = markdown_table(report["results"])
    print(f"\n{report['command']}\n\n{table}")
    line = overlap_line(report["results"])
    if line:
        print(line)
    print(checks_line(report["results"]))
    print(f"\nJSON: {out}")
    if args.benchmarks_md:
        append_benchmarks_md(args.benchmarks_md, report, table)
        print(f"appended to {args.benchmarks_md}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
