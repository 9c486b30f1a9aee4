"""Compares two ``etp-train --json`` runs of one recipe (with ETP and without, or FP8 gathers
and bf16) step by step.

Prints whether the mean loss of the last ``--window`` iterations agrees within ``--tolerance``
(relative), the per-iteration and moving-average differences, and a markdown table of ms/iter,
TFLOP/s per rank, peak memory and parameter bytes per rank for both runs; ``--out`` writes both
runs and the verdict as one JSON file, ``--plot`` both loss curves (log scale) as a PNG, with
``--floor`` drawn as the lowest loss the data allows (``tools/make_tiny_corpus.py`` prints it).

Example::

    python tools/compare_recipe_runs.py --etp etp.json --baseline plain.json --tolerance 0.03 \
        --command "torchrun --nproc-per-node 8 -m etp.train --recipe recipes/moe_flagship.yaml" \
        --out compare.json
    python tools/compare_recipe_runs.py --etp fp8.json --baseline bf16.json --labels "FP8 gathers,bf16 gathers" \
        --window 20 --tolerance 0.01 --plot losses.png --floor 0.1787
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


def plot(etp: dict, baseline: dict, labels: tuple[str, str], path: str, floor: float | None = None,
         title: str = "") -> None:
    """Both runs' losses per iteration on a log scale (and ``floor``, dashed) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run, label, style in ((etp, labels[0], "-"), (baseline, labels[1], "--")):
        ax.plot(range(1, len(run["losses"]) + 1), run["losses"], style, label=label, linewidth=1)
    if floor is not None:
        ax.axhline(floor, color="gray", linestyle=":", linewidth=1, label=f"the data's entropy ({floor:.4f})")
    ax.set_yscale("log")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(etp: dict, baseline: dict, labels: tuple[str, str] = ("ETP", "without ETP")) -> str:
    def row(name, run):
        gib = run["param_bytes_per_rank"]["after_etp"] / 2**30
        return (f"| {name} | {run['etp']['etp_size']}/{run['etp']['expert_etp_size']} | {run['losses'][-1]:.4f} | "
                f"{run['ms_per_iter']:.1f} | {run['tflops_per_rank']:.1f} | {run['peak_allocated_gib']:.2f} | "
                f"{run['peak_reserved_gib']:.2f} | {gib:.2f} |")

    head = ("| run | ETP dense/expert | final loss | ms/iter | TFLOP/s per GPU | peak alloc GiB | "
            "peak reserved GiB | param GiB/rank |\n|---|---|---|---|---|---|---|---|")
    return "\n".join([head, row(labels[0], etp), row(labels[1], baseline)])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--etp", required=True)
    parser.add_argument("--baseline", required=True)
    parser.add_argument("--tolerance", type=float, default=0.03,
                        help="relative difference of the mean loss of the last --window iterations")
    parser.add_argument("--window", type=int, default=10, help="iterations the verdict's mean loss covers")
    parser.add_argument("--labels", default="ETP,without ETP", help="the two runs' names, comma-separated")
    parser.add_argument("--plot", metavar="PNG", help="write both loss curves here")
    parser.add_argument("--floor", type=float, help="with --plot: the lowest loss the data allows, drawn dashed")
    parser.add_argument("--command", default="", help="the command line, recorded beside the figures")
    parser.add_argument("--out", help="write both runs and the verdict here")
    args = parser.parse_args(argv)
    labels = tuple(args.labels.split(","))
    if len(labels) != 2:
        parser.error(f"--labels {args.labels!r}: give two names separated by a comma")
    if args.window < 1:
        parser.error(f"--window {args.window}: give a positive number of iterations")
    with open(args.etp) as f:
        etp = json.load(f)
    with open(args.baseline) as f:
        baseline = json.load(f)
    verdict = compare(etp, baseline, args.tolerance, args.window)
    print(json.dumps(verdict))
    print(table(etp, baseline, labels))
    if args.plot:
        plot(etp, baseline, labels, args.plot, args.floor, args.command)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"provenance": provenance(), "command": args.command, "verdict": verdict, "etp": etp,
                       "baseline": baseline}, f, indent=1)
    return 0 if verdict["within_tolerance"] else 1


if __name__ == "__main__":
    sys.exit(main())
