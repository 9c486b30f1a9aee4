"""Compares two ``etp-train --json`` runs of one recipe (with ETP and without) step by step.

Prints the largest loss difference, whether it is within ``--tolerance`` (relative, per
iteration), and a markdown table of ms/iter, TFLOP/s per rank, peak memory and parameter
bytes per rank for both runs; ``--out`` writes both runs and the verdict as one JSON file.

Example::

    python tools/compare_recipe_runs.py --etp etp.json --baseline plain.json --tolerance 0.02 \
        --command "torchrun --nproc-per-node 8 -m etp.train --recipe recipes/moe_h200x8.yaml" \
        --out benchmarks/moe_h200x8.json
"""
from __future__ import annotations

import argparse
import json
import sys


def compare(etp: dict, baseline: dict, tolerance: float) -> dict:
    if len(etp["losses"]) != len(baseline["losses"]):
        raise ValueError(f"the runs have {len(etp['losses'])} and {len(baseline['losses'])} iterations: "
                         "run both with the same train_iters")
    rel = [abs(a - b) / abs(b) for a, b in zip(etp["losses"], baseline["losses"])]
    worst = max(range(len(rel)), key=rel.__getitem__)
    return {"tolerance": tolerance, "max_rel_loss_diff": rel[worst], "at_iteration": worst + 1,
            "within_tolerance": rel[worst] <= tolerance,
            "first_loss": [etp["losses"][0], baseline["losses"][0]],
            "last_loss": [etp["losses"][-1], baseline["losses"][-1]]}


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
    parser.add_argument("--tolerance", type=float, default=0.02, help="relative loss difference per iteration")
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
            json.dump({"command": args.command, "verdict": verdict, "etp": etp, "baseline": baseline}, f, indent=1)
    return 0 if verdict["within_tolerance"] else 1


if __name__ == "__main__":
    sys.exit(main())
