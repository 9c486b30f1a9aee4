"""When an etp-train run stops before its last iteration, and how every rank agrees on it.

[Note: early exits]
Megatron-LM's three ways, with its keys and meanings; each saves a checkpoint first (when the
run has ``save``) and then exits 0, so a launcher that restarts on failure does not, and the
next launch of the same command resumes ([Note: restarts] in ``checkpointing.py``):

* ``exit_signal_handler: true``: a SIGTERM (a scheduler's preemption, ``scancel``, torchrun
  passing one on) is recorded by a handler and acted on at the next iteration boundary;
* ``exit_duration_in_mins: M``: the run has been going for M minutes;
* ``exit_interval: N``: the iteration just done is a multiple of N.

A signal reaches ranks at different moments, and the clock of one rank may pass the duration
an iteration before another's: so the first two are decided together. Every rank adds its
two flags into a max all-reduce over a gloo group (CPU tensors: no device synchronization,
so the sync-free step stays sync-free), once per iteration, and all stop after the same one.
``exit_interval`` needs no vote.

Example::

    exits = EarlyExit(recipe, time.monotonic())
    exits.install()
    ...after each iteration: reason = exits.reason(iteration + 1)
    if reason: save, print(reason), return
"""
from __future__ import annotations

import signal
import threading
import time

import torch
import torch.distributed as dist

__all__ = ["EarlyExit"]


class EarlyExit:
    """The recipe's early-exit conditions for one rank ([Note: early exits]).

    Args:
        recipe: the run's (``exit_signal_handler``, ``exit_duration_in_mins``, ``exit_interval``).
        started: ``time.monotonic()`` when the run started.
        group: the gloo group the ranks vote over (None: the default group, which must be gloo;
            made by the caller on NCCL runs).
    """

    def __init__(self, recipe, started: float, group=None) -> None:
        t = recipe.train
        self.on_signal = bool(t.exit_signal_handler)
        self.duration_s = None if t.exit_duration_in_mins is None else 60.0 * t.exit_duration_in_mins
        self.interval = t.exit_interval
        self.started, self.group = started, group
        self.received: int | None = None
        self._previous = None

    @property
    def votes(self) -> bool:
        """Whether the ranks vote every iteration (a signal or a duration to watch for)."""
        return self.on_signal or self.duration_s is not None

    def install(self) -> None:
        """Records SIGTERM instead of dying of it (``exit_signal_handler``; main thread only)."""
        if self.on_signal and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._record)

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _record(self, signum, frame) -> None:
        self.received = signum

    def reason(self, done: int) -> str | None:
        """Why the run stops after ``done`` iterations, or None; the same answer on every rank."""
        if self.votes:
            flags = torch.tensor([self.received is not None,
                                  self.duration_s is not None and time.monotonic() - self.started >= self.duration_s],
                                 dtype=torch.int32)
            if dist.is_initialized() and dist.get_world_size(self.group) > 1:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
            if flags[0]:
                return "SIGTERM received (exit_signal_handler)"
            if flags[1]:
                return f"ran for exit_duration_in_mins={self.duration_s / 60:g}"
        if self.interval and done % self.interval == 0:
            return f"iteration {done} is a multiple of exit_interval={self.interval}"
        return None
