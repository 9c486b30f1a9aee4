"""Python's garbage collector, kept out of the step: the heap frozen after the first iteration,
and the time collections take measured per log window on every rank.

[Note: collector pauses]
An eager step is bound by its host, and every ETP gather waits for all ranks, so a pause on one
rank's host delays the whole group. CPython's full collection walks every tracked object of
the heap: the imported packages (torch, megatron-core), the model's modules and parameters,
the optimizer's state. The autograd graph of each micro-batch lives through its forward and
backward, so its objects survive the young collections and are promoted to the oldest
generation as they go; once enough have been promoted a full collection runs, each rank at
its own iteration. The objects alive after the first iteration (set-up, the first step's lazy
state, a captured graph) live for the whole run: ``freeze_heap`` moves them to the permanent
generation (``gc.freeze``), which no collection walks, so a later full collection walks only
what the steps themselves keep. Garbage cycles are still found and freed; an object frozen
alive that later becomes a cycle of garbage is not, so the heap is unfrozen when training ends.

``CollectorPauses`` times every collection (``gc.callbacks``); the reporter reads it at each
log window, and the report carries each window's time on the slowest rank.

Example::

    pauses = CollectorPauses()
    ...one iteration...
    freeze_heap()
    ms = pauses.take()     # milliseconds spent collecting since the last take
    pauses.close()
"""
from __future__ import annotations

import contextlib
import gc
import time

__all__ = ["CollectorPauses", "freeze_heap", "unfreeze_heap"]


def freeze_heap() -> int:
    """Collects once, then freezes every object alive; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def unfreeze_heap() -> None:
    """Returns the frozen objects to the collector (training is over)."""
    gc.unfreeze()


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

    @contextlib.contextmanager
    def uncounted(self):
        """Collections inside this block are left out of the window."""
        kept = self._ms
        try:
            yield
        finally:
            self._ms = kept

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
