"""The same kernels in two torch.profiler traces of the same program, side by side.

Answers "which GEMMs run slower in variant B than in variant A, and is it where something
runs beside them?" Both traces must launch the same sequence of matching kernels (the same
model and steps, e.g. ``replicated`` and ``etp_default`` of
``tools/bench_expert_stack.py --trace``). Kernels whose name matches ``--match`` and that last
at least ``--min-us`` are paired by their order of start; for each pair, B's duration over
A's. The pairs are split by how much of B's kernel a copy (``gpu_memcpy``: the copy engines)
overlapped: more than ``--overlap`` of its time, or not. Prints the median ratio of each part
and the summed kernel time per step.

Example::

    python3 tools/diag/trace_kernels_compare.py $OUT/trace/replicated_trace.json \\
        $OUT/trace/etp_default_trace.json --steps 3 --json $OUT/gemm_compare.json
"""
from __future__ import annotations

import argparse
import bisect
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # trace_gaps beside this file

from trace_gaps import device_spans, load, provenance  # noqa: E402


def kernels(events: list[dict], pattern: str, min_us: float) -> list[tuple[float, float]]:
    """(start, duration) of the matching kernels, in start order."""
    rx = re.compile(pattern, re.IGNORECASE)
    found = [(float(e["ts"]), float(e.get("dur", 0.0))) for e in events
             if e.get("ph") == "X" and str(e.get("cat", "")).lower() == "kernel"
             and rx.search(str(e.get("name", ""))) and float(e.get("dur", 0.0)) >= min_us]
    return sorted(found)


def copies(events: list[dict]) -> list[tuple[float, float]]:
    return device_spans([e for e in events if str(e.get("cat", "")).lower() == "gpu_memcpy"])


def covered(start: float, end: float, spans: list[tuple[float, float]]) -> float:
    """Time of ``[start, end)`` inside the disjoint sorted ``spans``."""
    total, i = 0.0, max(0, bisect.bisect_left(spans, (start, start)) - 1)
    while i < len(spans) and spans[i][0] < end:
        total += max(0.0, min(end, spans[i][1]) - max(start, spans[i][0]))
        i += 1
    return total


def compare(path_a: str, path_b: str, pattern: str = "gemm|cutlass|nvjet|sm90", min_us: float = 50.0,
            overlap: float = 0.3, steps: int = 1) -> dict:
    a, b_events = kernels(load(path_a), pattern, min_us), load(path_b)
    b, spans = kernels(b_events, pattern, min_us), copies(b_events)
    if len(a) != len(b):
        raise ValueError(f"{len(a)} matching kernels in {path_a} but {len(b)} in {path_b}: the traces must run "
                         "the same program (same variant steps, same --match / --min-us)")
    beside, alone = [], []
    for (_, dur_a), (start_b, dur_b) in zip(a, b):
        share = covered(start_b, start_b + dur_b, spans) / dur_b if dur_b else 0.0
        (beside if share > overlap else alone).append(dur_b / dur_a if dur_a else float("nan"))

    def part(ratios):
        return {"kernels": len(ratios), "median_ratio": statistics.median(ratios) if ratios else None}

    return {"a": path_a, "b": path_b, "match": pattern, "min_us": min_us, "overlap": overlap,
            "kernels": len(a), "ms_per_step_a": sum(d for _, d in a) / steps / 1e3,
            "ms_per_step_b": sum(d for _, d in b) / steps / 1e3,
            "with_copy_beside": part(beside), "without_copy_beside": part(alone)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="baseline trace (.json or .json.gz)")
    p.add_argument("b", help="trace compared with it")
    p.add_argument("--match", default="gemm|cutlass|nvjet|sm90", help="kernel-name regex (case-insensitive)")
    p.add_argument("--min-us", type=float, default=50.0, help="ignore shorter kernels (GEMM set-up kernels)")
    p.add_argument("--overlap", type=float, default=0.3, help="share of a kernel a copy must cover to count as beside")
    p.add_argument("--steps", type=int, default=1, help="steps in each trace (for the per-step sums)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    r = compare(args.a, args.b, args.match, args.min_us, args.overlap, args.steps)
    print(f"{r['kernels']} matching kernels: {r['ms_per_step_a']:.2f} ms/step in A, {r['ms_per_step_b']:.2f} in B")
    for key, what in (("with_copy_beside", "with a copy beside"), ("without_copy_beside", "without")):
        part = r[key]
        ratio = "–" if part["median_ratio"] is None else f"{part['median_ratio']:.3f}"
        print(f"  {what}: {part['kernels']} kernels, median B/A {ratio}")
    if args.json:
        Path(args.json).write_text(json.dumps({"provenance": provenance(), **r}, indent=1))


if __name__ == "__main__":
    main()
