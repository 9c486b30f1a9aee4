"""The multi-process harness reports a failing rank's traceback and a hung rank's stack."""
import time

import pytest
import torch.distributed as dist
from harness import run_distributed


def _one_rank_raises(ctx):
    if ctx.rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 blocks on its peer, as real tests do after a failure
    return ctx.rank


def _one_rank_hangs(ctx):
    if ctx.rank == 1:
        time.sleep(3600)
    return ctx.rank


def _ok(ctx):
    return ctx.rank * 10


def test_results_come_back_in_rank_order():
    assert run_distributed(_ok, 3) == [0, 10, 20]


def test_a_raising_rank_fails_the_test_with_its_traceback():
    with pytest.raises(AssertionError) as info:
        run_distributed(_one_rank_raises, 2, timeout=30)
    message = str(info.value)
    assert "rank 1 raised" in message and "ValueError: boom on purpose" in message
    assert "_one_rank_raises" in message


@pytest.mark.slow  # the harness's own timeout path: 10 s of waiting by design
def test_a_hung_rank_is_reported_with_its_stack():
    with pytest.raises(AssertionError) as info:
        run_distributed(_one_rank_hangs, 2, timeout=8)
    message = str(info.value)
    assert "rank 1 hung or died" in message
    assert "in _one_rank_hangs" in message  # faulthandler's stack names where it was stuck


@pytest.mark.slow
def test_a_port_taken_before_the_rendezvous_is_retried_on_a_fresh_one(monkeypatch):
    """Another process can take the chosen free port before rank 0 binds it (two test runs on one
    host): the run starts again on a new port instead of failing the test."""
    import socket

    import harness

    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    ports = iter([holder.getsockname()[1]])
    chosen = []
    real = harness._free_port

    def first_one_taken():
        chosen.append(next(ports, None) or real())
        return chosen[-1]

    monkeypatch.setattr(harness, "_free_port", first_one_taken)
    try:
        assert run_distributed(_ok, 2, timeout=30) == [0, 10]
    finally:
        holder.close()
    assert len(chosen) == 2  # the taken port, then a fresh one


def _read_env(ctx, key):
    import os

    return os.environ.get(key)


def test_ranks_see_the_environment_the_test_set(monkeypatch):
    """A forkserver rank is a fork of a process started earlier: the test's setenv must reach it."""
    monkeypatch.setenv("ETP_TEST_HARNESS_PROBE", "set by the test")
    assert run_distributed(_read_env, 2, "ETP_TEST_HARNESS_PROBE") == ["set by the test"] * 2
    monkeypatch.delenv("ETP_TEST_HARNESS_PROBE")
    assert run_distributed(_read_env, 2, "ETP_TEST_HARNESS_PROBE") == [None, None]
