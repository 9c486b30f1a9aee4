"""Where a GPU step waits on the host: idle gaps of a torch.profiler chrome trace.

Prints (and with ``--json`` writes) for one trace:

* the device's busy time (union of every kernel and copy) and its idle gaps longer than
  ``--min-gap-us``, each with the host operations open when the gap began (the innermost
  ``cpu_op`` / ``user_annotation`` spans: what the host was doing instead of launching);
* the CUDA runtime calls by total host time: a ``cudaStreamSynchronize`` or a device-to-host
  ``cudaMemcpyAsync`` there is a host sync inside the step;
* with ``--stream-waits``: where the GEMM stream waits while other streams work (a gather
  the next GEMM waits for shows as a gap with a copy beside it and a GEMM next).

Example::

    python3 tools/diag/trace_gaps.py $OUT/trace/replicated_fp8_trace.json --top 15
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: bench_provenance

from bench_provenance import provenance  # noqa: E402 - puts this checkout's etp first on the path

from etp.train.profile import interval_union  # noqa: E402 - the one interval union


def load(path: str) -> list[dict]:
    """The events of a chrome trace (``.json`` or gzipped ``.json.gz``)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f).get("traceEvents", [])


def device_spans(events: list[dict]) -> list[tuple[float, float]]:
    return interval_union([(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events
                           if e.get("ph") == "X" and str(e.get("cat", "")).lower() in ("kernel", "gpu_memcpy",
                                                                                     "gpu_memset")])


def host_ops_at(events: list[dict], t: float) -> list[str]:
    """Host spans open at time ``t``, outermost first (ProfilerStep, labels, aten ops)."""
    open_ = [e for e in events if e.get("ph") == "X" and str(e.get("cat", "")) in ("cpu_op", "user_annotation")
             and float(e["ts"]) <= t <= float(e["ts"]) + float(e.get("dur", 0.0))]
    return [e["name"] for e in sorted(open_, key=lambda e: (float(e["ts"]), -float(e.get("dur", 0.0))))]


def analyse(path: str, min_gap_us: float, top: int) -> dict:
    events = load(path)
    spans = device_spans(events)
    gaps = [(spans[i][1], spans[i + 1][0] - spans[i][1]) for i in range(len(spans) - 1)
            if spans[i + 1][0] - spans[i][1] >= min_gap_us]
    runtime: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("ph") == "X" and str(e.get("cat", "")) == "cuda_runtime":
            runtime[e["name"]][0] += float(e.get("dur", 0.0))
            runtime[e["name"]][1] += 1
    busy = sum(b - a for a, b in spans)
    window = (spans[-1][1] - spans[0][0]) if spans else 0.0
    return {
        "trace": path,
        "device_window_us": window,
        "device_busy_us": busy,
        "idle_us": window - busy,
        "idle_in_gaps_over_min_us": sum(g for _, g in gaps),
        "gaps": [{"at_us": at - spans[0][0], "gap_us": g, "host": host_ops_at(events, at)[-4:]}
                 for at, g in sorted(gaps, key=lambda x: -x[1])[:top]],
        "runtime_calls": [{"name": n, "total_us": t, "count": c}
                          for n, (t, c) in sorted(runtime.items(), key=lambda kv: -kv[1][0])[:top]],
    }


def compute_stream_waits(events: list[dict], pattern: str = "gemm|cutlass|nvjet|sm90", min_gap_us: float = 5.0,
                         steps: int = 1, end_slack_us: float = 8.0) -> dict:
    """Where the compute stream (the one running the most kernels matching ``pattern``) waits
    while the device is not idle: its gaps of at least ``min_gap_us``, by what runs next on it
    ("gemm" for a matching kernel, else the kernel's name) and which other streams were busy
    meanwhile ("copy" for a copy-engine copy on them, "kernel", or nothing). A compute-stream
    gap with a copy on the gather stream and a GEMM next is a gather the GEMM waited for.

    ``ended_by`` sums the gaps that end within ``end_slack_us`` of a copy on another stream
    ending, by that copy's name and stream: a compute stream that resumes the moment a
    ``Memcpy DtoD`` elsewhere finishes was held by that copy (a device-local copy runs on the
    SMs: [Note: the own-rows copy takes the SMs] in etp/transport/copy_engine.py)."""
    rx = re.compile(pattern, re.IGNORECASE)
    work = [e for e in events if e.get("ph") == "X" and str(e.get("cat", "")).lower() in ("kernel", "gpu_memcpy")]
    counts: dict = defaultdict(int)
    for e in work:
        if rx.search(str(e.get("name", ""))):
            counts[e.get("tid")] += 1
    if not counts:
        return {"compute_stream": None, "busy_ms_per_step": 0.0, "idle_ms_per_step": 0.0, "waits": [], "ended_by": []}
    compute = max(counts, key=counts.get)
    mine = sorted((e for e in work if e.get("tid") == compute), key=lambda e: float(e["ts"]))
    spans = interval_union([(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in mine])
    starts = [float(e["ts"]) for e in mine]
    others = [e for e in work if e.get("tid") != compute]
    copy_ends = sorted((float(e["ts"]) + float(e.get("dur", 0.0)), e) for e in others
                       if str(e.get("cat")).lower() == "gpu_memcpy")
    copy_end_times = [t for t, _ in copy_ends]
    waits: dict = defaultdict(lambda: [0, 0.0])
    ended_by: dict = defaultdict(lambda: [0, 0.0])
    for end, nxt in ((a[1], b[0]) for a, b in zip(spans, spans[1:])):
        if nxt - end < min_gap_us:
            continue
        after = mine[bisect.bisect_left(starts, nxt)]
        beside = [e for e in others if float(e["ts"]) < nxt and float(e["ts"]) + float(e.get("dur", 0.0)) > end]
        next_kind = "gemm" if rx.search(str(after.get("name", ""))) else str(after.get("name", ""))[:40]
        streams = sorted({f"{e.get('tid')}:{'copy' if str(e.get('cat')).lower() == 'gpu_memcpy' else 'kernel'}"
                          for e in beside})
        entry = waits[(next_kind, ", ".join(streams) or "nothing")]
        entry[0] += 1
        entry[1] += nxt - end
        i = bisect.bisect_left(copy_end_times, nxt - end_slack_us)
        if i < len(copy_ends) and copy_end_times[i] <= nxt + end_slack_us:
            copy = copy_ends[i][1]
            held = ended_by[(str(copy.get("name", ""))[:40], copy.get("tid"))]
            held[0] += 1
            held[1] += nxt - end
    busy = sum(b - a for a, b in spans)
    window = spans[-1][1] - spans[0][0]
    return {"compute_stream": compute, "busy_ms_per_step": busy / steps / 1e3,
            "idle_ms_per_step": (window - busy) / steps / 1e3,
            "waits": [{"next": k[0], "beside": k[1], "gaps": n, "ms_per_step": t / steps / 1e3}
                      for k, (n, t) in sorted(waits.items(), key=lambda kv: -kv[1][1])],
            "ended_by": [{"copy": k[0], "stream": k[1], "gaps": n, "ms_per_step": t / steps / 1e3}
                         for k, (n, t) in sorted(ended_by.items(), key=lambda kv: -kv[1][1])]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("traces", nargs="+")
    p.add_argument("--min-gap-us", type=float, default=20.0)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--json", default=None, help="write every analysis here")
    p.add_argument("--stream-waits", action="store_true",
                   help="also: where the GEMM stream waits while other streams work (compute_stream_waits)")
    p.add_argument("--steps", type=int, default=1, help="steps in each trace (for per-step figures)")
    args = p.parse_args(argv)
    results = []
    for path in args.traces:
        r = analyse(path, args.min_gap_us, args.top)
        results.append(r)
        print(f"{path}: device window {r['device_window_us'] / 1e3:.2f} ms, busy {r['device_busy_us'] / 1e3:.2f} ms, "
              f"idle {r['idle_us'] / 1e3:.2f} ms ({r['idle_in_gaps_over_min_us'] / 1e3:.2f} ms in gaps "
              f">= {args.min_gap_us:.0f} us)")
        for g in r["gaps"]:
            print(f"  gap {g['gap_us']:8.1f} us at {g['at_us'] / 1e3:8.2f} ms  host: {' > '.join(g['host'])[:160]}")
        for c in r["runtime_calls"]:
            print(f"  runtime {c['name'][:40]:40s} {c['total_us'] / 1e3:8.2f} ms  x{c['count']}")
        if args.stream_waits:
            w = r["stream_waits"] = compute_stream_waits(load(path), steps=args.steps)
            print(f"  compute stream {w['compute_stream']}: busy {w['busy_ms_per_step']:.2f} ms/step, "
                  f"idle {w['idle_ms_per_step']:.2f} ms/step")
            for x in w["waits"][: args.top]:
                print(f"    {x['ms_per_step']:6.2f} ms/step in {x['gaps']:4d} gaps before {x['next'][:30]:30s} "
                      f"beside: {x['beside']}")
            for x in w["ended_by"][: args.top]:
                print(f"    {x['ms_per_step']:6.2f} ms/step in {x['gaps']:4d} gaps ending as {x['copy'][:30]} "
                      f"on stream {x['stream']} ends")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"provenance": provenance(), "traces": results}, f, indent=1)


if __name__ == "__main__":
    main()
