"""``reproduce.py --check``: each headline figure of a fresh run against the figure
BENCHMARKS.md reports for the same GPU kind, one table, and a verdict.

[Note: the regression check]
BENCHMARKS.md cites a JSON file of ``benchmarks/`` beside every figure it reports. A step's run
names the files its figures were reported from, per GPU kind (``Run.reported``: ``{"1xh200":
"kernels_1xh200_d968ef1.json"}``), and a reader per step pulls comparable figures out of a JSON
(``FIGURES``): the same reader applied to the fresh JSON and to the reported one, so the two
sides can only differ in what was measured. A figure is

* ``higher`` or ``lower`` is better (a fraction of copy bandwidth, milliseconds): the check fails
  when today's is more than ``TOLERANCE`` slower than the reported one;
* ``exact`` (a correctness count, a pass / fail): the check fails when it changed at all.

A figure reported but not measured today (a row the tree no longer has) is listed and does not
fail; a run with no reported file for this GPU kind has nothing to compare and says so. The GPU
kind is ``{count}x{model}`` as ``benchmarks/`` names it (``1xh200``, ``4xh100``).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TOLERANCE", "Comparison", "FIGURES", "check_table", "compare_run", "gpu_kind"]

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
#: A speed figure may be this much slower than the reported one before the check fails.
TOLERANCE = 0.10


def gpu_kind(gpu_name: str, count: int) -> str:
    """``("NVIDIA H200", 1)`` -> ``"1xh200"``: the tag ``benchmarks/`` file names carry.

    Example::

        gpu_kind("NVIDIA H100 80GB HBM3", 4)   # '4xh100'
    """
    model = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", gpu_name.upper())
    return f"{count}x{(model.group(1) if model else gpu_name).lower()}"


def _kernels(report: dict) -> dict:
    figures = {f"{name} (of copy bw)": (row["fraction_of_copy_bw"], "higher")
               for name, row in report.get("targets", {}).items()}
    if "correctness" in report:
        figures["all kernels exact"] = (bool(report["correctness"].get("all_exact")), "exact")
    return figures


def _adam(report: dict) -> dict:
    rows = report.get("rows", {})
    return {f"{name} ms": (rows[name]["ms"], "lower") for name in ("etp_fused_adamw", "torch_fused_adamw_then_copy")
            if name in rows}


def _cross_entropy(report: dict) -> dict:
    figures = {}
    for row in report.get("rows", []):
        shape = f"s{row['s']} b{row['b']} v{row['vocab']}"
        figures[f"etp loss {shape} ms"] = (row["etp"]["ms"], "lower")
        figures[f"megatron loss {shape} ms"] = (row["megatron"]["ms"], "lower")
    return figures


def _recipe(report: dict) -> dict:
    """An etp-train ``--json`` report: steady ms/iter (iterations 5 on, as the report's tables)."""
    logged = [r for r in report.get("log", []) if r.get("iteration", 0) >= 5 and not r.get("profiled")]
    if not logged:
        return {}
    return {"ms/iter": (sum(r["ms_per_iter"] for r in logged) / len(logged), "lower")}


def _torchtitan(report: dict) -> dict:
    """``tools/bench_torchtitan.py``: each run's median ms/step (etp-train and its peers, one call)."""
    return {f"{name} ms/step": (run["ms_per_step_median"], "lower") for name, run in report.get("runs", {}).items()
            if run.get("ms_per_step_median") is not None}


#: JSON reader of each run kind (a run's name, or its step's name up to the GPU count).
FIGURES = {"kernels": _kernels, "adam": _adam, "cross_entropy": _cross_entropy, "recipe": _recipe,
           "torchtitan": _torchtitan}


@dataclass
class Comparison:
    """One figure: reported and today's value, today's speed against the report, the verdict."""

    run: str
    figure: str
    reported: object
    today: object
    speed: float | None  # > 1: today is faster
    verdict: str        # ok | SLOWER | CHANGED | not measured today | new

    @property
    def failed(self) -> bool:
        return self.verdict in ("SLOWER", "CHANGED")


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def compare_figures(run: str, reported: dict, today: dict) -> list[Comparison]:
    """Every figure of either side, compared ([Note: the regression check])."""
    rows = []
    for figure in sorted(set(reported) | set(today)):
        if figure not in today:
            rows.append(Comparison(run, figure, reported[figure][0], None, None, "not measured today"))
            continue
        if figure not in reported:
            rows.append(Comparison(run, figure, None, today[figure][0], None, "new"))
            continue
        (old, better), (new, _) = reported[figure], today[figure]
        if better == "exact":
            rows.append(Comparison(run, figure, old, new, None, "ok" if old == new else "CHANGED"))
            continue
        speed = (new / old if better == "higher" else old / new) if old and new else None
        slower = speed is None or speed < 1 - TOLERANCE
        rows.append(Comparison(run, figure, old, new, speed, "SLOWER" if slower else "ok"))
    return rows


def compare_run(run, fresh_json: Path, kind: str, reader) -> list[Comparison] | str:
    """The comparisons of one run's fresh JSON with the file reported for ``kind``, or why none."""
    reported_name = run.reported.get(kind)
    if reported_name is None:
        return f"no figure reported for {kind}"
    reported = _load(BENCHMARKS / reported_name)
    if reported is None:
        return f"benchmarks/{reported_name} is missing or unreadable"
    today = _load(fresh_json)
    if today is None:
        return f"no fresh JSON ({fresh_json.name})"
    return compare_figures(run.name, reader(reported), reader(today))


def _show(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def check_table(steps, out: Path, kind: str) -> tuple[str, bool]:
    """The table of every checked step's figures, and whether the check failed."""
    lines = [f"| step | run | figure | reported ({kind}) | today | today's speed | verdict |",
             "|---|---|---|---:|---:|---:|---|"]
    failed = False
    for step in steps:
        for run in step.runs:
            reader = FIGURES.get(run.figures)
            if reader is None:
                continue
            found = compare_run(run, out / step.name / f"{run.name}.json", kind, reader)
            if isinstance(found, str):
                lines.append(f"| {step.name} | {run.name} | – | – | – | – | {found} |")
                failed |= found.startswith("no fresh JSON") and kind in run.reported
                continue
            for c in found:
                speed = "–" if c.speed is None else f"{c.speed:.2f}x"
                lines.append(f"| {step.name} | {run.name} | {c.figure} | {_show(c.reported)} | {_show(c.today)} | "
                             f"{speed} | {c.verdict} |")
                failed |= c.failed
    return "\n".join(lines), failed
