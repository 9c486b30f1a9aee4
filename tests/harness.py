"""Multi-process test harness: one process per rank on loopback, gloo (default) or NCCL.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` processes, initializes the
default process group in each on a free loopback port, calls ``fn(ctx, *args)`` with a
``RankContext`` and returns the list of per-rank results. A rank that raises fails the test
with that rank's traceback; a rank that hangs past the timeout fails it with the stack every
hung rank was stuck in (faulthandler), and all ranks are killed.

On gloo the ranks are forks of a forkserver that imported torch and megatron-core once (a
spawned rank imports them again: seconds per rank, most of the CPU suite's time); each rank
takes the test's environment as it is at the call. NCCL ranks are spawned.

Environment:
    ETP_TEST_BACKEND: ``gloo`` (default) or ``nccl`` (one GPU per rank).
    ETP_TEST_TIMEOUT: seconds per spawned run (default 180).
"""
from __future__ import annotations

import datetime
import faulthandler
import gc
import os
import pickle
import queue
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    backend: str
    device: torch.device


def backend() -> str:
    name = os.environ.get("ETP_TEST_BACKEND", "gloo")
    if name not in ("gloo", "nccl"):
        raise ValueError(f"ETP_TEST_BACKEND={name!r}: expected gloo or nccl")
    return name


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(fn, rank, world_size, port, backend_name, timeout, stack_dir, args, results, environ):
    # A forkserver child inherits the server's environment, not the test's (monkeypatch.setenv).
    os.environ.clear()
    os.environ.update(environ)
    # A hung rank dumps every thread's stack to a file the parent reads, then exits.
    stack_file = open(Path(stack_dir) / f"rank{rank}.txt", "w")
    faulthandler.dump_traceback_later(timeout, exit=True, file=stack_file)
    try:
        if backend_name == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
        torch.set_num_threads(1)  # N ranks share 2 cores: avoid oversubscription
        dist.init_process_group(
            backend_name,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
            **({"device_id": device} if backend_name == "nccl" else {}),
        )
        result = fn(RankContext(rank, world_size, backend_name, device), *args)
        # Plain pickle bytes, not the queue's own pickler: that one passes tensor storages as
        # file descriptors served by this process, which may have exited (after the barrier
        # below) before the parent unpickles them (FileNotFoundError in the parent).
        results.put((rank, "ok", pickle.dumps(result)))
        dist.barrier()
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()
        if dist.is_initialized():
            dist.destroy_process_group()
        # Exit without collecting: the interpreter's teardown would walk every object torch and
        # megatron-core made (most of a second per rank).
        gc.freeze()


def run_distributed(fn, world_size: int, *args, timeout: float | None = None):
    """Runs ``fn(ctx, *args)`` on ``world_size`` ranks; returns the results in rank order.

    ``fn`` must be a module-level function (it is pickled into spawned processes), and its
    return value picklable (CPU tensors, numbers).
    """
    timeout = float(timeout or os.environ.get("ETP_TEST_TIMEOUT", 180))
    name = backend()
    if name == "nccl" and torch.cuda.device_count() < world_size:
        import pytest

        pytest.skip(f"needs {world_size} GPUs, found {torch.cuda.device_count()}")
    for attempt in range(_PORT_ATTEMPTS):
        outcome, errors = _spawn(fn, world_size, args, timeout, name)
        # The free port can be taken between choosing it and rank 0 binding it (another test
        # process on the host): the rendezvous fails before fn runs, so a new port is safe.
        taken = any("EADDRINUSE" in e for e in errors) and not any(status == "ok" for status, _ in outcome.values())
        if not taken or attempt + 1 == _PORT_ATTEMPTS:
            break
    if errors:
        raise AssertionError(f"{fn.__name__} failed on {world_size} ranks ({name}):\n" + "\n".join(errors))
    return [outcome[r][1] for r in range(world_size)]


_PORT_ATTEMPTS = 3


#: What a CPU rank imports before its test runs: a forkserver imports it once, and each rank is
#: a fork of it (a spawned rank would import megatron-core again, seconds per rank).
_PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt", "etp"]


def _context(name: str):
    """forkserver on CPU; spawn with NCCL (a fork of a process that asked CUDA for its devices
    is not safe)."""
    if name == "nccl":
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def _spawn(fn, world_size: int, args, timeout: float, name: str):
    """One spawned run on a fresh port: (every rank's outcome, the error reports)."""
    context = _context(name)
    results = context.Queue()
    with tempfile.TemporaryDirectory() as stack_dir:
        port = _free_port()
        procs = [
            context.Process(
                target=_child,
                args=(fn, rank, world_size, port, name, timeout, stack_dir, args, results, dict(os.environ)),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        outcome: dict[int, tuple[str, object]] = {}
        deadline = time.monotonic() + timeout + 15
        while len(outcome) < world_size and time.monotonic() < deadline:
            try:
                rank, status, payload = results.get(timeout=0.5)
                outcome[rank] = (status, pickle.loads(payload) if status == "ok" else payload)
                if status == "error":
                    # Peers of a failed rank block in their next collective: give them a
                    # moment to report their own errors, then stop waiting.
                    deadline = min(deadline, time.monotonic() + 5)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        errors = [f"--- rank {r} raised:\n{p}" for r, (s, p) in sorted(outcome.items()) if s == "error"]
        missing = [r for r in range(world_size) if r not in outcome]
        for r in missing:
            stack = (Path(stack_dir) / f"rank{r}.txt").read_text()
            errors.append(
                f"--- rank {r} hung or died (exit code {procs[r].exitcode}); its stacks:\n{stack}"
            )
    return outcome, errors
