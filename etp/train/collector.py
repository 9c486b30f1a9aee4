"""The time Python's garbage collector takes, per log window, on every rank.

[Note: collector pauses]
An eager step is bound by its host, and every ETP gather waits for all ranks, so a pause on
one rank's host delays the whole group. CPython's full collections walk every tracked object
of the heap (the imported packages, the model's modules, the optimizer's state), and each rank
runs them at its own iterations, which makes them a suspect whenever eager iterations of one
command spread. ``CollectorPauses`` times every collection (``gc.callbacks``); the reporter
reads it at each log window, and the report carries each window's time on the slowest rank
(``gc_ms_per_iter_max_rank``), so a run shows whether its collector pauses matter. On the
flagship recipe they are negligible beside the spread (BENCHMARKS.md, "The recipes against
their peers"), and freezing the heap after the first iteration (``gc.freeze``) did not steady
the iterations, so it was not kept.

Example::

    pauses = CollectorPauses()
    ...one log window of iterations...
    ms = pauses.take()     # milliseconds spent collecting since the last take
    pauses.close()
"""
from __future__ import annotations

import gc
import time

__all__ = ["CollectorPauses"]


class CollectorPauses:
    """Milliseconds this process spent in garbage collections, per window (``take``)."""

    def __init__(self) -> None:
        self._began: float | None = None
        self._ms = 0.0
        self.collections = 0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self._ms += (time.perf_counter() - self._began) * 1e3
            self.collections += 1
            self._began = None

    def take(self) -> float:
        """The milliseconds collected since the previous ``take`` (or since construction)."""
        ms, self._ms = self._ms, 0.0
        return ms

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
