"""Compares two ``etp-train --json`` runs of one recipe (with ETP and without) step by step.

Prints whether the mean loss of the last 10 iterations agrees within ``--tolerance``
(relative), the per-iteration and moving-average differences, and a markdown table of ms/iter, TFLOP/s per rank, peak memory and parameter
bytes per rank for both runs; ``--out`` writes both runs and the verdict as one JSON file.

Example::

    python tools/compare_recipe_runs.py --etp etp.json --baseline plain.json --tolerance 0.03 \
        --command "torchrun --nproc-per-node 8 -m etp.megatron.train --recipe recipes/moe_flagship.yaml" \
        --out compare.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/: bench_provenance

from bench_provenance import provenance  # noqa: E402 - puts this checkout's etp first on the path


def _moving_average(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
            for i in range(len(values))]


def compare(etp: dict, baseline: dict, tolerance: float, window: int = 10) -> dict:
    """The verdict is on the mean loss of the last ``window`` iterations (relative
    difference <= ``tolerance``): bf16 runs that start from the same weights and data drift
    apart step by step (reduction order), so single iterations, especially around loss
    spikes, differ by more than the training outcome does. Per-iteration and moving-average
    differences are reported beside it."""
    a, b = etp["losses"], baseline["losses"]
    if len(a) != len(b):
        raise ValueError(f"the runs have {len(a)} and {len(b)} iterations: run both with the same train_iters")
    rel = [abs(x - y) / abs(y) for x, y in zip(a, b)]
    worst = max(range(len(rel)), key=rel.__getitem__)
    smooth = [abs(x - y) / abs(y) for x, y in zip(_moving_average(a, 5), _moving_average(b, 5))]
    tail_a, tail_b = sum(a[-window:]) / len(a[-window:]), sum(b[-window:]) / len(b[-window:])
    tail = abs(tail_a - tail_b) / abs(tail_b)
    return {"tolerance": tolerance, "window": window, "tail_mean_loss": [tail_a, tail_b],
            "tail_rel_diff": tail, "within_tolerance": tail <= tolerance,
            "max_rel_loss_diff": rel[worst], "at_iteration": worst + 1,
            "max_rel_diff_moving_average_5": max(smooth),
            "first_loss": [a[0], b[0]], "last_loss": [a[-1], b[-1]]}


def table(etp: dict, baseline: dict) -> str:
    def row(name, run):
        gib = run["param_bytes_per_rank"]["after_etp"] / 2**30
        return (f"| {name} | {run['etp']['etp_size']}/{run['etp']['expert_etp_size']} | {run['losses'][-1]:.4f} | "
                f"{run['ms_per_iter']:.1f} | {run['tflops_per_rank']:.1f} | {run['peak_allocated_gib']:.2f} | "
                f"{run['peak_reserved_gib']:.2f} | {gib:.2f} |")

    head = ("| run | ETP dense/expert | final loss | ms/iter | TFLOP/s per GPU | peak alloc GiB | "
            "peak reserved GiB | param GiB/rank |\n|---|---|---|---|---|---|---|---|")
    return "\n".join([head, row("ETP", etp), row("without ETP", baseline)])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--etp", required=True)
    parser.add_argument("--baseline", required=True)
    parser.add_argument("--tolerance", type=float, default=0.03,
                        help="relative difference of the mean loss of the last 10 iterations")
    parser.add_argument("--command", default="", help="the command line, recorded beside the figures")
    parser.add_argument("--out", help="write both runs and the verdict here")
    args = parser.parse_args(argv)
    with open(args.etp) as f:
        etp = json.load(f)
    with open(args.baseline) as f:
        baseline = json.load(f)
    verdict = compare(etp, baseline, args.tolerance)
    print(json.dumps(verdict))
    print(table(etp, baseline))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"provenance": provenance(), "command": args.command, "verdict": verdict, "etp": etp,
                       "baseline": baseline}, f, indent=1)
    return 0 if verdict["within_tolerance"] else 1


if __name__ == "__main__":
    sys.exit(main())
