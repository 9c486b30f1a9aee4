"""tools/diag/cpu_probe.py: a row per log line with the probe kept out of the step time, the JSON
at the last iteration, the steady max/min, and summarize's correlation."""
from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PROBE = Path(__file__).resolve().parents[2] / "tools" / "diag" / "cpu_probe.py"


def _tool():
    spec = importlib.util.spec_from_file_location("_cpu_probe", PROBE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cpu_probe = _tool()

# A stand-in for etp's Reporter: the same method names; a log window closes every
# ``log_interval`` iterations and at the last; ``exclude`` keeps what it was given.
FAKE_REPORTING = textwrap.dedent("""
    import time

    class Reporter:
        def __init__(self, log_interval):
            self.log_interval = log_interval
            self.records = []
            self.excluded = []
            self.calls = 0
            self._began = time.perf_counter()
            self._iterations = 0

        def exclude(self, seconds):
            self.excluded.append(seconds)

        def iteration_done(self, iteration, loss, norm, profiled, last, timeline=None):
            self.calls += 1
            self._iterations += 1
            if (iteration + 1) % self.log_interval and not last:
                return
            ms = (time.perf_counter() - self._began) * 1e3 / self._iterations
            self.records.append({"iteration": iteration + 1, "ms_per_iter": ms, "profiled": profiled})
            self._began, self._iterations = time.perf_counter(), 0
""")

# A stand-in for etp-train: ``ITERS LOG_INTERVAL OUT DUMP [STOP]``; it dumps what its reporter saw, and
# whether the probe's file was there right after the last iteration_done. STOP: it exits before that one.
FAKE_TRAIN = textwrap.dedent("""
    import json
    import os
    import sys
    import time

    from etp.train.reporting import Reporter

    def train():
        iters, interval, out, dump = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
        stop = int(sys.argv[5]) if len(sys.argv) > 5 else None
        reporter = Reporter(interval)
        for iteration in range(iters):
            if iteration == stop:
                sys.exit(3)
            time.sleep(0.002)
            reporter.iteration_done(iteration, 1.0, None, False, iteration + 1 == iters)
        written = os.path.exists(os.path.join(out, f"cpu_probe_rank{os.environ.get('RANK', '0')}.json"))
        with open(dump, "w") as f:
            json.dump({"calls": reporter.calls, "excluded": reporter.excluded, "records": reporter.records,
                       "written_at_last": written}, f)

    if __name__ == "__main__":
        train()
""")


def _fake_project(tmp_path: Path) -> Path:
    trainer = tmp_path / "etp" / "train"
    trainer.mkdir(parents=True)
    for pkg in (tmp_path / "etp", trainer):
        (pkg / "__init__.py").write_text("")
    (trainer / "reporting.py").write_text(FAKE_REPORTING)
    (trainer / "__main__.py").write_text(FAKE_TRAIN)
    return tmp_path


def _run(tmp_path: Path, iters: str, interval: str, *stop: str, rank: str = "0", check: bool = True):
    root = _fake_project(tmp_path)
    out, dump = tmp_path / "out", tmp_path / "dump.json"
    env = {**os.environ, "RANK": rank}
    done = subprocess.run([sys.executable, str(PROBE), "--out", str(out), "--skip", "1", "-m", "etp.train",
                           iters, interval, str(out), str(dump), *stop], cwd=root, env=env, check=check, timeout=120,
                          capture_output=True, text=True)
    return done, out, dump


def test_a_row_per_call_excluded_from_the_step_and_written_at_the_last(tmp_path):
    done, out, dump = _run(tmp_path, "6", "1", rank="3")
    seen = json.loads(dump.read_text())
    probe = json.loads((out / "cpu_probe_rank3.json").read_text())
    rows = probe["rows"]
    assert seen["calls"] == 6 and [r["iteration"] for r in rows] == [1, 2, 3, 4, 5, 6]
    # The reporter was told to leave out exactly each probe's seconds: its three timed loops and more.
    assert seen["excluded"] == [r["excluded_s"] for r in rows]
    for r in rows:
        assert 3 * r["probe_us"] * 1e-6 <= r["excluded_s"] < 1.0, r
        assert r["probe_us"] > 0 and r["cpu_s"] > 0 and r["involuntary_switches"] >= 0
    assert [r["time"] for r in rows] == sorted(r["time"] for r in rows)
    # Written inside the last iteration_done, not at exit.
    assert seen["written_at_last"] and probe["finished"] and probe["rank"] == 3
    summary = probe["summary"]
    assert summary["skip"] == 1 and summary["steady_rows"] == 5
    steady = [r["probe_us"] for r in rows[1:]]
    assert summary["probe_us_max"] == max(steady) and summary["probe_us_min"] == min(steady)
    assert probe["provenance"]["command"] and "cpu_probe" in probe["provenance"]["command"]


def test_only_log_lines_are_probed(tmp_path):
    done, out, dump = _run(tmp_path, "7", "3")
    seen = json.loads(dump.read_text())
    rows = json.loads((out / "cpu_probe_rank0.json").read_text())["rows"]
    assert seen["calls"] == 7
    assert [r["iteration"] for r in rows] == [r["iteration"] for r in seen["records"]] == [3, 6, 7]
    assert len(seen["excluded"]) == 3


def test_a_program_that_stops_early_still_leaves_its_rows(tmp_path):
    done, out, dump = _run(tmp_path, "6", "1", "4", check=False)
    assert done.returncode == 3 and "before its last iteration (4 rows)" in done.stderr
    probe = json.loads((out / "cpu_probe_rank0.json").read_text())
    assert not probe["finished"] and len(probe["rows"]) == 4


class _Reporter:
    """In-process stand-in: every call logs a window."""

    def __init__(self):
        self.records, self.excluded = [], []

    def exclude(self, seconds):
        self.excluded.append(seconds)

    def iteration_done(self, iteration, loss, norm, profiled, last, timeline=None):
        self.records.append({"iteration": iteration + 1})


def _probed(tmp_path, probes, skip=4):
    values = iter(probes)
    probe = cpu_probe.CpuProbe(str(tmp_path), skip, ["x"], measure=lambda: next(values))
    cls = type("Reporter", (_Reporter,), {})
    probe.install(cls)
    reporter = cls()
    for i in range(len(probes)):
        reporter.iteration_done(i, 0.0, None, False, i + 1 == len(probes))
    return probe, reporter, json.loads(Path(probe.path).read_text())


def test_a_varying_probe_shows_as_max_over_min_above_one(tmp_path):
    # The first four (skipped) rows' 900 us stays out of the steady figures.
    probe, reporter, written = _probed(tmp_path, [900.0, 100.0, 100.0, 100.0, 100.0, 150.0, 100.0, 120.0])
    summary = written["summary"]
    assert summary["probe_us_max"] == 150.0 and summary["probe_us_min"] == 100.0
    assert summary["probe_max_over_min"] == pytest.approx(1.5) and summary["steady_rows"] == 4
    assert len(written["rows"]) == 8 and len(reporter.excluded) == 8
    _, _, steady = _probed(tmp_path, [300.0] * 6)
    assert steady["summary"]["probe_max_over_min"] == 1.0


def test_pearson_against_independent_values():
    assert cpu_probe.pearson([1, 2, 3, 4], [2, 4, 6, 8]) == pytest.approx(1.0)
    assert cpu_probe.pearson([1, 2, 3, 4], [8, 6, 4, 2]) == pytest.approx(-1.0)
    # By hand: deviations (-1.5, -0.5, 0.5, 1.5) and (-1.5, 0.5, -0.5, 1.5): 4 / sqrt(5 * 5).
    assert cpu_probe.pearson([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)
    xs, ys = [3.1, 0.2, 5.5, 2.0, 9.4, 4.4], [1.0, 0.7, 2.9, 0.1, 4.2, 3.3]
    assert cpu_probe.pearson(xs, ys) == pytest.approx(statistics.correlation(xs, ys))
    assert cpu_probe.pearson([1, 1, 1], [1, 2, 3]) is None and cpu_probe.pearson([1], [2]) is None


def _write_probe(directory: Path, rank: int, probes: list[float], skip: int) -> None:
    rows = [{"iteration": i + 1, "probe_us": p, "cpu": 5} for i, p in enumerate(probes)]
    directory.mkdir(exist_ok=True)
    (directory / f"cpu_probe_rank{rank}.json").write_text(
        json.dumps({"rows": rows, "summary": cpu_probe.steady_summary(rows, skip)}))


def test_summarize_correlates_each_rank_with_the_report(tmp_path):
    ms = [500.0, 90.0, 100.0, 120.0, 110.0, 140.0, 130.0]
    log = [{"iteration": i + 1, "ms_per_iter": m, "profiled": i == 6} for i, m in enumerate(ms)]
    report = tmp_path / "run.json"
    report.write_text(json.dumps({"log": log}))
    probes = tmp_path / "probes"
    # Rank 0 follows the iteration time, rank 1 mirrors it; the first row (skipped) would spoil both.
    _write_probe(probes, 0, [1.0] + [m * 2 for m in ms[1:]], skip=1)
    _write_probe(probes, 1, [1.0] + [1000 - m for m in ms[1:]], skip=1)
    # Rank 2 partly follows; window 7 is profiled and left out.
    mixed = [7.0, 3.0, 1.0, 4.0, 1.0, 5.0, 9.0]
    _write_probe(probes, 2, mixed, skip=1)
    lines = []

    class Lines:
        def write(self, text):
            lines.append(text)

    result = cpu_probe.summarize(str(probes), str(report), file=Lines())
    assert sorted(result) == [0, 1, 2]
    assert result[0]["correlation"] == pytest.approx(1.0) and result[0]["pairs"] == 5
    assert result[1]["correlation"] == pytest.approx(-1.0)
    assert result[2]["correlation"] == pytest.approx(statistics.correlation(mixed[1:6], ms[1:6]))
    assert result[0]["probe_us_max"] == 280.0 and result[0]["probe_us_min"] == 180.0
    assert result[0]["probe_max_over_min"] == pytest.approx(280 / 180) and result[0]["cpus"] == [5]
    assert "rank 1:" in "".join(lines) and "correlation with ms/iter -1.000 over 5 log windows" in "".join(lines)


def test_summarize_from_the_command_line(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"log": [{"iteration": i, "ms_per_iter": float(i)}
                                                           for i in range(1, 8)]}))
    _write_probe(tmp_path, 0, [float(i) for i in range(1, 8)], skip=4)
    done = subprocess.run([sys.executable, str(PROBE), "--summarize", str(tmp_path), str(tmp_path / "run.json")],
                          check=True, timeout=60, capture_output=True, text=True)
    assert "rank 0: probe 5.0-7.0 us (max/min 1.40)" in done.stdout and "1.000 over 3 log windows" in done.stdout


def test_a_run_needs_out_and_a_target(tmp_path):
    done = subprocess.run([sys.executable, str(PROBE), "--out", str(tmp_path)], timeout=60, capture_output=True,
                          text=True)
    assert done.returncode != 0 and "-m MODULE" in done.stderr


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/stat"), reason="Linux only")
def test_the_cpu_is_the_threads():
    # A thread held on each allowed CPU in turn (not pytest's: a thread of its own) reads that CPU.
    import threading

    cpus = sorted(os.sched_getaffinity(0))[-4:]  # the last ones: not only CPU 0, which a zero field would match
    seen = {}

    def read():
        for cpu in cpus:
            os.sched_setaffinity(0, {cpu})  # 0: the calling thread
            seen[cpu] = (cpu_probe.current_cpu(), ctypes.CDLL(None).sched_getcpu())

    worker = threading.Thread(target=read)
    worker.start()
    worker.join()
    assert seen == {cpu: (cpu, cpu) for cpu in cpus}
