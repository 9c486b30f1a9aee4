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
* ``replicated_fp8``: full weights, no communication, and the FP8 GEMMs of ``etp_async_fp8``
  (forward and input gradient through ``etp.gemm.GroupedGemm`` on a per-expert-scaled e4m3
  copy of each full weight, made once per step by the same fused amax and cast kernels;
  weight gradients in bf16; fast accumulation, ``ETPConfig.fp8_fast_accum``'s default; the
  transposed FP8 weight of the input gradient made in the cast's pass): what FP8 compute
  buys before any communication;
* ``replicated_fp8_wgrad`` (opt-in): ``replicated_fp8`` with the weight-gradient GEMMs in FP8
  too (``ETPConfig.fp8_wgrad``, etp's default: operands quantized per expert from the rows' amax
  of their rowwise quantization by ``etp.kernels.quantize_grouped_colwise``);
  ``etp_async_fp8_wgrad`` likewise. Every other FP8 variant pins ``fp8_wgrad=False`` (bf16
  weight-gradient GEMMs), so a name means the same across runs; ``--fp8-weight-scaling``
  sets ``ETPConfig.fp8_weight_scaling`` of every FP8 variant (default: etp's, ``delayed``);
* ``ddp``: torch DistributedDataParallel over the world, default buckets, bf16 all-reduce;
* ``fsdp2``: ``fully_shard`` on every layer, then on the root (bf16 gathers);
* ``etp_sync``: ETP over the world, ``prefetch=False, async_reduce=False``;
* ``etp_async``: ETP over the world, ``prefetch=True, async_reduce=True``;
* ``etp_async_fp8``: ``etp_async`` with ``gather_dtype="fp8_tensorwise"``: weights travel as
  float8_e4m3fn (1 byte per element) plus a scale, and ``etp.quantize_shards`` runs once per
  step (see below);
* ``etp_async_fp8_blockwise`` (opt-in through ``--variants``): ``gather_dtype="fp8_blockwise"``
  with ``pad_for_alignment=128``.

Transports (see docs/transport.md): the variants above pin ``transport="nccl"`` and
``reduce_transport="nccl"`` (etp's path before transports), so they stay comparable with
earlier runs. The transport variants (opt-in through ``--variants``) change only that:

* ``etp_async_ce`` / ``etp_async_ce_fp8``: copy-engine gathers (peer copies out of symmetric
  memory, no SMs), NCCL reduce-scatter;
* ``etp_async_ce_symm`` / ``etp_async_ce_fp8_symm``: copy-engine gathers and the Triton
  symmetric-memory reduce-scatter on ``--reduce-ctas`` CTAs;
* ``etp_async_ce_pull`` / ``etp_async_ce_fp8_pull``: copy-engine gathers and the copy-engine
  reduce-scatter (peers' slices pulled by the copy engines, added locally in fp32);
* ``etp_async_ce_fp8_wgrad``: ``etp_async_ce_fp8`` with the weight-gradient GEMMs in FP8 too
  (``etp_async_fp8_wgrad`` on copy-engine gathers: every option of the fastest FP8 path);
* ``etp_async_graphed`` / ``etp_async_fp8_graphed`` (opt-in): ``etp_async`` / ``etp_async_fp8``
  with forward + backward captured in one CUDA graph by ``etp.GraphedStep`` and replayed
  (finalize, FP8 re-quantization and the post-step hook stay eager); likewise
  ``replicated_graphed``, ``replicated_fp8_wgrad_graphed``, ``etp_async_ce_push_alias_graphed``
  and ``etp_async_ce_push_fp8_wgrad_alias_graphed``;
* ``etp_async_capped`` / ``etp_async_ce_capped``: the reduce-scatter on its own NCCL
  communicator capped at ``--reduce-ctas`` CTAs (per communicator, not NCCL_MAX_CTAS);
* ``etp_async_ce_push`` / ``etp_async_ce_push_fp8_wgrad``: copy-engine gathers and the push
  reduce-scatter (copy-engine pushes, flag fences, the fp32 sum between GEMMs);
  ``etp_async_ce_push_kfence`` / ``etp_async_ce_push_fp8_wgrad_kfence``: the same with the gathers fenced by symmetric-memory barrier
  kernels instead of stream flag operations (``CopyEngineGather.fence = "kernel"``);
  ``etp_async_ce_push_alias`` / ``etp_async_ce_push_fp8_wgrad_alias``: gathered into buffers whose
  own rows are the shard itself, so no own-rows copy (``ETPConfig.alias_own_rows``).

Every ETP variant issues the next pass's chain-head gathers at the end of the step
(``etp.prefetch_after_step``, the post-optimizer hook), and the step's end event waits for
the ETP side streams: with no optimizer step here to hide behind, that gather is charged to
the step instead of being hidden.

The baselines run the same grouped-GEMM kernels as etp's sharded bf16 path
(``torch._grouped_mm`` for bf16 on sm90), so differences among the bf16 variants are
communication and scheduling; the FP8 variants use etp's FP8 GEMMs (``torch._scaled_mm`` /
``torch._scaled_grouped_mm`` on sm90, a dequantized weight elsewhere).
A step is forward + backward (+ ``etp.finalize_grads`` for ETP, then, for the FP8 variants,
``etp.quantize_shards`` — the fused amax, coalesced all-reduce(MAX) and fused cast that a
training loop runs once after each optimizer step; no optimizer runs here, but its cost is
charged to every step), timed with CUDA events; gradients are set to None between steps.
When this etp has no FP8 gathers (no ``etp.quantize_shards``), the FP8 variants are reported
as skipped. Reported per variant: median step ms on rank 0 and the max over ranks of the
per-rank medians, TFLOP/s per GPU, % of ``replicated`` throughput, exposed communication
(step ms minus replicated step ms), peak allocated memory (reset before warm-up), parameter
bytes per rank and bytes received per rank per step on the wire (analytic, see
``sharded_wire_bytes``: FP8 gathers move 1 byte per element, the gradient reduce-scatter
stays in the parameter dtype). The correctness check (output sum over ranks, mean-gradient
norm) must agree across the bf16 variants up to rounding; the FP8 variants differ by FP8
rounding, which is printed and stored as a relative difference from ``replicated``, never
treated as a failure.

``--nccl-max-ctas N`` sets ``NCCL_MAX_CTAS=N`` before the process group (and so every NCCL
communicator) is created: it caps the SMs NCCL's kernels take from concurrent GEMMs. The value
(and every ``NCCL_*`` variable in effect) is recorded in the JSON and the BENCHMARKS section.

Gather bandwidth (after the variants): for the largest weight, one layer's
``fc1_weight [E, 2·ffn, hidden]``, the median over 20 iterations (after 5 warm-up) of
(a) a raw NCCL ``all_gather_into_tensor`` over etp's all-gather communicator of a uint8
tensor with exactly the bytes of the FP8 shard, and of a bf16 tensor with the bytes of the
bf16 shard; (b) etp's own synchronous gather (``ETPRuntime._gather_now`` into the cache's
ticket buffer) of that weight in a 1-layer ETP model with ``gather_dtype="fp8_tensorwise"``
(after ``etp.quantize_shards``) and with ``gather_dtype="bf16"``. Reported: algbw (bytes
gathered / time) and busbw (algbw·(W−1)/W) in GB/s (1e9), and the ratio of etp's FP8 busbw
to the raw uint8 busbw (target >= 0.90).

``--trace DIR`` records one torch.profiler trace of 3 steps on rank 0 for each variant of
``PROFILED`` that runs (``DIR/<variant>_trace.json``: the copy-engine variants show their
gathers as memcpy rows, no NCCL kernels) and, from its device timeline, how much
NCCL kernel time overlaps GEMM kernels.

Output: JSON to ``--out`` (default ``$OUT/bench_expert_stack.json``), two markdown tables
(variants, gather bandwidth) on rank 0's stdout, and a section appended to
``--benchmarks-md PATH`` when given.

The 8×H200 run::

    torchrun --nproc-per-node=8 tools/bench_expert_stack.py --trace $OUT/trace \\
        --out $OUT/bench_expert_stack.json --benchmarks-md BENCHMARKS.md

The same with NCCL capped at 8 CTAs per collective::

    torchrun --nproc-per-node=8 tools/bench_expert_stack.py --nccl-max-ctas 8 \\
        --variants replicated,etp_async,etp_async_fp8 --out $OUT/bench_expert_stack_ctas8.json

The transports side by side on 2 GPUs (what tools/gpu_overlap.sh runs)::

    torchrun --nproc-per-node=2 tools/bench_expert_stack.py --variants replicated,replicated_fp8,\
fsdp2,etp_async,etp_async_fp8,etp_async_ce,etp_async_ce_fp8,etp_async_ce_symm,etp_async_ce_fp8_symm,\
etp_async_ce_pull,etp_async_ce_fp8_pull,etp_async_capped --trace $OUT/trace --out $OUT/bench_expert_stack.json

CPU check of the script itself (gloo, float32, tiny shapes, host timers)::

    torchrun --nproc-per-node=2 tools/bench_expert_stack.py --cpu-smoke --out /tmp/bench_smoke.json
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
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
from etp.activations import swiglu  # noqa: E402
from etp.gemm import GroupedGemm  # noqa: E402

# variant -> (ETPConfig.transport, ETPConfig.reduce_transport); the rest use nccl / nccl.
TRANSPORT_VARIANTS = {
    "etp_async_ce": ("copy_engine", "nccl"),
    "etp_async_ce_fp8": ("copy_engine", "nccl"),
    "etp_async_ce_symm": ("copy_engine", "symm_triton"),
    "etp_async_ce_fp8_symm": ("copy_engine", "symm_triton"),
    "etp_async_ce_pull": ("copy_engine", "copy_engine"),
    "etp_async_ce_fp8_pull": ("copy_engine", "copy_engine"),
    "etp_async_capped": ("nccl", "nccl_capped"),
    "etp_async_ce_capped": ("copy_engine", "nccl_capped"),
    "etp_async_ce_fp8_wgrad": ("copy_engine", "nccl"),
    "etp_async_ce_push": ("copy_engine", "copy_engine_push"),
    "etp_async_ce_push_fp8_wgrad": ("copy_engine", "copy_engine_push"),
    # the copy-engine gather fenced by symmetric-memory barrier kernels (session 9's), not flags
    "etp_async_ce_push_kfence": ("copy_engine", "copy_engine_push"),
    "etp_async_ce_push_fp8_wgrad_kfence": ("copy_engine", "copy_engine_push"),
    # own rows not copied: gathered into buffers aliased onto the shard (ETPConfig.alias_own_rows)
    "etp_async_ce_push_alias": ("copy_engine", "copy_engine_push"),
    "etp_async_ce_push_fp8_wgrad_alias": ("copy_engine", "copy_engine_push"),
    # ... and forward gathers kept for backward (ETPConfig.gather_reuse "pass"): one gather per
    # weight per step instead of two, for the memory of every gathered weight of the pass
    "etp_async_ce_push_alias_reuse": ("copy_engine", "copy_engine_push"),
    "etp_async_ce_push_fp8_wgrad_alias_reuse": ("copy_engine", "copy_engine_push"),
}
# Variants that also run captured, as ``<name>_graphed``. The last four: the eager FP8 push stack
# waits on the host's launches (BENCHMARKS.md, session 14), so both sides run with the host out
# of the way.
GRAPHED = ("etp_async", "etp_async_fp8", "replicated", "replicated_fp8_wgrad", "etp_async_ce_push_alias",
           "etp_async_ce_push_fp8_wgrad_alias", "etp_async_ce_push_alias_reuse",
           "etp_async_ce_push_fp8_wgrad_alias_reuse")
VARIANTS = ("replicated", "replicated_fp8", "ddp", "fsdp2", "etp_sync", "etp_async", "etp_async_fp8",
            "etp_async_fp8_blockwise", *TRANSPORT_VARIANTS, "replicated_fp8_wgrad", "etp_async_fp8_wgrad",
            *(f"{name}_graphed" for name in GRAPHED))
DEFAULT_VARIANTS = VARIANTS[:7]  # blockwise FP8 and the transport variants are opt-in (--variants)
# variant -> (ETPConfig.gather_dtype, ETPConfig.pad_for_alignment or None for the default)
FP8_VARIANTS = {
    "etp_async_fp8": ("fp8_tensorwise", None),
    "etp_async_fp8_blockwise": ("fp8_blockwise", 128),
    "etp_async_ce_fp8": ("fp8_tensorwise", None),
    "etp_async_ce_fp8_symm": ("fp8_tensorwise", None),
    "etp_async_ce_fp8_pull": ("fp8_tensorwise", None),
    "etp_async_fp8_wgrad": ("fp8_tensorwise", None),
    "etp_async_ce_fp8_wgrad": ("fp8_tensorwise", None),
    "etp_async_ce_push_fp8_wgrad": ("fp8_tensorwise", None),
    "etp_async_ce_push_fp8_wgrad_kfence": ("fp8_tensorwise", None),
    "etp_async_ce_push_fp8_wgrad_alias": ("fp8_tensorwise", None),
    "etp_async_ce_push_fp8_wgrad_alias_reuse": ("fp8_tensorwise", None),
}
# Variants whose GEMMs run in FP8 (their check differs from replicated by FP8 rounding).
FP8_COMPUTE = ("replicated_fp8", "replicated_fp8_wgrad", *FP8_VARIANTS)
FP8_COMPUTE += tuple(f"{name}_graphed" for name in GRAPHED if name in FP8_COMPUTE)
PROFILED = ("replicated", "replicated_fp8", "replicated_fp8_wgrad", "etp_async", "etp_async_fp8", "etp_async_ce",
            "etp_async_ce_capped",
            "etp_async_ce_fp8_symm", "etp_async_ce_pull", "etp_async_ce_fp8",
            "etp_async_ce_fp8_wgrad", "etp_async_ce_push", "etp_async_ce_push_fp8_wgrad",
            "etp_async_ce_push_kfence", "etp_async_ce_push_fp8_wgrad_kfence",
            "etp_async_ce_push_alias", "etp_async_ce_push_fp8_wgrad_alias",
            "etp_async_ce_push_alias_reuse", "etp_async_ce_push_fp8_wgrad_alias_reuse")  # traced under --trace
GPU_DEFAULTS = dict(layers=8, experts=16, tokens_per_expert=2048, hidden=4096, ffn=1536, warmup=5, steps=20)
SMOKE_DEFAULTS = dict(layers=2, experts=4, tokens_per_expert=8, hidden=32, ffn=16, warmup=2, steps=2)
# Measured separately on 2026-11-21 (shared/anchors.md), same workload and machine kind.
ANCHOR_MS = {"replicated": 56.9, "fsdp2": 79.7}
PROFILE_STEPS = 3
NCCL_MARKERS = ("nccl",)
GEMM_MARKERS = ("gemm", "cutlass", "sm90", "nvjet", "groupedmm", "grouped")
GIB = 1024**3
GATHER_WARMUP, GATHER_ITERS = 5, 20
GATHER_TARGET = 0.90  # etp's FP8 gather busbw over the raw uint8 all-gather's


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
    p.add_argument("--deterministic", action="store_true",
                   help="etp-train's deterministic mode (etp.megatron.reproducible.enable_determinism; "
                        "ETP_DETERMINISTIC_FILL=1 in the environment keeps torch's NaN fill of new memory)")
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="run the variant list N times, interleaved (A B C A B C ...), and report each "
                        "variant's median over all its steps: clock and power drift then reaches every "
                        "variant alike (traces: first round only)")
    p.add_argument("--variants", type=str, default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)} (run in that order; "
                        f"default {','.join(DEFAULT_VARIANTS)})")
    p.add_argument("--nccl-max-ctas", type=int, default=None, metavar="N",
                   help="set NCCL_MAX_CTAS=N before any NCCL communicator exists (default: "
                        "leave the environment as it is)")
    p.add_argument("--reduce-ctas", type=int, default=8, metavar="N",
                   help="CTAs of the capped NCCL and symmetric Triton reduce transports (8)")
    p.add_argument("--gemm-sm-carveout", type=int, default=0, metavar="N",
                   help="ETPConfig.gemm_sm_carveout of every ETP variant: SMs the GEMMs leave free "
                        "during backward (0: off)")
    p.add_argument("--fp8-weight-scaling", choices=("current", "delayed"), default=None,
                   help="ETPConfig.fp8_weight_scaling of every FP8 variant (default: ETPConfig's)")
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
    if args.nccl_max_ctas is not None and args.nccl_max_ctas < 1:
        p.error(f"--nccl-max-ctas={args.nccl_max_ctas}: expected an integer >= 1")
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


def init_distributed(cpu_smoke: bool, nccl_max_ctas: int | None = None) -> Env:
    _default_single_process_env()
    if nccl_max_ctas is not None:
        # NCCL reads it when a communicator is created: before init_process_group, so that
        # the world communicator and etp's groups (created later) all see it.
        os.environ["NCCL_MAX_CTAS"] = str(nccl_max_ctas)
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


class _FP8GroupedLinear(torch.autograd.Function):
    """A full bf16 weight computed through its once-per-step FP8 copy: forward and input
    gradient are etp's own FP8 grouped GEMMs (``GroupedGemm`` with an ``FP8Weight``), the
    weight gradient is bf16 — exactly what ``etp_async_fp8`` computes, without communication."""

    @staticmethod
    def forward(ctx, x, weight, fp8, counts, fp8_wgrad):
        ctx.save_for_backward(x, counts)
        ctx.fp8, ctx.fp8_wgrad = fp8, fp8_wgrad
        return GroupedGemm.forward(x, fp8, counts)

    @staticmethod
    def backward(ctx, grad_y):
        x, counts = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        grad_x = GroupedGemm.dgrad(grad_y, ctx.fp8, counts) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = GroupedGemm.wgrad(grad_y, x, counts, fp8=ctx.fp8_wgrad, fast_accum=ctx.fp8.fast_accum)
        return grad_x, grad_w, None, None, None


def quantize_full_weights(model: nn.Module, scaling: str) -> None:
    """Per-expert tensorwise e4m3 copies of every full expert weight, and their transposes
    (the input-gradient operand), written straight into stable buffers by
    ``etp.quant.cast_tensorwise`` with a kept ``MultiTensorCastPlan`` (what
    ``etp.quantize_shards`` runs on shards): current
    scaling, one fused amax launch and one fused cast launch; delayed, one cast that records
    the amax and a re-cast of the experts whose amax grew. An unsharded weight lives for the
    whole step, so its transposed copy is made here, in the cast's pass, instead of once per
    backward GEMM as for a gathered weight."""
    from etp.kernels import MultiTensorCastPlan
    from etp.quant import FP8_DTYPE, FP8Weight, cast_tensorwise, prepare_scale_rows

    weights = [(layer, name, getattr(layer, name).detach())
               for layer in model.layers for name in ("fc1_weight", "fc2_weight")]
    for layer, name, w in weights:
        if name not in layer.fp8_copies:
            layer.fp8_copies[name] = (torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device),
                                      torch.empty(w.transpose(-2, -1).shape, dtype=FP8_DTYPE, device=w.device))
    views = [w[e] for _, _, w in weights for e in range(w.shape[0])]
    outs = [layer.fp8_copies[name][0][e] for layer, name, w in weights for e in range(w.shape[0])]
    outs_t = [layer.fp8_copies[name][1][e] for layer, name, w in weights for e in range(w.shape[0])]
    prev = getattr(model, "fp8_amax", None) if scaling == "delayed" else None
    if getattr(model, "fp8_cast_plan", None) is None:  # the buffers stay: its tables are built once, as etp's
        model.fp8_cast_plan = MultiTensorCastPlan(views, write_transposed=True, out=outs, out_transposed=outs_t)
    scales, model.fp8_amax = cast_tensorwise(views, torch.arange(len(views), device=views[0].device), len(views),
                                             outs, out_transposed=outs_t, prev_amax=prev, plan=model.fp8_cast_plan)
    first = 0
    for layer, name, w in weights:
        experts = w.shape[0]
        data, data_t = layer.fp8_copies[name]
        if name not in layer.fp8_weights:
            layer.fp8_weights[name] = FP8Weight(data, torch.empty_like(scales[:experts]),
                                                torch.empty_like(scales[:experts]), False,
                                                data.view(-1, data.shape[-1]), experts * w.shape[1],
                                                fast_accum=True, transposed=data_t)
        # In place, like etp.quantize_shards: a captured step (the "_graphed" variants) reads
        # the addresses it saw at capture; fresh scale tensors each step left it reading freed
        # memory (NaN outputs in step (aj)).
        fp8 = layer.fp8_weights[name]
        fp8.scale.copy_(scales[first:first + experts])
        torch.reciprocal(fp8.scale, out=fp8.scale_inv)
        prepare_scale_rows(fp8.scale_inv, data.shape)  # as etp.quantize_shards does for ETP's weights
        first += experts


class BenchExperts(etp.GroupedSwiGLUExperts):
    """``GroupedSwiGLUExperts`` whose *unsharded* weights also run grouped GEMMs.

    etp computes a plain (unwrapped) weight with a per-expert ``torch.mm`` loop, its exact
    CPU reference, while ETP shards run ``torch._grouped_mm`` on GPU. The baselines must run
    the same kernels as ETP, or the comparison would measure the GEMM choice instead of
    communication. Sharded weights take etp's own forward unchanged.
    """

    fp8_weights: dict  # name -> FP8Weight of the step (replicated_fp8 only)
    fp8_wgrad: bool = False  # replicated_fp8_wgrad: weight gradients from FP8 GEMMs too
    fp8_copies: dict   # name -> the stable FP8 buffers behind it (data, transposed)

    def forward(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if isinstance(self.fc1_weight, etp.ETPShardedParam):
            return super().forward(x, tokens_per_expert)
        fp8 = getattr(self, "fp8_weights", None)
        if fp8:
            gate_up = _FP8GroupedLinear.apply(x, self.fc1_weight, fp8["fc1_weight"], tokens_per_expert,
                                              self.fp8_wgrad)
        else:
            gate_up = _GroupedLinear.apply(x, self.fc1_weight, tokens_per_expert)
        hidden = swiglu(gate_up, None, quantize=bool(fp8))  # etp's own SwiGLU, as in etp's experts
        if fp8:
            return _FP8GroupedLinear.apply(hidden, self.fc2_weight, fp8["fc2_weight"], tokens_per_expert,
                                           self.fp8_wgrad)
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
    info: dict = dataclasses.field(default_factory=dict)  # extra JSON fields of the result
    step: Callable | None = None      # replaces forward + backward (a CUDA-graph replay);
                                      # returns the output


class Unsupported(Exception):
    """This etp lacks a feature the variant needs (FP8 gathers): skipped, not failed."""


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


def sharded_wire_bytes(world: int, full_numel: int, gather_elem_bytes: int, reduce_elem_bytes: int) -> dict:
    """Bytes each rank receives per step for sharded weights of ``full_numel`` (padded)
    elements in all: two all-gathers (forward, backward) of ``gather_elem_bytes`` per element
    and one reduce-scatter of ``reduce_elem_bytes`` per element, each bringing (W-1)/W of the
    full weights. bf16 gathers: (2·2 + 2) bytes, as ``wire_bytes("sharded")``; FP8 gathers:
    (2·1 + 2). Not counted: the FP8 scales (tensorwise: one fp32 per expert, exchanged by
    ``quantize_shards``' all-reduce(MAX); blockwise: one fp32 per 128×128 block, all-gathered
    once per step), under 0.03% of the bytes."""
    all_gather = 2 * (world - 1) * full_numel * gather_elem_bytes // world
    reduce_scatter = (world - 1) * full_numel * reduce_elem_bytes // world
    return {"all_gather": all_gather, "reduce_scatter": reduce_scatter, "total": all_gather + reduce_scatter}


def prepare_replicated(args, env, _groups) -> Prepared:
    model = build_model(args, env)
    return Prepared(model, model, lambda: None, _bytes(model.parameters()), 0, "local")


def prepare_replicated_fp8(args, env, _groups, fp8_wgrad: bool = False) -> Prepared:
    model = build_model(args, env)
    for layer in model.layers:
        layer.fp8_weights, layer.fp8_copies, layer.fp8_wgrad = {}, {}, fp8_wgrad
    scaling = args.fp8_weight_scaling or etp.ETPConfig().fp8_weight_scaling
    quantize_full_weights(model, scaling)  # the first quantization, as after initialization

    def finalize() -> None:
        quantize_full_weights(model, scaling)  # once per optimizer step in training: charged to every step

    return Prepared(model, model, finalize, _bytes(model.parameters()), 0, "local",
                    info={"fp8_copy_bytes": sum(d.numel() for layer in model.layers
                                                for pair in layer.fp8_copies.values() for d in pair)})


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


def _etp_config(env: Env, prefetch: bool = True, gather_dtype: str = "param",
                pad_for_alignment: int | None = None, transports=("nccl", "nccl"),
                reduce_ctas: int = 8) -> "etp.ETPConfig":
    """ETP over the world; raises ``Unsupported`` when this etp cannot gather in FP8."""
    fp8 = gather_dtype.startswith("fp8")
    if fp8 and getattr(etp, "quantize_shards", None) is None:
        raise Unsupported(f"this etp has no quantize_shards: no {gather_dtype} gathers yet")
    kw = dict(etp_size=env.world, expert_etp_size=env.world, prefetch=prefetch, async_reduce=prefetch,
              transport=transports[0], reduce_transport=transports[1], reduce_ctas=reduce_ctas)
    if gather_dtype != "param":
        kw["gather_dtype"] = gather_dtype
    if pad_for_alignment is not None:
        kw["pad_for_alignment"] = pad_for_alignment
    try:
        return etp.ETPConfig(**kw)
    except ValueError as exc:
        if fp8 and "gather_dtype" in str(exc):
            raise Unsupported(str(exc)) from exc
        raise


def _etp_groups(cfg, groups_cache: dict):
    # Groups depend only on the sizes: sharing them keeps every ETP variant on the same
    # communicators instead of paying NCCL setup (and its buffers) again.
    if "etp" not in groups_cache:
        groups_cache["etp"] = etp.build_etp_groups(cfg)
    return groups_cache["etp"]


def _gather_elem_bytes(cfg, param: torch.Tensor) -> int:
    if cfg.gather_dtype.startswith("fp8"):
        return 1  # float8_e4m3fn
    return torch.empty((), dtype=cfg.gather_torch_dtype or param.dtype).element_size()


def _prepare_etp(args, env, groups_cache: dict, prefetch: bool, gather_dtype: str = "param",
                 pad_for_alignment: int | None = None, transports=("nccl", "nccl"),
                 fp8_wgrad: bool = False, alias_own_rows: bool = False, gather_reuse: str = "chain") -> Prepared:
    cfg = _etp_config(env, prefetch, gather_dtype, pad_for_alignment, transports, args.reduce_ctas)
    # Pinned either way (ETPConfig's default is on): "_fp8" variants keep bf16 weight-gradient
    # GEMMs, "_fp8_wgrad" ones run them in FP8, so each name means one thing across runs.
    cfg = dataclasses.replace(cfg, fp8_wgrad=fp8_wgrad, gemm_sm_carveout=args.gemm_sm_carveout,
                              alias_own_rows=alias_own_rows, gather_reuse=gather_reuse)
    if args.fp8_weight_scaling and cfg.gather_dtype == "fp8_tensorwise":
        cfg = dataclasses.replace(cfg, fp8_weight_scaling=args.fp8_weight_scaling)
    groups = _etp_groups(cfg, groups_cache)
    model = build_model(args, env)
    try:
        summary = etp.wrap_module_params_etp(model, cfg, groups)
    except ValueError as exc:  # a transport this machine cannot run (CPU smoke, no NVLink)
        if cfg.transport != "nccl" or cfg.reduce_transport != "nccl":
            raise Unsupported(str(exc)) from exc
        raise
    shards = [p for p in model.parameters() if isinstance(p, etp.ETPShardedParam)]
    quantize = etp.quantize_shards if cfg.gather_dtype.startswith("fp8") else None
    if quantize is not None:
        quantize(model)  # the shards' first quantization, as after initialization

    def finalize() -> None:
        etp.finalize_grads(model, cfg, groups, replicate=False)
        if quantize is not None:
            quantize(model)  # once per optimizer step in training: charged to every step
        etp.prefetch_after_step(model)  # the post-step hook: no cold chain heads
        _join_side_streams(model)  # ... and its gathers are charged to this step

    # The gradient reduce-scatter runs in the gradient dtype (the parameter's: no main_grad).
    wire = {"all_gather": 0, "reduce_scatter": 0, "total": 0}
    for p in shards:
        part = sharded_wire_bytes(env.world, p.numel() * env.world, _gather_elem_bytes(cfg, p), p.element_size())
        wire = {k: wire[k] + part[k] for k in wire}
    return Prepared(
        model, model, finalize, summary.bytes_after, wire["total"], "sharded",
        info={"etp_config": {"gather_dtype": cfg.gather_dtype, "pad_for_alignment": cfg.pad_for_alignment,
                             "prefetch": cfg.prefetch, "async_reduce": cfg.async_reduce,
                             "transport": cfg.transport, "reduce_transport": cfg.reduce_transport,
                             "reduce_ctas": cfg.reduce_ctas, "fp8_fast_accum": cfg.fp8_fast_accum,
                             "fp8_wgrad": cfg.fp8_wgrad, "fp8_weight_scaling": cfg.fp8_weight_scaling,
                             "gemm_sm_carveout": cfg.gemm_sm_carveout, "alias_own_rows": cfg.alias_own_rows,
                             "gather_reuse": cfg.gather_reuse},
              "transports": {str(k): (t.gather.name, t.reduce.name)
                             for k, t in etp.runtime_of(model).transports.items()},
              "wire_bytes_breakdown": wire},
    )


def prepare_etp_sync(args, env, groups_cache) -> Prepared:
    return _prepare_etp(args, env, groups_cache, prefetch=False)


def prepare_etp_async(args, env, groups_cache) -> Prepared:
    return _prepare_etp(args, env, groups_cache, prefetch=True)


def prepare_etp_async_fp8(args, env, groups_cache) -> Prepared:
    dtype, pad = FP8_VARIANTS["etp_async_fp8"]
    return _prepare_etp(args, env, groups_cache, prefetch=True, gather_dtype=dtype, pad_for_alignment=pad)


def prepare_replicated_fp8_wgrad(args, env, groups_cache) -> Prepared:
    return prepare_replicated_fp8(args, env, groups_cache, fp8_wgrad=True)


def prepare_etp_async_fp8_wgrad(args, env, groups_cache) -> Prepared:
    dtype, pad = FP8_VARIANTS["etp_async_fp8_wgrad"]
    return _prepare_etp(args, env, groups_cache, prefetch=True, gather_dtype=dtype, pad_for_alignment=pad,
                        fp8_wgrad=True)


def prepare_etp_async_fp8_blockwise(args, env, groups_cache) -> Prepared:
    dtype, pad = FP8_VARIANTS["etp_async_fp8_blockwise"]
    return _prepare_etp(args, env, groups_cache, prefetch=True, gather_dtype=dtype, pad_for_alignment=pad)


def _join_side_streams(model) -> None:
    """The current stream waits for every ETP side stream (AG and RS)."""
    if not torch.cuda.is_available():
        return
    for streams in etp.runtime_of(model).streams._streams.values():
        for stream in (streams.ag, streams.rs):
            if stream is not None:
                torch.cuda.current_stream().wait_stream(stream)


def _graphed_variant(base):
    """``base`` with forward + backward captured in one CUDA graph (``etp.GraphedStep``) at
    its first step (warm-up passes included) and replayed afterwards."""
    def prepare(args, env, groups_cache) -> Prepared:
        prep = base(args, env, groups_cache)
        if not env.cuda:
            raise Unsupported("CUDA graphs need a GPU")
        from etp.graphs import GraphedStep

        captured = {}

        def step(work: Workload) -> torch.Tensor:
            if "graph" not in captured:
                def forward_backward(x):
                    y = prep.module(x, work.counts)
                    y.backward(work.grad_out)
                    return y.detach()
                captured["graph"] = GraphedStep(prep.model, forward_backward, work.x)
            return captured["graph"]()

        return dataclasses.replace(prep, step=step, info={**prep.info, "cuda_graph": "GraphedStep"})
    return prepare


def _transport_variant(name: str):
    def prepare(args, env, groups_cache) -> Prepared:
        dtype, pad = FP8_VARIANTS.get(name, ("param", None))
        prep = _prepare_etp(args, env, groups_cache, prefetch=True, gather_dtype=dtype, pad_for_alignment=pad,
                            transports=TRANSPORT_VARIANTS[name], fp8_wgrad="_fp8_wgrad" in name,
                            alias_own_rows="_alias" in name,
                            gather_reuse="pass" if name.endswith("_reuse") else "chain")
        if name.endswith("_kfence"):
            for chosen in etp.runtime_of(prep.model).transports.values():
                chosen.gather.fence = "kernel"
            prep.info["gather_fence"] = "kernel"
        return prep
    return prepare


PREPARE = {
    "replicated": prepare_replicated,
    "replicated_fp8": prepare_replicated_fp8,
    "ddp": prepare_ddp,
    "fsdp2": prepare_fsdp2,
    "etp_sync": prepare_etp_sync,
    "etp_async": prepare_etp_async,
    "etp_async_fp8": prepare_etp_async_fp8,
    "etp_async_fp8_blockwise": prepare_etp_async_fp8_blockwise,
    **{name: _transport_variant(name) for name in TRANSPORT_VARIANTS},
    "replicated_fp8_wgrad": prepare_replicated_fp8_wgrad,
    "etp_async_fp8_wgrad": prepare_etp_async_fp8_wgrad,
}
PREPARE.update({f"{name}_graphed": _graphed_variant(PREPARE[name]) for name in GRAPHED})


# ----------------------------------------------------------------------------- timing
def run_step(prep: Prepared, work: Workload) -> None:
    if prep.step is not None:
        prep.step(work)
    else:
        out = prep.module(work.x, work.counts)
        out.backward(work.grad_out)
    prep.finalize()


def zero_grads(prep: Prepared, work: Workload) -> None:
    if prep.step is not None:
        return  # a replay overwrites the graph-owned gradients; dropping them loses the link
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
        **prep.info,
    }
    medians = [None] * env.world
    dist.all_gather_object(medians, result["step_ms"])
    result["step_ms_per_rank"] = medians
    result["step_ms_max_over_ranks"] = max(medians)
    result["check"] = check_step(prep, work, env)
    if name in PROFILED and args.trace:
        result["profile"] = profile_steps(prep, work, env, args.trace, name)
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
    if prep.step is not None:  # a replay: eager autograd would add into the graph's grads
        out_sum = prep.step(work).double().sum()
    else:
        out = prep.module(work.x, work.counts)
        out_sum = out.detach().double().sum()
        out.backward(work.grad_out)
        del out
    prep.finalize()
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
def profile_steps(prep: Prepared, work: Workload, env: Env, trace_dir: str, name: str) -> dict | None:
    """Runs PROFILE_STEPS steps on every rank (they are collectives), recording rank 0 only."""
    from torch.profiler import ProfilerActivity, profile

    if env.rank != 0:
        for _ in range(PROFILE_STEPS):
            timed_step(prep, work, env)
        return None
    os.makedirs(trace_dir, exist_ok=True)
    path = os.path.join(trace_dir, f"{name}_trace.json")
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
    """nccl, gemm or other (the overlap analysis); a kernel is a GEMM only if the finer
    breakdown says so (``_grouped_colwise_kernel`` is a quantization, not a grouped GEMM)."""
    cls = breakdown_class(kernel_name)
    return cls if cls in ("nccl", "gemm") else "other"


# Finer kernel classes for the time breakdown (first match wins, in this order).
BREAKDOWN_CLASSES = (
    ("nccl", ("nccl",)),
    ("fp8_quantize", ("quantize", "cast_fp8", "amax", "colwise")),
    ("transpose", ("transpose",)),
    ("gemm", GEMM_MARKERS),
    ("copy", ("copy", "memcpy", "memset", "cat", "fill")),
    ("elementwise", ("elementwise", "vectorized", "silu", "swiglu", "mul", "add", "reduce")),
)


def breakdown_class(kernel_name: str) -> str:
    lowered = kernel_name.lower()
    for name, markers in BREAKDOWN_CLASSES:
        if any(m in lowered for m in markers):
            return name
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
    breakdown: dict[str, float] = {}
    for name, (t, _) in totals.items():
        key = breakdown_class(name)
        breakdown[key] = breakdown.get(key, 0.0) + t / 1e3 / steps
    return {
        "breakdown_kernel_ms_per_step": dict(sorted(breakdown.items(), key=lambda kv: -kv[1])),
        "kernels": len(kernels),
        "nccl_kernel_ms_per_step": nccl_ms / steps,
        "nccl_kernel_sum_ms_per_step": length(spans["nccl"]) / 1e3 / steps,
        "gemm_kernel_ms_per_step": length(gemm) / 1e3 / steps,
        # Some kernel of any stream running: the step's time minus this is the device idle.
        "busy_kernel_ms_per_step": length(merge([iv for ivs in spans.values() for iv in ivs])) / 1e3 / steps,
        "nccl_overlapped_by_gemm_ms_per_step": overlap_ms / steps,
        "nccl_overlap_fraction": overlap_ms / nccl_ms if nccl_ms else None,
        "top_kernels": [
            {"name": name[:300], "class": classify(name), "total_ms": t / 1e3, "count": n}
            for name, (t, n) in top
        ],
    }


# ----------------------------------------------------------------------------- gather bandwidth
def time_calls(fn: Callable[[], object], env: Env, warmup: int = GATHER_WARMUP,
               iters: int = GATHER_ITERS) -> list[float]:
    """Milliseconds of each of ``iters`` calls of a synchronous collective after ``warmup``.

    On GPU the calls are queued back to back, each between two CUDA events on the current
    stream (a synchronous collective makes the current stream wait for it), and read after
    one synchronize; on CPU, host timers."""
    for _ in range(warmup):
        fn()
    if env.cuda:
        torch.cuda.synchronize()
    dist.barrier()
    if not env.cuda:
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def bandwidth_entry(what: str, times: list[float], shard_bytes: int, world: int, env: Env) -> dict:
    """algbw = bytes gathered (``world`` shards) / median time; busbw = algbw·(W−1)/W (GB/s, 1e9)."""
    median = statistics.median(times)
    medians = [None] * env.world
    dist.all_gather_object(medians, median)
    gathered = shard_bytes * world
    algbw = gathered / (median * 1e-3) / 1e9
    return {
        "status": "ok",
        "what": what,
        "shard_bytes": shard_bytes,
        "gathered_bytes": gathered,
        "median_ms": median,
        "ms_all": times,
        "median_ms_per_rank": medians,
        "algbw_gbps": algbw,
        "busbw_gbps": algbw * (world - 1) / world,
    }


def _nbytes(obj) -> int:
    """Bytes of a tensor, or of the tensors in a tuple / list / dataclass (a gather result)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(o) for o in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(_nbytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    return 0


def _etp_gather_entry(args, env: Env, groups_cache: dict, gather_dtype: str, what: str) -> tuple[dict, tuple]:
    """Times etp's own synchronous gather of ``layers.0.fc1_weight`` in a 1-layer ETP model
    (after ``etp.quantize_shards`` for FP8); also returns the shard's (logical, shard) shapes."""
    from etp.cache import Role

    if env.world == 1:
        raise Unsupported("a world of 1: ETP shards nothing, there is no gather")
    cfg = _etp_config(env, prefetch=False, gather_dtype=gather_dtype)
    groups = _etp_groups(cfg, groups_cache)
    model = build_model(argparse.Namespace(**{**vars(args), "layers": 1}), env)
    etp.wrap_module_params_etp(model, cfg, groups)
    if gather_dtype.startswith("fp8"):
        etp.quantize_shards(model)
    param = model.layers[0].fc1_weight
    runtime = etp.runtime_of(model)
    st = runtime.state(param)
    gather = functools.partial(runtime._gather_now, st, Role.FWD, into_ticket=True)
    entry = bandwidth_entry(what, time_calls(gather, env),
                            param.numel() * _gather_elem_bytes(cfg, param), env.world, env)
    entry["result_bytes"] = _nbytes(gather())  # what _gather_now handed back, for a cross-check
    entry["gather_dtype"] = gather_dtype
    shapes = (tuple(param.etp_layout.logical_shape), tuple(param.etp_layout.shard_shape))
    del gather, st, runtime, param, model
    return entry, shapes


def _failed_entry(exc: Exception, env: Env, what: str) -> dict:
    if isinstance(exc, Unsupported):
        return {"status": f"skipped: {exc}", "what": what}
    trace = traceback.format_exc()
    if env.rank == 0:
        print(f"[bench_expert_stack] gather bandwidth ({what}) failed:\n{trace}", file=sys.stderr)
    return {"status": f"failed: {type(exc).__name__}: {exc}".splitlines()[0][:200], "what": what,
            "traceback": trace}


def gather_bandwidth(args, env: Env, groups_cache: dict) -> dict:
    """The gather-bandwidth section: raw NCCL all-gathers of the FP8 / bf16 shard bytes of the
    largest weight against etp's own FP8 / bf16 gathers of it (see the module doc)."""
    entries: dict[str, dict] = {}
    # etp's FP8 and bf16 gathers first: they fix the shard shape each raw gather copies.
    default_cfg = _etp_config(env)
    layout = etp.ShardLayout((args.experts, 2 * args.ffn, args.hidden), env.world, 0,
                             default_cfg.pad_for_alignment)  # etp's default layout (a fallback)
    shapes = {"fp8": (tuple(layout.logical_shape), tuple(layout.shard_shape))}
    shapes["bf16"] = shapes["fp8"]
    for key, dtype, kind, what in (
        ("etp_fp8_tensorwise", "fp8_tensorwise", "fp8", "etp _gather_now, fp8_tensorwise"),
        ("etp_bf16", "bf16", "bf16", "etp _gather_now, bf16"),
    ):
        try:
            entries[key], shapes[kind] = _etp_gather_entry(args, env, groups_cache, dtype, what)
            entries[key]["shard_shape"] = list(shapes[kind][1])
        except Exception as exc:  # noqa: BLE001 - report, keep measuring the others
            entries[key] = _failed_entry(exc, env, what)
        reset_memory(env)
    logical = shapes["fp8"][0]
    group = _etp_groups(default_cfg, groups_cache).expert.ag_group
    for key, dtype, what in (("raw_nccl_uint8", torch.uint8, "raw all_gather_into_tensor, uint8 (FP8 shard bytes)"),
                             ("raw_nccl_bf16", torch.bfloat16, "raw all_gather_into_tensor, bf16 shard")):
        shard = shapes["fp8" if dtype is torch.uint8 else "bf16"][1]
        shard_numel = shard[0] * shard[1]
        try:
            src = torch.ones(shard_numel, dtype=dtype, device=env.device)
            out = torch.empty(shard_numel * env.world, dtype=dtype, device=env.device)
            gather = functools.partial(dist.all_gather_into_tensor, out, src, group=group)
            entries[key] = bandwidth_entry(what, time_calls(gather, env), shard_numel * src.element_size(),
                                           env.world, env)
            entries[key]["shard_shape"] = list(shard)
            del gather, src, out
        except Exception as exc:  # noqa: BLE001
            entries[key] = _failed_entry(exc, env, what)
        reset_memory(env)
    order = ("raw_nccl_uint8", "etp_fp8_tensorwise", "raw_nccl_bf16", "etp_bf16")
    entries = {k: entries[k] for k in order}
    return {
        "tensor": "layers.0.fc1_weight",
        "logical_shape": list(logical),
        "group_size": env.world,
        "warmup": GATHER_WARMUP,
        "iters": GATHER_ITERS,
        "entries": entries,
        "etp_fp8_over_raw_uint8_busbw": _busbw_ratio(entries, "etp_fp8_tensorwise", "raw_nccl_uint8"),
        "etp_bf16_over_raw_bf16_busbw": _busbw_ratio(entries, "etp_bf16", "raw_nccl_bf16"),
        "target_etp_fp8_over_raw_uint8": GATHER_TARGET,
    }


def _busbw_ratio(entries: dict, num: str, den: str) -> float | None:
    a, b = entries.get(num, {}), entries.get(den, {})
    if a.get("status") != "ok" or b.get("status") != "ok" or not b["busbw_gbps"]:
        return None
    return a["busbw_gbps"] / b["busbw_gbps"]


# ----------------------------------------------------------------------------- reporting
def add_derived(results: dict, flops: float) -> None:
    """TFLOP/s, fraction of replicated throughput, exposed communication and the check's
    relative difference from ``replicated`` per variant."""
    replicated = results.get("replicated", {})
    base = replicated.get("step_ms")
    base_check = replicated.get("check") if replicated.get("status") == "ok" else None
    for r in results.values():
        if r.get("status") != "ok":
            continue
        r["tflops_per_gpu"] = flops / (r["step_ms"] * 1e-3) / 1e12
        r["fraction_of_replicated"] = base / r["step_ms"] if base else None
        r["exposed_comm_ms"] = r["step_ms"] - base if base else None
        r["check_rel_diff_vs_replicated"] = (
            {k: abs(r["check"][k] - base_check[k]) / abs(base_check[k]) if base_check[k] else None
             for k in ("output_sum", "grad_norm")}
            if base_check else None
        )


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
        # What NCCL was told through the environment (NCCL_MAX_CTAS from --nccl-max-ctas).
        "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
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


def overlap_lines(results: dict) -> list[str]:
    lines = []
    for name in PROFILED:
        prof = results.get(name, {}).get("profile")
        if not prof:
            continue
        frac = prof["nccl_overlap_fraction"]
        parts = ", ".join(f"{k} {v:.2f}" for k, v in prof.get("breakdown_kernel_ms_per_step", {}).items())
        lines.append(f"{name} kernel time by class (ms/step, summed over streams): {parts}.")
        lines.append(
            f"{name} profile ({prof['steps']} steps, rank 0): NCCL kernels "
            f"{prof['nccl_kernel_ms_per_step']:.2f} ms/step, of which "
            f"{prof['nccl_overlapped_by_gemm_ms_per_step']:.2f} ms overlap GEMM kernels "
            f"({_fmt(None if frac is None else 100 * frac, '.0f')}%)."
        )
    return lines


def checks_line(results: dict) -> str:
    parts = []
    for name, r in results.items():
        if r.get("status") != "ok":
            continue
        part = f"{name} {r['check']['output_sum']:.6g} / {r['check']['grad_norm']:.6g}"
        rel = r.get("check_rel_diff_vs_replicated")
        if name in FP8_COMPUTE and rel:
            part += (f" (FP8: rel. diff. vs replicated {_fmt(rel['output_sum'], '.2e')} / "
                     f"{_fmt(rel['grad_norm'], '.2e')})")
        parts.append(part)
    return ("checks (output sum over ranks / mean-gradient norm; should agree, FP8 variants up to "
            "FP8 rounding): " + ", ".join(parts))


def nccl_ctas_text(report: dict) -> str:
    value = report["environment"].get("nccl_env", {}).get("NCCL_MAX_CTAS")
    return f"NCCL_MAX_CTAS={value}" if value is not None else "NCCL_MAX_CTAS unset (NCCL's default)"


def gather_table(section: dict) -> str:
    """The gather-bandwidth table; "vs raw" = busbw over the raw gather of the same bytes."""
    entries = section["entries"]
    raw_of = {"etp_fp8_tensorwise": "raw_nccl_uint8", "etp_bf16": "raw_nccl_bf16"}
    lines = [
        f"| gather of {section['tensor']} {tuple(section['logical_shape'])}, W={section['group_size']} "
        "| MB gathered | median ms | algbw GB/s | busbw GB/s | busbw vs raw |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for key, e in entries.items():
        if e.get("status") != "ok":
            lines.append(f"| {e.get('what', key)} | {e['status'].replace('|', '/')[:120]} | | | | |")
            continue
        ratio = _busbw_ratio(entries, key, raw_of[key]) if key in raw_of else None
        lines.append(
            f"| {e['what']} | {e['gathered_bytes'] / 1e6:.1f} | {e['median_ms']:.3f} "
            f"| {e['algbw_gbps']:.1f} | {e['busbw_gbps']:.1f} | {_fmt(ratio, '.3f')} |"
        )
    return "\n".join(lines)


def gather_line(section: dict) -> str:
    ratio = section["etp_fp8_over_raw_uint8_busbw"]
    target = section["target_etp_fp8_over_raw_uint8"]
    verdict = "not measured" if ratio is None else ("met" if ratio >= target else "missed")
    return (f"etp FP8 gather busbw / raw uint8 all-gather busbw = {_fmt(ratio, '.3f')} "
            f"(target >= {target:.2f}: {verdict}); median of {section['iters']} after "
            f"{section['warmup']} warm-up, rank 0; busbw = algbw·(W−1)/W.")


def append_benchmarks_md(path: str, report: dict, table: str) -> None:
    info = report["environment"]
    device = info.get("gpu", "CPU") + f" × {info['world_size']}"
    smoke = " (CPU smoke run: checks the script, not a measurement)" if report["config"]["cpu_smoke"] else ""
    parts = [
        f"\n## Expert stack fwd+bwd: replicated / DDP / FSDP2 / ETP — {report['date']}{smoke}\n",
        f"{device}; torch {info['torch']}, NCCL {info.get('nccl', '–')}, {nccl_ctas_text(report)}, "
        f"etp {info['etp']}, commit {info['git_commit']}.\n",
        f"```\n{report['command']}\n```\n",
        table + "\n",
        "step ms: median of rank 0 (max over ranks of the per-rank medians in parentheses); "
        "exposed comm = step ms − replicated step ms; wire = bytes received per rank per step "
        "(analytic). Anchors from ../shared/anchors.md were measured separately on 2026-11-21: "
        f"replicated {ANCHOR_MS['replicated']} ms, FSDP2 {ANCHOR_MS['fsdp2']} ms.\n",
    ]
    parts.extend(line + "\n" for line in overlap_lines(report["results"]))
    parts.append(checks_line(report["results"]) + "\n")
    section = report.get("gather_bandwidth")
    if section:
        parts.append(gather_table(section) + "\n")
        parts.append(gather_line(section) + "\n")
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n".join(parts))


# ----------------------------------------------------------------------------- main
def merge_round(results: dict, name: str, result: dict, env: Env) -> None:
    """Adds one round's result of ``name`` (``--rounds``): the steps of every ok round pooled,
    their median the step time; each round's own median kept in ``round_step_ms``."""
    first = results.get(name)
    if first is None:
        results[name] = result
        if result.get("status") == "ok":
            result["round_step_ms"] = [result["step_ms"]]
        return
    if first.get("status") != "ok" or result.get("status") != "ok":
        first.setdefault("later_rounds", []).append(result.get("status"))
        return
    first["step_ms_all"] = first["step_ms_all"] + result["step_ms_all"]
    first["round_step_ms"].append(result["step_ms"])
    first["step_ms"] = statistics.median(first["step_ms_all"])
    medians = [None] * env.world
    dist.all_gather_object(medians, first["step_ms"])
    first["step_ms_per_rank"], first["step_ms_max_over_ranks"] = medians, max(medians)


def run_variant(name: str, args, env: Env, work: Workload, groups_cache: dict) -> dict:
    try:
        return measure(name, args, env, work, groups_cache)
    except Unsupported as exc:  # raised on every rank alike, before any collective
        reset_memory(env)
        if env.rank == 0:
            print(f"[bench_expert_stack] {name} skipped: {exc}", file=sys.stderr)
        return {"status": f"skipped: {exc}"}
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
    determinism = None
    if args.deterministic:  # before the first cuBLAS handle (its workspace setting)
        from etp.megatron.reproducible import enable_determinism

        determinism = enable_determinism()
    env = init_distributed(args.cpu_smoke, args.nccl_max_ctas)
    work = make_workload(args, env)
    groups_cache: dict = {}
    results = {}
    if args.rounds < 1:
        raise SystemExit(f"--rounds={args.rounds}: give 1 or more")
    for round_index in range(args.rounds):
        round_args = args if round_index == 0 else argparse.Namespace(**{**vars(args), "trace": None})
        for name in args.variants:
            merge_round(results, name, run_variant(name, round_args, env, work, groups_cache), env)
    add_derived(results, work.flops)
    gathers = gather_bandwidth(args, env, groups_cache)
    report = {
        "benchmark": "expert_stack",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": command_line(),
        "argv": sys.argv,
        "environment": environment(env),
        "config": {
            **{k: getattr(args, k) for k in ("layers", "experts", "tokens_per_expert", "hidden",
                                             "ffn", "warmup", "steps", "variants", "cpu_smoke",
                                             "nccl_max_ctas")},
            "tokens_per_rank": work.x.shape[0],
            "flops_per_step_per_gpu": work.flops,
            "etp": {"etp_size": env.world, "expert_etp_size": env.world},
            "rounds": args.rounds,
            "determinism": determinism,
        },
        "anchors_ms_2026_11_21": ANCHOR_MS,
        "results": results,
        "gather_bandwidth": gathers,
    }
    failed = [n for n, r in results.items() if r["status"].startswith("failed")]
    failed += [f"gather:{k}" for k, e in gathers["entries"].items() if e["status"].startswith("failed")]
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
    for line in overlap_lines(report["results"]):
        print(line)
    print(checks_line(report["results"]))
    print(f"{nccl_ctas_text(report)}.")
    print(f"\n{gather_table(report['gather_bandwidth'])}\n{gather_line(report['gather_bandwidth'])}")
    print(f"\nJSON: {out}")
    if args.benchmarks_md:
        append_benchmarks_md(args.benchmarks_md, report, table)
        print(f"appended to {args.benchmarks_md}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
