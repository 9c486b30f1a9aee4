"""etp-train's spawned CPU ranks: a rank that dies without reporting ends the run with its cause.

Found when a CI run hung: one rank of ``test_cpu_recipe_profile_and_report`` died of SIGSEGV
inside the torch profiler, the other exited with an error, and ``main`` waited forever for the
dead rank's report.
"""
from __future__ import annotations

import queue

from etp.train.launch import _collect, summarize


class _FakeProc:
    def __init__(self, exitcode=None):
        self.exitcode = exitcode
        self.terminated = False

    def terminate(self):
        self.terminated = True
        self.exitcode = -15


def test_every_rank_reports():
    results = queue.Queue()
    results.put((1, [2.0], None))
    results.put((0, None, ("crash", "Traceback: boom")))
    procs = [_FakeProc(0), _FakeProc(0)]
    assert _collect(procs, results, poll_s=0.01) == [(0, "crash", "Traceback: boom")]


def test_a_rank_killed_by_a_signal_is_named_and_the_rest_are_ended():
    results = queue.Queue()
    procs = [_FakeProc(-11), _FakeProc(None), _FakeProc(None)]  # rank 0 segfaulted; 1, 2 hang
    results.put((2, None, ("crash", "RuntimeError: Connection closed by peer")))  # rank 2 noticed the loss
    failures = _collect(procs, results, grace_s=0.1, poll_s=0.01)
    assert failures[0] == (2, "crash", "RuntimeError: Connection closed by peer")
    assert (0, "crash", "died (killed by SIGSEGV) without a report") in failures
    assert (1, "crash", "terminated 0 s after a peer died") in failures
    assert procs[1].terminated and not procs[2].terminated


def test_a_report_put_just_before_exiting_is_not_lost():
    """A rank that reported and exited at once: its report is read, not counted as a death."""

    class _LateQueue(queue.Queue):
        def __init__(self):
            super().__init__()
            self.empty_once = True

        def get(self, timeout=None):
            if self.empty_once:  # the first wait sees nothing; the pipe has it by the next read
                self.empty_once = False
                raise queue.Empty
            return super().get(timeout=timeout)

    results = _LateQueue()
    results.put((0, [1.0], None))
    assert _collect([_FakeProc(0)], results, poll_s=0.01) == []


def test_a_rank_exiting_with_an_error_code_and_no_report():
    results = queue.Queue()
    assert _collect([_FakeProc(1)], results, grace_s=0.0, poll_s=0.01) == [
        (0, "crash", "died (exit code 1) without a report")]


def test_input_errors_are_one_line_once_and_crashes_in_full():
    same = [(0, "input", "save=x is not writable"), (1, "input", "save=x is not writable")]
    assert summarize(same) == ("etp-train: error: save=x is not writable", 2)
    text, status = summarize([*same, (1, "crash", "Traceback: boom")])
    assert status == 1 and "rank 1: Traceback: boom" in text
