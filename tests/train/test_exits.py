"""etp/train/exits.py ([Note: early exits]): a SIGTERM that reaches one rank stops every rank
after the same iteration; the duration and the interval as Megatron-LM defines them."""
from __future__ import annotations

import os
import signal
import time
import types

from harness import run_distributed

from etp.train.exits import EarlyExit


def _recipe(**keys):
    train = {"exit_signal_handler": False, "exit_duration_in_mins": None, "exit_interval": None, **keys}
    return types.SimpleNamespace(train=types.SimpleNamespace(**train))


def _signal_on_rank1(ctx):
    exits = EarlyExit(_recipe(exit_signal_handler=True), time.monotonic())
    exits.install()
    try:
        seen = []
        for done in range(1, 6):
            if done == 3 and ctx.rank == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # recorded, not fatal
            reason = exits.reason(done)
            seen.append(reason)
            if reason:
                break
        return seen
    finally:
        exits.uninstall()


def test_one_ranks_sigterm_stops_every_rank_after_the_same_iteration():
    seen = run_distributed(_signal_on_rank1, 2)
    assert seen[0] == seen[1] == [None, None, "SIGTERM received (exit_signal_handler)"]


def test_duration_and_interval():
    started = time.monotonic() - 61.0
    assert EarlyExit(_recipe(exit_duration_in_mins=1.0), started).reason(1) == "ran for exit_duration_in_mins=1"
    assert EarlyExit(_recipe(exit_duration_in_mins=2.0), started).reason(1) is None
    interval = EarlyExit(_recipe(exit_interval=4), time.monotonic())
    assert [interval.reason(done) for done in (3, 4, 5, 8)] == [None, "iteration 4 is a multiple of exit_interval=4",
                                                                 None, "iteration 8 is a multiple of exit_interval=4"]
    assert not interval.votes and EarlyExit(_recipe(), time.monotonic()).reason(10) is None


def test_without_the_handler_sigterm_keeps_its_handler():
    before = signal.getsignal(signal.SIGTERM)
    exits = EarlyExit(_recipe(), time.monotonic())
    exits.install()
    assert signal.getsignal(signal.SIGTERM) is before
    exits.uninstall()
    with_handler = EarlyExit(_recipe(exit_signal_handler=True), time.monotonic())
    with_handler.install()
    assert signal.getsignal(signal.SIGTERM) is not before
    with_handler.uninstall()
    assert signal.getsignal(signal.SIGTERM) is before
