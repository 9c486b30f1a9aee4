"""etp-train's progress: each start-up phase timed, the first step's line, and the log line's
elapsed time and ETA (one line per log window, from rank 0), on a clock the test moves."""
from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import torch

from etp.recipe import Recipe
from etp.train import reporting
from etp.train.reporting import Reporter, StartupClock, format_duration

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny_moe_cpu.yaml"


@pytest.fixture
def now(monkeypatch):
    """The reporting module's clock, set by the test: ``now.t = seconds``."""
    clock = types.SimpleNamespace(t=100.0)
    monkeypatch.setattr(reporting, "time", types.SimpleNamespace(perf_counter=lambda: clock.t))
    return clock


@pytest.mark.parametrize("seconds,text", [(0, "0:00:00"), (0.4, "0:00:00"), (59.6, "0:01:00"), (3725.4, "1:02:05"),
                                          (90_000, "25:00:00"), (-3, "0:00:00")])
def test_durations_read_hours_minutes_seconds(seconds, text):
    assert format_duration(seconds) == text


def test_the_startup_clock_times_each_phase(now):
    clock = StartupClock()
    now.t = 100.4
    clock.mark("process groups")
    now.t = 101.6
    clock.mark("build")
    now.t = 102.0
    with clock.timed("capture"):
        now.t = 104.5
    now.t = 105.0
    clock.mark("first step")  # counts from the capture's end
    assert clock.phases == pytest.approx({"process groups": 0.4, "build": 1.2, "capture": 2.5, "first step": 0.5})
    assert clock.line("set up in", ("process groups", "build")) == "set up in 5.0 s (process groups 0.4 s, build 1.2 s)"
    assert clock.line("done at", ("capture", "missing")) == "done at 5.0 s (capture 2.5 s)"


def _reporter(rank: int, now, schedule=None):
    recipe = Recipe.from_yaml(TINY, train_iters=10, log_interval=2)
    clock = StartupClock()  # the run began at 100
    now.t = 100.8
    clock.mark("build")
    now.t = 101.0
    return Reporter(recipe, rank, torch.device("cpu"), 2e9, None, stop=10, clock=clock, schedule=schedule)


def test_rank_0_logs_one_line_per_window_with_elapsed_time_and_eta(now, capsys):
    reporter = _reporter(0, now, types.SimpleNamespace(stepped_lr=3e-3))
    try:
        for iteration, loss in enumerate((5.5, 5.0, 4.5, 4.0)):
            now.t = 101.0 + 0.5 * (iteration + 1)  # 0.5 s per iteration
            reporter.iteration_done(iteration, torch.tensor(loss), torch.tensor(1.5), False, False)
    finally:
        reporter.pauses.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "etp-train: iteration 1 done at 1.5 s (first step 0.7 s)"
    assert len(lines) == 3, lines  # the first step's line, then one per log window
    number = r" *[0-9.]+"
    for line, (done, loss, elapsed, eta) in zip(lines[1:], ((2, "5.0000", "0:00:02", "0:00:04"),
                                                            (4, "4.0000", "0:00:03", "0:00:03"))):
        assert re.fullmatch(rf"iter +{done}/10 \| loss {loss} \| lr 3\.000e-03 \| grad norm 1\.500 \| +500\.0 ms/iter"
                            rf" \|{number} TFLOP/s/rank \| MFU n/a \| peak n/a \(CPU\) \| elapsed {elapsed} \| "
                            rf"ETA {eta}", line), line
    assert [(r["elapsed_s"], r["eta_s"], r["lr"]) for r in reporter.records] == [(2.0, 4.0, 3e-3), (3.0, 3.0, 3e-3)]


def test_other_ranks_print_nothing(now, capsys):
    reporter = _reporter(1, now)
    try:
        for iteration in range(4):
            now.t = 101.0 + 0.5 * (iteration + 1)
            reporter.iteration_done(iteration, torch.tensor(1.0), None, False, False)
    finally:
        reporter.pauses.close()
    assert capsys.readouterr().out == ""
    assert len(reporter.records) == 2 and reporter.records[0]["lr"] is None
