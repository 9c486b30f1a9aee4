#!/usr/bin/env python
"""The expert stack, fwd + bwd, side by side: replicated, DDP, FSDP2 and ETP (BENCHMARKS.md,
"Expert stack against its peers").

Workload: ``--layers`` residual blocks ``x = x + experts(x, counts)`` of etp's grouped SwiGLU
experts, ``--experts`` experts per rank with ``--tokens-per-expert`` tokens each (sorted by
expert), hidden ``--hidden``, ffn ``--ffn``, bf16; each rank draws its own tokens (data
parallel) and holds the same full weights before sharding. Defaults: 8 layers, 16 experts x
2048 tokens (T = 32768 per rank), hidden 4096, ffn 1536: 604 MB of bf16 weights per layer.
ETP variants shard over the whole world (ETP = world size).

Variants (one table, ``tools/expert_stack/variants.py``; ``--list`` prints it): ``replicated``
(the compute ceiling), ``replicated_fp8``, ``ddp``, ``fsdp2``, ``etp_sync``, ``etp_nccl``,
``etp_default``, ``etp_fp8``, ``etp_fp8_wgrad``, ``etp_graphed``, ``etp_fp8_wgrad_graphed``.
A variant the machine cannot run is reported as skipped (CUDA graphs and FSDP2 on CPU).

Reported per variant: the mean step ms over every timed step of every round (``--rounds``
interleaves the variant list; each round's mean and the rounds' spread beside it), throughput
against ``replicated``, TFLOP/s per GPU, peak allocated memory, bytes received per rank per
step (analytic), and a correctness check (output sum and mean-gradient norm, equal across the
bf16 variants up to rounding). Then the gather bandwidth of the largest weight (etp's gather
against a raw NCCL all-gather of the same bytes). JSON to ``--out`` with a ``provenance``
block; tables on rank 0's stdout.

Example::

    torchrun --standalone --nproc-per-node 2 tools/bench_expert_stack.py --rounds 2 --out stack.json
    torchrun --standalone --nproc-per-node 2 tools/bench_expert_stack.py --variants replicated,etp_default
    torchrun --standalone --nproc-per-node 2 tools/bench_expert_stack.py --cpu-smoke   # gloo, checks the script
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/: expert_stack, bench_provenance

from bench_provenance import provenance  # noqa: E402 - puts this checkout's etp first on the path
from expert_stack.gathers import gather_bandwidth  # noqa: E402
from expert_stack.measure import measure_variant, merge_round  # noqa: E402
from expert_stack.model import init_distributed, make_workload  # noqa: E402
from expert_stack.report import add_derived, checks_line, gather_table, variants_table  # noqa: E402
from expert_stack.trace import tracer  # noqa: E402
from expert_stack.variants import DEFAULT_VARIANTS, VARIANTS  # noqa: E402

GPU_SHAPE = dict(layers=8, experts=16, tokens_per_expert=2048, hidden=4096, ffn=1536, warmup=5, steps=20)
SMOKE_SHAPE = dict(layers=2, experts=4, tokens_per_expert=8, hidden=32, ffn=16, warmup=1, steps=2)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for key, value in GPU_SHAPE.items():
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None, help=f"default {value}")
    p.add_argument("--rounds", type=int, default=1, help="run the variant list N times, interleaved")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="comma-separated names (see --list)")
    p.add_argument("--gather-reuse", choices=("chain", "pass", "step"), default="chain",
                   help="ETPConfig.gather_reuse of every ETP variant")
    p.add_argument("--trace", default=None, metavar="DIR", help="a profiler trace of 3 steps per variant, rank 0")
    p.add_argument("--out", default="bench_expert_stack.json", help="JSON path")
    p.add_argument("--cpu-smoke", action="store_true", help="gloo on CPU, float32, tiny shapes: checks the script")
    p.add_argument("--list", action="store_true", help="print the variants and exit")
    args = p.parse_args(argv)
    for key, value in (SMOKE_SHAPE if args.cpu_smoke else GPU_SHAPE).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
        if getattr(args, key) < (0 if key == "warmup" else 1):
            p.error(f"--{key.replace('_', '-')}={getattr(args, key)}: too small")
    if args.rounds < 1:
        p.error(f"--rounds={args.rounds}: give 1 or more")
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown or not names:
        p.error(f"--variants: unknown {unknown}; choose from {','.join(VARIANTS)}")
    args.variants = [v for v in VARIANTS if v in names]  # the table's order keeps runs comparable
    return args


def run(args) -> dict:
    env = init_distributed(args.cpu_smoke)
    work = make_workload(args, env)
    groups_cache: dict = {}
    results: dict = {}
    for round_index in range(args.rounds):
        trace = tracer(args.trace) if round_index == 0 else None
        for name in args.variants:
            if env.rank == 0:
                print(f"[bench_expert_stack] round {round_index + 1}/{args.rounds}: {name}", flush=True)
            merge_round(results, name, measure_variant(name, args, env, work, groups_cache, trace))
    add_derived(results, work.flops)
    shape = {k: getattr(args, k) for k in (*GPU_SHAPE, "rounds", "gather_reuse", "cpu_smoke")}
    return {
        "benchmark": "expert_stack",
        "provenance": provenance(),
        "config": {**shape, "variants": args.variants, "tokens_per_rank": work.x.shape[0],
                   "flops_per_step_per_gpu": work.flops, "etp_size": env.world},
        "variants": {name: VARIANTS[name].what for name in args.variants},
        "results": results,
        "gather_bandwidth": gather_bandwidth(args, env, groups_cache),
        "rank": env.rank,
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.list:
        for name, variant in VARIANTS.items():
            print(f"{name:24s} {variant.what}")
        return 0
    report = run(args)
    failed = [n for n, r in report["results"].items() if r["status"].startswith("failed")]
    if report.pop("rank") == 0:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        print(f"\n{report['provenance']['command']}\n\n{variants_table(report['results'])}\n")
        print(checks_line(report["results"]))
        print(f"\n{gather_table(report['gather_bandwidth'])}\n\nJSON: {out}")
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
