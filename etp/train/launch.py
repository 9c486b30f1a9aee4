"""How etp-train's ranks start and how their errors reach the user.

* Under torchrun, ``run_rank`` runs this process's rank.
* Without GPUs, ``spawn_cpu_ranks`` starts ``world_size`` gloo ranks on loopback and collects
  their reports. A rank that dies without reporting (a signal, a hard crash in native code) is
  named with how it ended, and the ranks still running are ended after a grace period: a
  crash always ends the run.

An input error (``TrainError``, ``RecipeError``, ``CheckpointError``, any ``ValueError``: their
messages name the fix) is reported once, as one line, whichever ranks raised it; anything
else is a bug and shows its traceback.
"""
from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import sys
import time
import traceback

import torch.distributed as dist

from etp.train.loop import train
from etp.train.options import RunOptions

__all__ = ["is_input_error", "report_input_error", "run_rank", "spawn_cpu_ranks", "summarize"]


def is_input_error(error: BaseException) -> bool:
    """Whether ``error`` is the user's to fix (reported as one line) rather than a bug."""
    from etp.megatron.checkpoint import CheckpointError

    return isinstance(error, (ValueError, CheckpointError, FileNotFoundError, FloatingPointError))


_ERROR_KEY = "etp_train/input_error"


def report_input_error(rank: int, error: BaseException, wait_s: float = 3.0) -> None:
    """One line for an input error: rank 0 prints it and posts it to the process group's
    store; another rank stays silent when rank 0 posted the same message within ``wait_s``
    (an error every rank hits), and otherwise prints its own, tagged with its rank (an error
    only it hit must not vanish while its peers wait in a collective). The store answers while
    the peers are blocked in NCCL, over TCP."""
    import datetime

    message = f"{error}"
    store = None
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        if store is not None:
            with contextlib.suppress(Exception):
                store.set(_ERROR_KEY, message)
        print(f"etp-train: error: {message}", file=sys.stderr, flush=True)
        return
    if store is not None:
        with contextlib.suppress(Exception):
            store.wait([_ERROR_KEY], datetime.timedelta(seconds=wait_s))
            if store.get(_ERROR_KEY).decode() == message:
                return
    print(f"etp-train: error (rank {rank}): {message}", file=sys.stderr, flush=True)


def run_rank(rank: int, world: int, recipe, options: RunOptions) -> int:
    """This torchrun rank's run; the exit status (input errors: one line from rank 0, 2)."""
    try:
        train(rank, world, recipe, options)
    except Exception as error:
        if not is_input_error(error):
            raise
        report_input_error(rank, error)
        # No destroy_process_group: peers may be inside a collective this rank never joins,
        # and destroying it would wait on them; torchrun ends them when this rank exits.
        return 2
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


def _spawned(rank, world, recipe, port, results, options) -> None:
    try:
        losses = train(rank, world, recipe, options, port)
        results.put((rank, losses, None))
    except BaseException as exc:  # noqa: BLE001 - report, then fail the run
        failure = ("input", str(exc)) if is_input_error(exc) else ("crash", traceback.format_exc())
        results.put((rank, None, failure))
        raise SystemExit(2 if is_input_error(exc) else 1) from exc
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def _collect(procs, results, grace_s: float = 60.0, poll_s: float = 1.0) -> list[tuple[int, str, str]]:
    """Every spawned rank's report (``(rank, losses, failure)`` on ``results``, ``failure`` None or
    ``(kind, text)``); the failures as ``(rank, kind, text)``, kind "input" (an input error's
    message) or "crash". A rank that dies without reporting is a crash named with how it ended,
    not a wait that never ends; the ranks still running are then given ``grace_s`` to notice
    (their collectives fail on the lost peer) before they are terminated."""
    failures, reported = [], set()
    deadline = None

    def take(report) -> None:
        rank, _, failure = report
        reported.add(rank)
        if failure:
            failures.append((rank, *failure))

    while len(reported) < len(procs):
        try:
            take(results.get(timeout=poll_s))
            continue
        except queue.Empty:
            pass
        dead = [r for r, proc in enumerate(procs) if r not in reported and proc.exitcode is not None]
        if dead:
            with contextlib.suppress(queue.Empty):  # reports put just before exiting are in the pipe
                while True:
                    take(results.get(timeout=poll_s))
            for r in dead:
                if r not in reported:
                    reported.add(r)
                    failures.append((r, "crash", f"died ({_exit_reason(procs[r].exitcode)}) without a report"))
                    deadline = deadline or time.monotonic() + grace_s
        if deadline is not None and time.monotonic() > deadline:
            for r, proc in enumerate(procs):
                if r not in reported:
                    proc.terminate()
                    reported.add(r)
                    failures.append((r, "crash", f"terminated {grace_s:.0f} s after a peer died"))
    return failures


def summarize(failures: list[tuple[int, str, str]]) -> tuple[str, int]:
    """What to print and the exit status: input errors once each, one line (every rank usually
    raises the same), status 2; with any crash, every failure in full, status 1."""
    if all(kind == "input" for _, kind, _ in failures):
        lines = dict.fromkeys(f"etp-train: error: {text}" for _, _, text in failures)
        return "\n".join(lines), 2
    return "etp-train failed:\n" + "\n".join(f"rank {rank}: {text}" for rank, _, text in failures), 1


def spawn_cpu_ranks(world: int, recipe, options: RunOptions) -> int:
    """Runs ``world`` gloo ranks on loopback; the exit status (2: an input error, 1: a failure)."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    procs = [context.Process(target=_spawned, args=(r, world, recipe, port, results, options)) for r in range(world)]
    for proc in procs:
        proc.start()
    if recipe.train.exit_signal_handler:  # a SIGTERM to this launcher reaches its ranks, which save and exit 0
        signal.signal(signal.SIGTERM, lambda signum, frame: [os.kill(p.pid, signum) for p in procs if p.is_alive()])
    failures = _collect(procs, results)
    for proc in procs:
        proc.join()
    if failures:
        text, status = summarize(failures)
        print(text, file=sys.stderr)
        return status
    return 0
