"""``--trace DIR``: a torch.profiler trace of a few steps per variant on rank 0, and from its
device timeline the kernel time by class and how much collective time GEMMs overlapped
(read further with ``tools/diag/trace_gaps.py`` and ``tools/diag/trace_kernels_compare.py``).
"""
from __future__ import annotations

import functools
import json
import os

from .measure import timed_step

__all__ = ["kernel_overlap", "tracer"]

PROFILE_STEPS = 3
GEMM_MARKERS = ("gemm", "cutlass", "sm90", "nvjet", "groupedmm", "grouped")
# Finer kernel classes for the time breakdown (first match wins, in this order).
BREAKDOWN_CLASSES = (
    ("nccl", ("nccl",)),
    ("fp8_quantize", ("quantize", "cast_fp8", "amax", "colwise")),
    ("transpose", ("transpose",)),
    ("gemm", GEMM_MARKERS),
    ("copy", ("copy", "memcpy", "memset", "cat", "fill")),
    ("elementwise", ("elementwise", "vectorized", "silu", "swiglu", "mul", "add", "reduce", "sum_received")),
)


def breakdown_class(kernel_name: str) -> str:
    lowered = kernel_name.lower()
    for name, markers in BREAKDOWN_CLASSES:
        if any(m in lowered for m in markers):
            return name
    return "other"


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals) -> float:
    return sum(end - start for start, end in intervals)


def _intersection(a, b) -> float:
    """Total length where two sorted unions of disjoint intervals overlap (two pointers)."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def kernel_overlap(trace_path: str, steps: int) -> dict:
    """Kernel ms per step by class, device busy time, and NCCL time overlapped by GEMMs, from a
    chrome trace's device timeline (unions: concurrent kernels count once)."""
    with open(trace_path, encoding="utf-8") as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [e for e in events if e.get("ph") == "X" and str(e.get("cat", "")).lower() == "kernel"]
    spans: dict[str, list] = {}
    by_class: dict[str, float] = {}
    for e in kernels:
        start, dur = float(e["ts"]), float(e.get("dur", 0.0))
        cls = breakdown_class(e["name"])
        spans.setdefault(cls, []).append((start, start + dur))
        by_class[cls] = by_class.get(cls, 0.0) + dur / 1e3 / steps
    nccl, gemm = _merge(spans.get("nccl", [])), _merge(spans.get("gemm", []))
    every = _merge([iv for ivs in spans.values() for iv in ivs])
    return {
        "kernel_ms_per_step_by_class": dict(sorted(by_class.items(), key=lambda kv: -kv[1])),
        "busy_kernel_ms_per_step": _length(every) / 1e3 / steps,
        "nccl_kernel_ms_per_step": _length(nccl) / 1e3 / steps,
        "nccl_overlapped_by_gemm_ms_per_step": _intersection(nccl, gemm) / 1e3 / steps,
    }


def _profile(trace_dir: str, prep, work, env, name: str) -> dict | None:
    """``PROFILE_STEPS`` steps on every rank (they are collectives), recorded on rank 0."""
    from torch.profiler import ProfilerActivity, profile

    if env.rank != 0:
        for _ in range(PROFILE_STEPS):
            timed_step(prep, work, env)
        return None
    os.makedirs(trace_dir, exist_ok=True)
    path = os.path.join(trace_dir, f"{name}_trace.json")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(PROFILE_STEPS):
            timed_step(prep, work, env)
    prof.export_chrome_trace(path)
    return {"trace": path, "steps": PROFILE_STEPS, **kernel_overlap(path, PROFILE_STEPS)}


def tracer(trace_dir: str | None):
    """The ``tracer`` argument of ``measure_variant``: None without ``--trace``."""
    if not trace_dir:
        return None
    return functools.partial(_profile, trace_dir)
