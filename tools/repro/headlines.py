"""The headline figure of each step, read back from the JSON its runs wrote (never from the
log), for the runner's summary table. A missing or unreadable file gives a short reason."""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from bench_provenance import provenance

__all__ = ["checkpoint", "ep_dispatcher", "ep_moves", "expert_stack", "kernels", "memory_audit", "none",
           "pytest", "recipes", "steady"]

STEADY_FROM = 5  # the report's steady state: the mean over iterations 5 .. the last


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def none(step, folder: Path) -> str:
    return ""


def steady(report: dict, first: int = STEADY_FROM) -> dict | None:
    """Mean ms/iter and TFLOP/s per GPU over the logged iterations >= ``first`` of an
    ``etp-train --json`` report (``--log-interval 1``), with the peak allocated GiB.

    Example::

        steady(json.load(open("wide.json")))   # {"ms": 326.6, "tflops": 327.9, "iterations": 16, ...}
    """
    logged = [r for r in report.get("log", []) if r.get("iteration", 0) >= first and not r.get("profiled")]
    if not logged:
        return None
    return {"ms": statistics.fmean(r["ms_per_iter"] for r in logged),
            "tflops": statistics.fmean(r["tflops_per_rank"] for r in logged),
            "iterations": len(logged), "peak_gib": report.get("peak_allocated_gib")}


def recipes(step, folder: Path) -> str:
    parts = []
    for run in step.runs:
        report = _load(folder / f"{run.name}.json")
        figures = steady(report) if report else None
        parts.append(f"{run.name} " + ("–" if figures is None else
                                       f"{figures['ms']:.0f} ms {figures['tflops']:.0f} TFLOP/s"))
    return "; ".join(parts)


def expert_stack(step, folder: Path) -> str:
    report = _load(folder / "expert_stack.json")
    if not report:
        return "no JSON"
    results = report["results"]
    parts = [f"{name} {r['throughput_vs_replicated']:.3f}x" for name, r in results.items()
             if r.get("status") == "ok" and name != "replicated" and r.get("throughput_vs_replicated")]
    return "throughput vs replicated: " + ", ".join(parts)


def kernels(step, folder: Path) -> str:
    report = _load(folder / "kernels.json")
    if not report:
        return "no JSON"
    fractions = ", ".join(f"{k} {v['fraction_of_copy_bw']:.2f}" for k, v in report["targets"].items())
    line = f"of copy bw: {fractions}; {'exact' if report['correctness']['all_exact'] else 'MISMATCH'}"
    adam = _load(folder / "adam.json")
    if adam:
        rows = adam["rows"]
        line += (f"; AdamW step: etp {rows['etp_fused_adamw']['ms']:.1f} ms against torch + copy "
                 f"{rows['torch_fused_adamw_then_copy']['ms']:.1f} ms")
    return line


def ep_moves(step, folder: Path) -> str:
    report = _load(folder / "ep_moves.json")
    if not report:
        return "no JSON"
    moves = ("dispatch", "combine", "dispatch_bwd", "combine_bwd")
    parts = [f"{r['workload']} {r['backend']} " + "/".join(f"{r[m + '_x_a2a']:.2f}" for m in moves)
             for r in report.get("rows", []) if "dispatch_x_a2a" in r]
    return "x all-to-all of the same bytes (dispatch/combine/their backwards): " + ", ".join(parts)


def ep_dispatcher(step, folder: Path) -> str:
    report = _load(folder / "ep_dispatcher.json")
    if not report:
        return "no JSON"
    parts = [f"{r['workload']} {r['speedup_vs_megatron']:.2f}x" for r in report.get("rows", [])
             if "speedup_vs_megatron" in r]
    return "x megatron alltoall: " + ", ".join(parts)


def memory_audit(step, folder: Path) -> str:
    parts = []
    for run in step.runs:
        audit = _load(folder / f"{run.name}_audit.json")
        try:
            peak = audit["ranks"][0]["peak"]
            parts.append(f"{run.name} {peak['measured'] / 2**30:.1f} vs {peak['predicted'] / 2**30:.1f} GiB "
                         f"({peak['measured'] / peak['predicted'] - 1:+.1%})")
        except (TypeError, KeyError, IndexError, ZeroDivisionError):
            parts.append(f"{run.name} –")
    return "measured vs predicted peak: " + "; ".join(parts)


def checkpoint(step, folder: Path) -> str:
    """Each resumed run's losses against the saving run's over the same iterations; writes
    ``compare.json`` (with the runner's provenance) beside them."""
    saved = _load(folder / "saved.json")
    if not saved:
        return "no JSON of the saving run"
    reference = {r["iteration"]: r["loss"] for r in saved.get("log", [])}
    compare = {}
    for run in step.runs[1:]:
        resumed = _load(folder / f"{run.name}.json")
        pairs = [(r["loss"], reference[r["iteration"]]) for r in (resumed or {}).get("log", [])
                 if r["iteration"] in reference]
        compare[run.name] = ({"iterations": len(pairs), "first_iteration_rel_diff": abs(pairs[0][0] / pairs[0][1] - 1),
                              "max_rel_diff": max(abs(a / b - 1) for a, b in pairs)} if pairs else "no result")
    (folder / "compare.json").write_text(json.dumps({"provenance": provenance(), "resumed_vs_saved": compare},
                                                    indent=1))
    return "max rel loss diff after resume: " + ", ".join(
        f"{name} {c['max_rel_diff']:.1e}" if isinstance(c, dict) else f"{name} –" for name, c in compare.items())


def pytest(step, folder: Path) -> str:
    try:
        text = (folder / f"{step.runs[0].name}.log").read_text(errors="replace")
    except OSError:
        return "no log"
    outcome = re.compile(r"\b(passed|failed|errors?|skipped|deselected|no tests ran)\b.* in [0-9.]+s")
    found = [line.strip(" =") for line in text.splitlines() if outcome.search(line)]
    return found[-1] if found else "no pytest summary"
