"""Whether the host's own Python speed moves during a run: a fixed pure-Python loop, timed at
every etp-train log line.

An eager step is bound by its host: its time is the Python, launches and bindings of one
thread. When such a step's iteration times spread (the same work, slow and fast windows), the
program's profile alone cannot say whether the program did more, or the same work ran slower.
This tool times the same loop (``LOOP`` additions, best of 3) at every log line and records
beside it the CPU the thread was on, the process's CPU seconds and its voluntary and
involuntary context switches. The same loop on the same CPU with no context switches between
two rows taking very different times says the CPU itself ran slower, below the guest OS
(its frequency, or the hypervisor's scheduling of the virtual CPU), not the program; a probe
that moves with the iteration time (``--summarize``'s correlation) is what explains the
spread of a host-bound step.

How: it runs the target program (``-m module ...`` or a script, through runpy) with
``etp.train.reporting.Reporter.iteration_done`` wrapped. After the original
returns from a call that closed a log window (it has synchronized the device, so the probe
does not share the host with the step's launches), the probe runs, and its time is kept out
of the next window's step time (``Reporter.exclude``: the window it falls in). Calls that log
nothing are not probed. Each rank (``RANK``) writes ``{out}/cpu_probe_rank{R}.json`` at the
last iteration (or, with ``"finished": false``, when the program ends before it): per log
line

* ``iteration``: iterations done, as the report's ``log`` counts them;
* ``probe_us``: the loop's best time of 3, microseconds;
* ``cpu``: the CPU the thread ran on (``/proc/thread-self/stat``, None where unavailable);
* ``cpu_s``, ``voluntary_switches``, ``involuntary_switches``: the process's totals so far
  (``getrusage``; a window's are the difference of two rows);
* ``time``: wall time (``time.time()``); ``excluded_s``: the seconds kept out of the step time;

and a ``summary`` over the steady rows (all but the first ``--skip``): the probe's max, min and
their ratio, and the distinct CPUs. The etp-train report is not written yet at that point: the
comparison with the iteration times is ``--summarize``'s (``summarize``), afterwards, from
every rank's file and the ``--json`` report (whose ``log`` is rank 0's windows; the ranks of a
data-parallel step wait for each other, so their windows take the same time).

    torchrun --standalone --nproc-per-node 2 tools/diag/cpu_probe.py --out /tmp/cp \\
        -m etp.train --recipe recipes/moe_flagship.yaml --set world_size=2 --json /tmp/cp/run.json
    python tools/diag/cpu_probe.py --summarize /tmp/cp /tmp/cp/run.json
"""
from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import re
import resource
import runpy
import sys
import time

LOOP = 20000  # additions per probe: the fixed work timed


def probe_us(loop: int = LOOP, repeats: int = 3) -> float:
    """The best of ``repeats`` timings of a ``loop``-long pure-Python loop, microseconds."""
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        total = 0
        for i in range(loop):
            total += i * i
        best = min(best, time.perf_counter() - began)
    return best * 1e6


def current_cpu() -> int | None:
    """The CPU this thread runs on: field 39 (``processor``) of /proc/thread-self/stat; None
    where unavailable (not Linux)."""
    try:
        with open("/proc/thread-self/stat") as f:
            stat = f.read()
        # The command name (field 2) may hold spaces: count from after its closing parenthesis (field 3).
        return int(stat.rsplit(")", 1)[1].split()[39 - 3])
    except (OSError, IndexError, ValueError):
        return None


def pearson(xs: list[float], ys: list[float]) -> float | None:
    """Pearson's correlation of two equally long lists; None for fewer than two pairs or a
    constant list."""
    if len(xs) != len(ys):
        raise ValueError(f"pearson: {len(xs)} and {len(ys)} values")
    n = len(xs)
    if n < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if sxx == 0 or syy == 0:
        return None
    return sxy / (sxx * syy) ** 0.5


def steady_summary(rows: list[dict], skip: int) -> dict:
    """The probe's max, min and their ratio, and the distinct CPUs, over ``rows[skip:]``
    (None values when no row is left)."""
    steady = rows[skip:]
    probes = [r["probe_us"] for r in steady]
    high, low = (max(probes), min(probes)) if probes else (None, None)
    return {"skip": skip, "steady_rows": len(steady), "probe_us_max": high, "probe_us_min": low,
            "probe_max_over_min": high / low if probes and low > 0 else None,
            "cpus": sorted({r["cpu"] for r in steady if r["cpu"] is not None})}


class CpuProbe:
    """The rows of one rank and the wrapper that takes them.

    Example::

        probe = CpuProbe("/tmp/cp", skip=4, launched=sys.argv)
        probe.install(reporting.Reporter)   # then run the program
    """

    def __init__(self, out: str, skip: int, launched: list[str], provenance=None, measure=probe_us) -> None:
        self.out, self.skip, self.launched = out, skip, launched
        self.provenance = provenance  # run_provenance(argv), or None: no provenance block
        self.measure = measure
        self.rows: list[dict] = []
        self.path: str | None = None  # set once written

    def install(self, reporter_class) -> None:
        """Wraps ``reporter_class.iteration_done``: a probe at each call that logged a window."""
        original = reporter_class.iteration_done
        probe = self

        @functools.wraps(original)
        def iteration_done(self, iteration, loss, norm, profiled, last, timeline=None):
            before = len(self.records)
            original(self, iteration, loss, norm, profiled, last, timeline)
            if len(self.records) > before:  # a log line: the device is synchronized
                probe.record(self, iteration, last)

        reporter_class.iteration_done = iteration_done

    def record(self, reporter, iteration: int, last: bool) -> None:
        began = time.perf_counter()
        us = self.measure()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        row = {"iteration": iteration + 1, "probe_us": us, "cpu": current_cpu(),
               "cpu_s": usage.ru_utime + usage.ru_stime, "voluntary_switches": usage.ru_nvcsw,
               "involuntary_switches": usage.ru_nivcsw, "time": time.time()}
        row["excluded_s"] = seconds = time.perf_counter() - began
        reporter.exclude(seconds)  # the window now open (the original has closed this one)
        self.rows.append(row)
        if last:
            self.write(finished=True)

    def write(self, finished: bool) -> str:
        rank = os.environ.get("RANK", "0")
        report = {"rank": int(rank), "finished": finished, "loop": LOOP,
                  "summary": steady_summary(self.rows, self.skip), "rows": self.rows}
        if self.provenance is not None:
            report["provenance"] = self.provenance(self.launched)
        os.makedirs(self.out, exist_ok=True)
        self.path = os.path.join(self.out, f"cpu_probe_rank{rank}.json")
        with open(self.path, "w") as f:
            json.dump(report, f, indent=1)
        s = report["summary"]
        ratio = "n/a" if s["probe_max_over_min"] is None else f"{s['probe_max_over_min']:.2f}"
        print(f"cpu_probe: rank {rank}: {len(self.rows)} rows, steady probe max/min {ratio} on cpus {s['cpus']} "
              f"-> {self.path}", file=sys.stderr)
        return self.path


def summarize(directory: str, report_json: str, skip: int | None = None, file=sys.stdout) -> dict:
    """Per rank (every ``cpu_probe_rank{R}.json`` in ``directory``): the steady rows' probe
    max and min, and the Pearson correlation of their probe time with the iteration time
    (``ms_per_iter``) of the same log window in the etp-train ``--json`` report
    ``report_json`` (profiled windows left out). ``skip``: the rows left out first (default:
    each file's own). Prints a line per rank and returns ``{rank: {...}}``.

    Example::

        summarize("/tmp/cp", "/tmp/cp/run.json")[0]["correlation"]
    """
    with open(report_json) as f:
        log = {r["iteration"]: r for r in json.load(f)["log"] if not r.get("profiled")}
    files = {}
    for path in glob.glob(os.path.join(directory, "cpu_probe_rank*.json")):
        match = re.fullmatch(r"cpu_probe_rank(\d+)\.json", os.path.basename(path))
        if match:
            files[int(match.group(1))] = path
    if not files:
        raise FileNotFoundError(f"summarize: no cpu_probe_rank*.json in {directory}")
    result = {}
    for rank in sorted(files):
        with open(files[rank]) as f:
            probe = json.load(f)
        first = probe["summary"]["skip"] if skip is None else skip
        steady = steady_summary(probe["rows"], first)
        pairs = [(r["probe_us"], log[r["iteration"]]["ms_per_iter"]) for r in probe["rows"][first:]
                 if r["iteration"] in log]
        correlation = pearson([p for p, _ in pairs], [ms for _, ms in pairs])
        result[rank] = {"probe_us_max": steady["probe_us_max"], "probe_us_min": steady["probe_us_min"],
                        "probe_max_over_min": steady["probe_max_over_min"], "cpus": steady["cpus"],
                        "pairs": len(pairs), "correlation": correlation}
        ratio = "n/a" if steady["probe_max_over_min"] is None else f"{steady['probe_max_over_min']:.2f}"
        probes = ("n/a" if steady["probe_us_max"] is None
                  else f"{steady['probe_us_min']:.1f}-{steady['probe_us_max']:.1f} us")
        print(f"rank {rank}: probe {probes} (max/min {ratio}) on cpus {steady['cpus']}; correlation with ms/iter "
              f"{'n/a' if correlation is None else f'{correlation:.3f}'} over {len(pairs)} log windows", file=file)
    return result


def _provenance_module():
    """This checkout's ``etp/provenance.py``, through ``host_sampler``'s loader (by path: the
    program run may import its own ``etp`` package, a test's stand-in, which this tool must
    not shadow). ``host_sampler`` is loaded by its path too, for the same reason."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_host_sampler", os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_sampler.py"))
    sampler = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sampler)
    return sampler.provenance_module()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--out", help="directory for cpu_probe_rank{R}.json")
    parser.add_argument("--skip", type=int, default=None,
                        help="rows left out of the steady summary first (default 4; --summarize: each file's own)")
    parser.add_argument("--summarize", nargs=2, metavar=("DIR", "REPORT"),
                        help="instead of a run: every rank's probe in DIR against an etp-train --json REPORT")
    parser.add_argument("-m", dest="module", nargs=argparse.REMAINDER, help="the module to run, then its arguments")
    parser.add_argument("script", nargs=argparse.REMAINDER, help="or the script to run, then its arguments")
    launched = list(sys.argv)
    args = parser.parse_args()
    if args.skip is not None and args.skip < 0:
        parser.error(f"--skip {args.skip}: must not be negative")
    if args.summarize:
        summarize(*args.summarize, skip=args.skip)
        return
    if not args.out or not (args.module or args.script):
        parser.error("a run takes --out DIR and then -m MODULE ... or SCRIPT ... (or use --summarize DIR REPORT)")
    skip = 4 if args.skip is None else args.skip
    provenance = _provenance_module().run_provenance
    if args.module:
        target, rest = args.module[0], args.module[1:]
        sys.path[0] = os.getcwd()  # as ``python -m`` does (sys.path[0] was this tool's folder)
    else:
        target, rest = args.script[0], args.script[1:]
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # as ``python SCRIPT`` does
        sys.path.insert(1, os.getcwd())  # etp from the checkout it is run in
    # The program's own reporting module (imported after the path is the program's).
    from etp.train import reporting

    probe = CpuProbe(args.out, skip, launched, provenance)
    probe.install(reporting.Reporter)
    sys.argv = [target] + rest
    try:
        if args.module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(target, run_name="__main__")
    finally:
        if probe.path is None:
            rank = os.environ.get("RANK", "0")
            print(f"cpu_probe: rank {rank}: the program ended before its last iteration ({len(probe.rows)} rows)",
                  file=sys.stderr)
            if probe.rows:
                probe.write(finished=False)


if __name__ == "__main__":
    main()
