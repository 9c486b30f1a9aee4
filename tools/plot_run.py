#!/usr/bin/env python
"""Plots an etp-train run's metrics stream (``run.jsonl``, [Note: the metrics stream]) to PNG:
the loss (and validation loss), the throughput (tokens/s and TFLOP/s per rank) and, for MoE
recipes, the router's auxiliary losses and the expert load (the most loaded expert's tokens
against the mean, per layer; [Note: MoE metrics]). A stream cut short by a crash plots what it
holds.

Example::

    python3 tools/plot_run.py run.jsonl --out run.png
    python3 tools/plot_run.py run.jsonl other.jsonl --labels etp,baseline --out both.png
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from etp.train.metrics import read_stream  # noqa: E402

#: (panel title, fields plotted on it); a panel none of the runs has a field of is left out.
PANELS = (("loss", ("loss", "validation_loss")), ("throughput", ("tokens_per_s", "tflops_per_rank")),
          ("router losses (mean over MoE layers)",
           ("load_balancing_loss", "seq_load_balancing_loss", "global_load_balancing_loss", "z_loss")))
#: etp.train.moe_metrics' per-layer ratio, ``moe/expert_load_max_over_mean_layer_{i}``.
LOAD_PREFIX = "moe/expert_load_max_over_mean_layer_"


def _series(records: list[dict], field: str) -> tuple[list, list]:
    points = [(r["iteration"], r[field]) for r in records if isinstance(r.get(field), (int, float))]
    return [x for x, _ in points], [y for _, y in points]


def plot(streams: dict[str, list[dict]]):
    """The figure of ``{label: records}``; each line's data is exactly its records' values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    load_fields = sorted({k for records in streams.values() for r in records for k in r if k.startswith(LOAD_PREFIX)},
                         key=lambda k: int(k.removeprefix(LOAD_PREFIX)))  # layer 10 after layer 9
    panels = [(title, fields) for title, fields in PANELS
              if any(_series(records, f)[0] for records in streams.values() for f in fields)]
    if load_fields:
        panels.append(("expert load (max / mean tokens per expert)", tuple(load_fields)))
    figure, axes = plt.subplots(len(panels) or 1, 1, figsize=(8, 3 * max(1, len(panels))), squeeze=False)
    for axis, (title, fields) in zip(axes[:, 0], panels):
        for label, records in streams.items():
            for field in fields:
                xs, ys = _series(records, field)
                if xs:
                    name = f"layer {field.removeprefix(LOAD_PREFIX)}" if field.startswith(LOAD_PREFIX) else field
                    axis.plot(xs, ys, label=f"{label} {name}" if len(streams) > 1 else name)
        axis.set_title(title)
        axis.set_xlabel("iteration")
        axis.legend(fontsize="small")
    figure.tight_layout()
    return figure


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("streams", nargs="+", type=Path, help="etp-train metrics streams (run.jsonl)")
    p.add_argument("--labels", help="comma-separated labels, one per stream (default: the file names)")
    p.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = p.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [s.stem for s in args.streams]
    if len(labels) != len(args.streams):
        p.error(f"--labels has {len(labels)} labels for {len(args.streams)} streams")
    streams = {}
    for label, path in zip(labels, args.streams):
        if not path.exists():
            p.error(f"{path}: no such stream (etp-train --json RUN.json writes RUN.jsonl)")
        streams[label] = read_stream(path)[0]
    plot(streams).savefig(args.out, dpi=100)
    print(f"plot_run: wrote {args.out} ({', '.join(f'{k}: {len(v)} records' for k, v in streams.items())})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
