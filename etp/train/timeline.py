"""Host issue against device execution, per training phase, without a profiler.

[Note: host lead]
A profiler slows the host by more than it slows the device, so a profiled step says little about
whether the unprofiled step is bound by issue (the device idles, waiting for the host's next
launch) or by execution (the host waits, its launches queued). ``HostLeadTimeline`` measures it
in the unprofiled run itself. At the end of every phase (``forward``, ``backward``,
``finalize``, ``optimizer``, the ``with phase(...)`` blocks of etp-train) the host notes its
clock and records a CUDA event on the current stream. Each log window starts right after a
``torch.cuda.synchronize()``, with an anchor: an event and the host's clock, taken together
on an idle device. An event's time from the anchor places its completion on the host's clock,
so for every phase end

    lead = (when the device finished the phase) - (when the host finished issuing it)

is how much queued work the device still had when the host moved on. A lead near zero means the
device had caught up: it had run everything issued and was waiting for the host (issue-bound
there). A lead that stays large means the host ran ahead (execution-bound). ``device ms`` is the
time between the device's completion of the previous phase end and of this one, so it
includes any idle time the device spent waiting for launches inside the phase. Costs one event
record per phase end (a few microseconds), and nothing on CPU runs (no events: ``summary``
is None).

Every phase also notes the issuing thread's own CPU time (``time.thread_time``) and its
context switches (``getrusage(RUSAGE_THREAD)``, Linux): when a phase's wall time moves while its
CPU time does not, the thread was off the CPU, blocked (voluntary switches: a lock, a device
synchronization, the GIL) or preempted (involuntary ones), rather than doing more work.

Every log window's host and device time per phase is kept too (``windows``), and etp-train
gathers every rank's (``summary()["ranks"]``): an ETP step waits at each gather for the slowest
rank, so when the iterations of an issue-bound step spread, the rank and the phase whose host
time moved with them say where the time went (``format_spread``).

Example (``etp-train --timeline``)::

    timeline = HostLeadTimeline(torch.device("cuda"))
    with timeline.phase("forward"):
        loss = model(batch)
    timeline.window_done(iterations=1)   # after a torch.cuda.synchronize()
    print(format_timeline(timeline.summary()))
"""
from __future__ import annotations

import contextlib
import resource
import statistics
import time

import torch

__all__ = ["HostLeadTimeline", "format_spread", "format_timeline"]


def _thread_clock() -> tuple[float, int, int]:
    """The calling thread's CPU seconds and its (voluntary, involuntary) context switches;
    switches are 0 where ``RUSAGE_THREAD`` does not exist (not Linux)."""
    who = getattr(resource, "RUSAGE_THREAD", None)
    if who is None:
        return time.thread_time(), 0, 0
    usage = resource.getrusage(who)
    return time.thread_time(), usage.ru_nvcsw, usage.ru_nivcsw


class HostLeadTimeline:
    """Per-phase host time, device time and lead, over every log window but the first (warm-up)."""

    def __init__(self, device: torch.device) -> None:
        self.enabled = device.type == "cuda"
        # name, began, ended, event, (CPU seconds, voluntary, involuntary switches) spent in the phase
        self._marks: list[tuple[str, float, float, torch.cuda.Event, tuple]] = []
        self._windows: list[dict] = []
        self._anchor = None
        if self.enabled:
            self._set_anchor()

    def _set_anchor(self) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._anchor = (time.perf_counter(), event)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Marks the end of phase ``name`` on the host's clock and on the current stream."""
        began, clock = time.perf_counter(), _thread_clock() if self.enabled else None
        yield
        if self.enabled:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            spent = tuple(b - a for a, b in zip(clock, _thread_clock()))
            self._marks.append((name, began, time.perf_counter(), event, spent))

    def window_done(self, iterations: int) -> None:
        """Closes a log window of ``iterations`` iterations; the caller has just synchronized
        the device (so every event has completed) and the next anchor is taken now."""
        if not self.enabled:
            return
        anchor_host, anchor_event = self._anchor
        phases: dict[str, dict] = {}
        device_prev = 0.0
        for name, began, ended, event, (cpu_s, voluntary, involuntary) in self._marks:
            device_end = anchor_event.elapsed_time(event)  # ms after the anchor
            host_end = (ended - anchor_host) * 1e3
            entry = phases.setdefault(name, {"calls": 0, "host_ms": 0.0, "device_ms": 0.0, "leads": [],
                                             "cpu_ms": 0.0, "voluntary": 0, "involuntary": 0})
            entry["calls"] += 1
            entry["host_ms"] += (ended - began) * 1e3
            entry["cpu_ms"] += cpu_s * 1e3
            entry["voluntary"] += voluntary
            entry["involuntary"] += involuntary
            entry["device_ms"] += device_end - device_prev
            entry["leads"].append(device_end - host_end)
            device_prev = device_end
        self._windows.append({"iterations": iterations, "phases": phases})
        self._marks.clear()
        self._set_anchor()

    def windows(self) -> list[dict]:
        """Every log window but the first: per phase and per iteration, ``host_ms``,
        ``device_ms``, the issuing thread's ``cpu_ms`` and its ``switches`` (voluntary,
        involuntary)."""
        return [{"iterations": w["iterations"],
                 "host_ms": {n: e["host_ms"] / w["iterations"] for n, e in w["phases"].items()},
                 "device_ms": {n: e["device_ms"] / w["iterations"] for n, e in w["phases"].items()},
                 "cpu_ms": {n: e["cpu_ms"] / w["iterations"] for n, e in w["phases"].items()},
                 "switches": {n: (e["voluntary"] / w["iterations"], e["involuntary"] / w["iterations"])
                              for n, e in w["phases"].items()}}
                for w in self._windows[1:]]

    def summary(self) -> dict | None:
        """Per phase and per iteration: ``calls``, ``host_ms`` (inside the ``with`` block),
        ``device_ms`` (completion to completion) and the median / minimum ``lead_ms`` at its
        ends; over every window but the first, and those windows (``windows``). None on CPU or
        before a second window."""
        windows = self._windows[1:]
        if not self.enabled or not windows:
            return None
        iterations = sum(w["iterations"] for w in windows)
        out = {}
        for name in dict.fromkeys(n for w in windows for n in w["phases"]):
            entries = [w["phases"][name] for w in windows if name in w["phases"]]
            leads = [lead for e in entries for lead in e["leads"]]
            out[name] = {"calls": sum(e["calls"] for e in entries) / iterations,
                         "host_ms": sum(e["host_ms"] for e in entries) / iterations,
                         "device_ms": sum(e["device_ms"] for e in entries) / iterations,
                         "lead_median_ms": statistics.median(leads), "lead_min_ms": min(leads)}
        return {"iterations": iterations, "phases": out, "windows": self.windows()}


def format_timeline(summary: dict | None) -> str:
    """A table of ``HostLeadTimeline.summary()``."""
    if summary is None:
        return "timeline: no CUDA events (CPU run) or a single log window"
    rows = [f"timeline over {summary['iterations']} iterations (per iteration; lead = device finish "
            "- host issue at the phase's end: ~0 means the device waited for the host)",
            "| phase | calls | host ms | device ms | lead median ms | lead min ms |",
            "|---|---:|---:|---:|---:|---:|"]
    for name, p in summary["phases"].items():
        rows.append(f"| {name} | {p['calls']:.1f} | {p['host_ms']:.1f} | {p['device_ms']:.1f} | "
                    f"{p['lead_median_ms']:.1f} | {p['lead_min_ms']:.1f} |")
    return "\n".join(rows)


def format_spread(ranks: list[list[dict]]) -> str:
    """Where the spread of an issue-bound step comes from: ``ranks`` holds every rank's
    ``windows()``. Per rank, its host time per iteration (all phases) over the windows, min to
    max; the (rank, phase) whose host time varies most; and which rank's host was the slowest in
    each window in the first phase (the forward, which waits on nothing: later phases also hold
    the time a host blocks on its device while that device waits for a peer), with that slowest
    time's range. An issue-bound step waits at every gather for its slowest rank, so when the
    slowest rank changes from window to window the spread is each host's own jitter, not one
    rank's steady lag.

    Example::

        print(format_spread([timeline.windows() for timeline in every_ranks_timeline]))
    """
    if not ranks or not ranks[0]:
        return "timeline spread: fewer than two log windows"
    rows, widest = ["timeline spread (host ms per iteration over the log windows, min .. max):"], None
    for rank, windows in enumerate(ranks):
        totals = [sum(w["host_ms"].values()) for w in windows]
        rows.append(f"  rank {rank}: all phases {min(totals):.1f} .. {max(totals):.1f}")
        for phase in windows[0]["host_ms"]:
            values = [w["host_ms"].get(phase, 0.0) for w in windows]
            if widest is None or max(values) - min(values) > widest[0]:
                widest = (max(values) - min(values), rank, phase, min(values), max(values))
    _, rank, phase, low, high = widest
    rows.append(f"  widest: rank {rank}'s {phase}, {low:.1f} .. {high:.1f} ms")
    first = next(iter(ranks[0][0]["host_ms"]))
    per_window = [[windows[i]["host_ms"].get(first, 0.0) for windows in ranks] for i in range(len(ranks[0]))]
    slowest = [max(range(len(times)), key=times.__getitem__) for times in per_window]
    counts = ", ".join(f"rank {r} in {slowest.count(r)}" for r in range(len(ranks)) if r in slowest)
    peaks = [max(times) for times in per_window]
    rows.append(f"  slowest {first} host per window: {counts} of {len(per_window)} "
                f"({min(peaks):.1f} .. {max(peaks):.1f} ms)")
    if all("cpu_ms" in w for windows in ranks for w in windows):
        # The slowest rank's issuing thread in each window: did it work longer, or wait longer?
        cpu = [ranks[r][i]["cpu_ms"].get(first, 0.0) for i, r in enumerate(slowest)]
        switches = [ranks[r][i]["switches"].get(first, (0, 0)) for i, r in enumerate(slowest)]
        rows.append(f"  its thread on the CPU: {min(cpu):.1f} .. {max(cpu):.1f} ms; context switches per iteration "
                    f"{min(s[0] for s in switches):.0f} .. {max(s[0] for s in switches):.0f} voluntary, "
                    f"{min(s[1] for s in switches):.0f} .. {max(s[1] for s in switches):.0f} involuntary")
    return "\n".join(rows)
