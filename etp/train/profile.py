"""Where an iteration's time goes: a torch-profiler Chrome trace classified per iteration.

[Note: time breakdown]
``breakdown(trace)`` reads a Chrome trace written by ``torch.profiler`` (``export_chrome_trace``)
and sums the device time of every GPU kernel / memcpy / memset into one class:

* ``communication``: NCCL kernels, peer-to-peer copies, kernels under etp's collective
  labels (``etp::all_gather``, ``etp::reduce_scatter``, ``etp::all_reduce``);
* ``moe`` (first part): non-GEMM kernels under ``etp::moe_router`` (``label_modules``);
* ``attention``: fused attention kernels (flash, cuDNN, memory-efficient), and every kernel
  launched under an attention op (``etp::attention``, ``scaled_dot_product_*``, megatron's
  local ``baddbmm`` / ``bmm`` / softmax and their backward functions);
* ``optimizer``: kernels launched inside the driver's ``etp::finalize`` / ``etp::optimizer``
  ranges (gradient finalization, clipping, Adam), or named like multi-tensor / Adam kernels;
* ``gemm``: GEMM kernels (cuBLAS / CUTLASS / nvjet names) and kernels under ``aten::mm``,
  ``addmm``, ``matmul``, ``linear``, ``_grouped_mm``, ``_scaled_mm``;
* ``moe``: routing and permutation: kernels under top-k, sort, gather / scatter, index ops,
  histograms, one-hot, cumulative sums (and megatron's permute / unpermute helpers);
* ``elementwise``: the rest (norms, activations, casts, copies, losses).

A kernel's enclosing CPU ranges are found through its launch: the runtime event with the same
``correlation`` id, and the ``cpu_op`` / ``user_annotation`` ranges of that thread which hold the
launch's timestamp. Classes are tried in the order above; the first that matches wins.

Per iteration (the trace's ``ProfilerStep#N`` ranges, or the whole kernel span when it has
none): ``wall`` is the span of the profiled steps, ``busy`` the union of all kernel intervals
(any stream), ``host_gaps = wall - busy`` (time the GPU ran nothing: Python, launches,
synchronization), and ``exposed_communication`` the communication time no compute kernel ran
beside. Class times are sums of kernel durations, so with overlapping streams they can add up
to more than ``busy``.

[Note: host activity]
``host_gaps`` says the GPU waited; ``host_activity(trace)`` says on what. From the CUDA runtime
events of the same trace, per iteration: kernel launches (count and the time spent inside the
launch calls), synchronizations (``cudaStreamSynchronize`` / ``cudaEventSynchronize`` ... count,
time blocked, and the outermost CPU op around each: ``aten::item``, ``aten::nonzero``,
``aten::to`` of a ``.cpu()``). A step whose gaps are mostly sync time is bound by data-dependent
host decisions (remove the syncs); one with few syncs and many launches is bound by the host's
launch rate (fewer, larger kernels; CUDA graphs). ``TrainingProfiler`` also runs ``cProfile``
over the two iterations before the traced ones (so neither inflates the other) and writes the
Python functions with the most own time (``python_hotspots``) to ``DIR/host_rank{r}.txt`` (the
raw ``pstats`` beside it, for callers / callees) and the breakdown's ``host`` entry.

Example::

    table = breakdown(json.load(open("prof/rank0.json")))
    print(format_breakdown(table))
"""
from __future__ import annotations

import re
from collections import defaultdict

__all__ = ["CLASSES", "breakdown", "classify_kernel", "format_breakdown", "host_activity", "interval_union",
           "kernel_time_plausible", "python_hotspots"]

CLASSES = ("gemm", "attention", "moe", "elementwise", "optimizer", "communication")

_KERNEL_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
_RANGE_CATS = {"cpu_op", "user_annotation", "python_function"}
_COMM = re.compile(r"nccl|all_?gather|reduce_?scatter|all_?reduce|alltoall|sendrecv|memcpy ptop|peer", re.I)
# etp's collectives (etp/collectives.py) and EP transfers run under these labels: their copy and
# Triton kernels (symmetric-memory transports) are communication too.
_COMM_RANGE = re.compile(r"etp::(?:all_gather|reduce_scatter|all_reduce|ep_count_all_gather|ep_dispatch|ep_combine(?!_weights))",
                         re.I)
_ATTN_KERNEL = re.compile(r"flash|fmha|attention|sdpa", re.I)
# Softmax, but not log_softmax (the loss) nor LogSoftmaxBackward0; the router's softmax runs
# under etp::moe_router (label_modules), tested first.
_ATTN_RANGE = re.compile(r"etp::attention|scaled_dot_product|baddbmm|\bbmm\b|bmmbackward|"
                         r"(?<![_a-z])softmax|flashattention|efficientattention", re.I)
_OPT_RANGE = re.compile(r"etp::finalize|etp::optimizer|optimizer\.step|optimizer#", re.I)
_OPT_KERNEL = re.compile(r"multi_tensor|adam|_foreach|l2norm", re.I)
_GEMM_KERNEL = re.compile(r"gemm|cutlass|nvjet|xmma|cublas|sm\d+_.*(?:tn|nt|nn|tt)\b|matmul", re.I)
_GEMM_RANGE = re.compile(r"aten::(?:mm|addmm|bmm|matmul|linear|_grouped_mm|_scaled_mm|_scaled_grouped_mm)\b|"
                         r"(?:Mm|Addmm|GroupedMm)Backward", re.I)
_MOE_RANGE = re.compile(r"topk|sort|gather|scatter|index|histc|bincount|one_hot|cumsum|permute|unpermute|"
                        r"router|dispatch|combine|masked_select|nonzero|repeat_interleave|etp::moe", re.I)


def classify_kernel(name: str, enclosing: list[str]) -> str:
    """The class of one kernel given its name and the names of its enclosing CPU ranges (any
    order). See [Note: time breakdown]."""
    ranges = " | ".join(enclosing)
    if _COMM.search(name) or _COMM_RANGE.search(ranges):
        return "communication"
    if "etp::moe_router" in ranges and not _GEMM_KERNEL.search(name):
        return "moe"
    if _ATTN_KERNEL.search(name) or _ATTN_RANGE.search(ranges):
        return "attention"
    if _OPT_RANGE.search(ranges) or _OPT_KERNEL.search(name):
        return "optimizer"
    if _GEMM_KERNEL.search(name) or _GEMM_RANGE.search(ranges):
        return "gemm"
    if _MOE_RANGE.search(ranges):
        return "moe"
    return "elementwise"


def _enclosing_names(events: list[dict]) -> dict[int, list[str]]:
    """correlation id -> names of the CPU ranges holding that kernel's launch."""
    ranges: dict[tuple, list[tuple[float, float, str]]] = defaultdict(list)
    launches: dict[tuple, list[tuple[float, int]]] = defaultdict(list)
    for e in events:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat", "")
        thread = (e.get("pid"), e.get("tid"))
        if cat in _RANGE_CATS:
            ranges[thread].append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), e.get("name", "")))
        elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launches[thread].append((float(e["ts"]), e["args"]["correlation"]))
    result: dict[int, list[str]] = {}
    for thread, points in launches.items():
        spans = sorted(ranges.get(thread, ()), key=lambda r: (r[0], -r[1]))
        points.sort()
        stack: list[tuple[float, float, str]] = []
        i = 0
        for ts, correlation in points:
            while i < len(spans) and spans[i][0] <= ts:
                stack.append(spans[i])
                i += 1
            stack = [s for s in stack if s[1] >= ts] if stack and min(s[1] for s in stack) < ts else stack
            result[correlation] = [s[2] for s in stack]
    return result


def interval_union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals as sorted, disjoint intervals (touching ones
    merge): the device's busy time from its kernels' spans, however many streams overlap.

    Example::

        interval_union([(0, 2), (5, 6), (1, 3)])   # [(0, 3), (5, 6)]
    """
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Overlap length of two sorted disjoint interval lists."""
    total, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += max(0.0, min(end, b[k][1]) - max(start, b[k][0]))
            k += 1
    return total


def _steps(events: list) -> list:
    """The host's ``ProfilerStep#N`` ranges. Newer torch also writes each step's GPU-side span
    (category ``gpu_user_annotation``): counted too, every per-iteration figure would be
    halved."""
    return [e for e in events if e.get("ph") == "X" and e.get("cat") != "gpu_user_annotation"
            and str(e.get("name", "")).startswith("ProfilerStep#")]


def breakdown(trace: dict | list) -> dict:
    """Per-iteration milliseconds of each class plus ``wall``, ``busy``, ``host_gaps`` and
    ``exposed_communication`` (see [Note: time breakdown]), with ``iterations`` and the top
    kernels by time.

    Args:
        trace: a Chrome trace (the dict ``torch.profiler`` writes, or its ``traceEvents`` list).
    """
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    enclosing = _enclosing_names(events)
    steps = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in _steps(events))
    totals = dict.fromkeys(CLASSES, 0.0)
    per_kernel: dict[str, list] = defaultdict(lambda: [0.0, 0, ""])
    spans: dict[str, list[tuple[float, float]]] = {"all": [], "communication": [], "compute": []}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in _KERNEL_CATS:
            continue
        start, dur = float(e["ts"]), float(e.get("dur", 0))
        name = e.get("name", "")
        kind = classify_kernel(name, enclosing.get(e.get("args", {}).get("correlation"), []))
        totals[kind] += dur
        entry = per_kernel[name]
        entry[0] += dur
        entry[1] += 1
        entry[2] = kind
        spans["all"].append((start, start + dur))
        spans["communication" if kind == "communication" else "compute"].append((start, start + dur))
    busy = interval_union(spans["all"])
    if steps:
        wall = sum(b - a for a, b in steps)
        iterations = len(steps)
        window = interval_union(steps)
        busy_in_wall = _intersection(busy, window)
    else:
        wall = (busy[-1][1] - busy[0][0]) if busy else 0.0
        iterations, busy_in_wall = 1, _length(busy)
    comm = interval_union(spans["communication"])
    exposed = _length(comm) - _intersection(comm, interval_union(spans["compute"]))
    ms = 1e-3 / iterations  # trace times are microseconds
    result = {"iterations": iterations, "units": "ms per iteration",
              "classes": {k: v * ms for k, v in totals.items()},
              "wall": wall * ms, "busy": busy_in_wall * ms, "host_gaps": max(0.0, wall - busy_in_wall) * ms,
              "exposed_communication": exposed * ms,
              "top_kernels": [{"name": n[:120], "class": v[2], "ms": v[0] * ms, "calls": v[1] / iterations}
                              for n, v in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:15]]}
    return result


_LAUNCH = re.compile(r"LaunchKernel|cuLaunch|MemcpyAsync|MemsetAsync|cudaGraphLaunch", re.I)
_SYNC = re.compile(r"Synchronize", re.I)


def host_activity(trace: dict | list) -> dict:
    """What the host did per profiled iteration (see [Note: host activity]): launches (count,
    ms inside the launch calls), synchronizations with the GPU (count, ms blocked) and the
    CPU ops they sat in, busiest first.

    Args:
        trace: a Chrome trace, as for ``breakdown``.

    Example::

        host = host_activity(json.load(open("prof/trace_rank0.json")))
        print(host["syncs"], host["sync_sites"][:3])
    """
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    iterations = max(1, len(_steps(events)))
    ops: dict[tuple, list[tuple[float, float, str]]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op":
            ops[(e.get("pid"), e.get("tid"))].append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)),
                                                      e.get("name", "")))
    for spans in ops.values():
        spans.sort()
    launches = launch_us = syncs = sync_us = 0.0
    sites: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("cuda_runtime", "cuda_driver"):
            continue
        name, dur = e.get("name", ""), float(e.get("dur", 0))
        if _SYNC.search(name):
            syncs += 1
            sync_us += dur
            ts = float(e["ts"])
            # The outermost CPU op around the wait names the call that synchronized (e.g.
            # aten::item, aten::nonzero, aten::to for a .cpu()).
            holders = [s for s in ops.get((e.get("pid"), e.get("tid")), ()) if s[0] <= ts <= s[1]]
            site = holders[0][2] if holders else "(no CPU op)"
            sites[site][0] += dur
            sites[site][1] += 1
        elif _LAUNCH.search(name):
            launches += 1
            launch_us += dur
    ms = 1e-3 / iterations
    return {"iterations": iterations, "launches": launches / iterations, "launch_ms": launch_us * ms,
            "syncs": syncs / iterations, "sync_ms": sync_us * ms,
            "sync_sites": [{"op": k, "ms": v[0] * ms, "calls": v[1] / iterations}
                           for k, v in sorted(sites.items(), key=lambda kv: -kv[1][0])[:10]]}


def kernel_time_plausible(table: dict, flops_per_iter: float, peak_tflops: float) -> bool:
    """False when the trace's GEMM time is too short for the iteration's FLOPs at the GPU's
    peak: the trace lacks kernels (a dropped buffer, or steps counted twice), so ``busy`` is too
    low and ``host_gaps`` is only an upper bound."""
    gemm_ms = table["classes"]["gemm"] + table["classes"]["attention"]
    return gemm_ms > 0 and flops_per_iter / (gemm_ms * 1e-3) <= peak_tflops * 1e12


def python_hotspots(stats, iterations: int, top: int = 25) -> list[dict]:
    """The ``top`` Python functions by own time from a ``pstats.Stats`` of ``iterations``
    iterations: ``{"function", "own_ms", "cum_ms", "calls"}`` per iteration."""
    rows = []
    for (filename, line, func), (_, calls, own, cum, _) in stats.stats.items():
        rows.append({"function": f"{_short_path(filename)}:{line}({func})", "own_ms": own * 1e3 / iterations,
                     "cum_ms": cum * 1e3 / iterations, "calls": calls / iterations})
    rows.sort(key=lambda r: -r["own_ms"])
    return rows[:top]


def _short_path(filename: str) -> str:
    for marker in ("site-packages/", "/etp/", "/tools/"):
        if marker in filename:
            return filename.split(marker, 1)[1] if marker == "site-packages/" else marker.strip("/") + "/" + \
                filename.split(marker, 1)[1]
    return filename


def format_breakdown(table: dict, title: str = "") -> str:
    """A printable table of ``breakdown``'s result, percentages of the wall time."""
    wall = table["wall"] or 1.0
    rows = [f"time per iteration{' — ' + title if title else ''} ({table['iterations']} profiled iterations)",
            f"{'class':<24}{'ms':>10}{'% wall':>9}"]
    for key in CLASSES:
        rows.append(f"{key:<24}{table['classes'][key]:>10.2f}{100 * table['classes'][key] / wall:>8.1f}%")
    for key in ("exposed_communication", "busy", "host_gaps", "wall"):
        label = {"busy": "GPU busy (union)", "host_gaps": "host gaps (wall - busy)",
                 "exposed_communication": "comm not overlapped"}.get(key, key)
        rows.append(f"{label:<24}{table[key]:>10.2f}{100 * table[key] / wall:>8.1f}%")
    if table.get("kernel_time_plausible") is False:
        rows.append("WARNING: the GEMM time above is too short for this iteration's FLOPs at the GPU's peak: "
                    "the trace misses kernels, so GPU busy is too low and host gaps an upper bound")
    host = table.get("host")
    if host:
        rows.append(f"host: {host['launches']:.0f} launches ({host['launch_ms']:.1f} ms in launch calls), "
                    f"{host['syncs']:.0f} syncs ({host['sync_ms']:.1f} ms blocked) per iteration")
        rows += [f"  sync in {s['op']}: {s['calls']:.1f} x, {s['ms']:.2f} ms" for s in host["sync_sites"][:5]]
        rows += [f"  python {p['function']}: {p['own_ms']:.2f} ms own, {p['calls']:.0f} calls"
                 for p in host.get("python", [])[:10]]
    return "\n".join(rows)


def profile_schedule(iterations: int) -> dict:
    """``torch.profiler.schedule`` arguments for a run of ``iterations`` steps: skip the first
    ones (compilation, allocator growth), record up to 4 steady-state steps, leave the last
    one out (logging, checkpoint, shutdown)."""
    active = max(1, min(4, iterations // 3))
    warmup = 1 if iterations > active + 1 else 0
    wait = max(0, iterations - active - warmup - 1)
    return {"wait": wait, "warmup": warmup, "active": active, "repeat": 1}


#: module class name -> the label its forward runs under while profiling (see ``label_modules``).
MODULE_LABELS = {"DotProductAttention": "etp::attention", "TopKRouter": "etp::moe_router"}


def label_modules(model) -> list:
    """Runs the forward of megatron modules named in ``MODULE_LABELS`` inside a
    ``record_function`` range, so the breakdown can tell the local attention's softmax from the
    router's. Returns the hook handles (``handle.remove()`` undoes it)."""
    from torch.autograd.profiler import record_function

    handles = []
    for module in model.modules():
        label = MODULE_LABELS.get(type(module).__name__)
        if label is None:
            continue

        def enter(mod, args, label=label):
            mod._etp_profile_range = record_function(label)
            mod._etp_profile_range.__enter__()

        def leave(mod, args, output):
            mod._etp_profile_range.__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    return handles


class TrainingProfiler:
    """``etp-train --profile DIR``: torch.profiler over a few steady-state iterations
    (``profile_schedule``), one Chrome trace per rank (``DIR/trace_rank{r}.json``), and that
    rank's breakdown (``DIR/breakdown_rank{r}.json``); ``finish`` returns the breakdown.

    Example::

        profiler = TrainingProfiler("prof", rank, iterations=12, cuda=True)
        for it in range(12):
            ...
            profiler.step()
        table = profiler.finish()
    """

    def __init__(self, directory: str, rank: int, iterations: int, cuda: bool, model=None) -> None:
        import os

        import torch

        os.makedirs(directory, exist_ok=True)
        self.directory, self.rank, self.trace_path = directory, rank, None
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.handles = label_modules(model) if model is not None else []
        self.schedule = profile_schedule(iterations)
        # cProfile takes the two steady iterations just before the torch profiler's window
        # (none when the run is too short for both to be past the first iterations).
        first = self.schedule["wait"]
        self.python_window = (first - 2, first) if first >= 4 else None
        self._step, self._python, self.python_stats = 0, None, None
        self.profiler = torch.profiler.profile(
            activities=activities, schedule=torch.profiler.schedule(**self.schedule),
            on_trace_ready=self._export, record_shapes=False, with_stack=False)
        self.profiler.__enter__()

    def _export(self, profiler) -> None:
        import os

        self.trace_path = os.path.join(self.directory, f"trace_rank{self.rank}.json")
        profiler.export_chrome_trace(self.trace_path)

    def covers(self, step: int) -> bool:
        """Whether the profiler runs during ``step`` (0-based; warm-up included): its step
        time carries the profiler's overhead."""
        first = self.schedule["wait"]
        if self.python_window is not None and self.python_window[0] <= step < self.python_window[1]:
            return True
        return first <= step < first + self.schedule["warmup"] + self.schedule["active"]

    def step(self) -> None:
        """Call once at the end of every iteration."""
        import cProfile
        import pstats

        self._step += 1
        if self.python_window is not None:
            if self._step == self.python_window[0]:
                self._python = cProfile.Profile()
                self._python.enable()
            elif self._step == self.python_window[1] and self._python is not None:
                self._python.disable()
                self.python_stats = pstats.Stats(self._python)
                self._python = None
        self.profiler.step()

    def finish(self) -> dict | None:
        """Stops profiling, writes and returns this rank's breakdown (None if no step was recorded)."""
        import json
        import os

        self.profiler.__exit__(None, None, None)
        for handle in self.handles:
            handle.remove()
        if self.trace_path is None:
            return None
        with open(self.trace_path) as f:
            trace = json.load(f)
        table = breakdown(trace)
        table["host"] = host_activity(trace)
        if self.python_stats is not None:
            window = self.python_window[1] - self.python_window[0]
            table["host"]["python"] = python_hotspots(self.python_stats, window)
            self.python_stats.dump_stats(os.path.join(self.directory, f"host_rank{self.rank}.pstats"))
            with open(os.path.join(self.directory, f"host_rank{self.rank}.txt"), "w") as f:
                self.python_stats.stream = f
                f.write(f"cProfile of {window} iterations (totals, not per iteration)\n")
                self.python_stats.sort_stats("tottime").print_stats(40)
                self.python_stats.sort_stats("cumulative").print_stats(40)
        table["trace"] = self.trace_path
        with open(os.path.join(self.directory, f"breakdown_rank{self.rank}.json"), "w") as f:
            json.dump(table, f, indent=1)
        return table
