"""etp.train.timeline.HostLeadTimeline ([Note: host lead]) on a scripted host clock and fake
CUDA events: per-phase host time, device time (completion to completion) and lead."""
import pytest
import torch

from etp.train import timeline as tl


class _Clock:
    host = 0.0    # seconds, what time.perf_counter() returns
    device = 0.0  # ms, when the device will have finished what is issued now
    cpu = 0.0     # seconds the issuing thread ran (time.thread_time())
    blocked = 0   # its voluntary context switches


class _Event:
    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        self.t = _Clock.device

    def elapsed_time(self, other):
        return other.t - self.t


@pytest.fixture
def scripted(monkeypatch):
    monkeypatch.setattr(tl.time, "perf_counter", lambda: _Clock.host)
    monkeypatch.setattr(tl.torch.cuda, "Event", _Event)
    monkeypatch.setattr(tl, "_thread_clock", lambda: (_Clock.cpu, _Clock.blocked, 1))
    _Clock.host, _Clock.device, _Clock.cpu, _Clock.blocked = 0.0, 0.0, 0.0, 0
    return tl.HostLeadTimeline(torch.device("cuda"))


def _phase(timeline, name, host_ms, device_done_ms):
    with timeline.phase(name):
        _Clock.host += host_ms / 1e3
        _Clock.cpu += host_ms / 2e3  # on the CPU half of the time, blocked twice
        _Clock.blocked += 2
        _Clock.device = device_done_ms  # what the phase issued completes then (ms after anchor)


def _window(timeline, start_ms, execution_bound):
    # The anchor sits at host time == device time (the caller synchronized). Forward: 10 ms of
    # issue; execution-bound, the device finishes 30 ms later than it was issued.
    base = start_ms
    _phase(timeline, "forward", 10, base + (40 if execution_bound else 10.5))
    _phase(timeline, "backward", 5, base + (70 if execution_bound else 15.5))
    _Clock.host = (base + (70 if execution_bound else 15.5)) / 1e3  # the log's synchronize
    timeline.window_done(iterations=1)


def test_leads_and_device_time_per_phase(scripted):
    _window(scripted, 0.0, execution_bound=True)  # warm-up window: dropped
    assert scripted.summary() is None
    # the next anchor: host clock 70 ms, device clock 70 ms
    _Clock.device = 70.0
    scripted._set_anchor()
    _window(scripted, 70.0, execution_bound=True)
    s = scripted.summary()["phases"]
    assert s["forward"]["host_ms"] == pytest.approx(10) and s["backward"]["host_ms"] == pytest.approx(5)
    # forward done 40 ms after the anchor, issued 10 ms after it: lead 30; backward: 70 - 15
    assert s["forward"]["lead_median_ms"] == pytest.approx(30) and s["backward"]["lead_min_ms"] == pytest.approx(55)
    assert s["forward"]["device_ms"] == pytest.approx(40) and s["backward"]["device_ms"] == pytest.approx(30)


def test_an_issue_bound_window_has_leads_near_zero(scripted):
    for start in (0.0, 15.5):
        _Clock.device = start
        scripted._set_anchor()
        _window(scripted, start, execution_bound=False)
    s = scripted.summary()
    assert s["iterations"] == 1
    assert all(abs(p["lead_median_ms"]) <= 0.5 for p in s["phases"].values())
    assert "| forward | 1.0 | 10.0 |" in tl.format_timeline(s)


def test_cpu_runs_have_no_timeline():
    timeline = tl.HostLeadTimeline(torch.device("cpu"))
    with timeline.phase("forward"):
        pass
    timeline.window_done(1)
    timeline.window_done(1)
    assert timeline.summary() is None and "CPU" in tl.format_timeline(None)


def test_windows_and_the_spread_name_the_rank_and_phase_that_moved(scripted):
    for start in (0.0, 15.5, 31.0):
        _Clock.device = start
        scripted._set_anchor()
        _window(scripted, start, execution_bound=False)
    windows = scripted.windows()
    assert len(windows) == 2 and scripted.summary()["windows"] == windows  # the warm-up window is dropped
    assert windows[0]["host_ms"] == pytest.approx({"forward": 10.0, "backward": 5.0})
    assert windows[0]["cpu_ms"] == pytest.approx({"forward": 5.0, "backward": 2.5})
    assert windows[0]["switches"] == {"forward": (2.0, 0.0), "backward": (2.0, 0.0)}
    # a second rank whose backward host time doubled in its second window
    slow = [{"iterations": 1, "host_ms": {"forward": 10.0, "backward": 5.0}, "device_ms": {}},
            {"iterations": 1, "host_ms": {"forward": 10.0, "backward": 10.0}, "device_ms": {}}]
    text = tl.format_spread([windows, slow])
    assert "rank 0: all phases 15.0 .. 15.0" in text and "rank 1: all phases 15.0 .. 20.0" in text
    assert "widest: rank 1's backward, 5.0 .. 10.0 ms" in text
    assert "slowest forward host per window: rank 0 in 2 of 2 (10.0 .. 10.0 ms)" in text  # ties: the first rank
    quicker = [{**w, "host_ms": {**w["host_ms"], "forward": 12.0 - i}} for i, w in enumerate(slow)]
    assert "slowest forward host per window: rank 1 in 2 of 2 (11.0 .. 12.0 ms)" in tl.format_spread([windows, quicker])
    # the slowest rank's own CPU time and switches, per window: the wall time moved, its work did not
    waited = [{**w, "cpu_ms": {"forward": 6.0}, "switches": {"forward": (40.0 + i, 1.0)}} for i, w in enumerate(quicker)]
    assert ("its thread on the CPU: 6.0 .. 6.0 ms; context switches per iteration 40 .. 41 voluntary, 1 .. 1 "
            "involuntary") in tl.format_spread([windows, waited])
    assert "fewer than two" in tl.format_spread([[]])
