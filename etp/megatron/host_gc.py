"""Python's garbage collector in the training loop, measured.

[Note: garbage collection in an eager step]
An eager step is bound by its host, so a pause of the host is a pause of the step, and a
collection of the oldest generation walks every tracked object of the process (megatron-core's
modules, their parameters, the optimizer's state). ``GcClock`` counts collections and their
host time per generation (``gc.callbacks``); ``etp-train --timeline`` prints them per
iteration. Measured on the flagship recipe (2xH200, BENCHMARKS.md session 17): under one
young-generation collection per iteration, 0.2-0.3 ms, and no oldest-generation collection,
with the collector off (Megatron-LM's ``--manual-gc``) no faster: so etp-train leaves the
collector alone.

Example::

    clock = GcClock()
    train_steps()
    print(clock.take())   # {"collections": [gen0, gen1, gen2], "ms": [...]}
"""
from __future__ import annotations

import gc
import time
import weakref

__all__ = ["GcClock"]

_CLOCKS: "weakref.WeakSet[GcClock]" = weakref.WeakSet()


def _dispatch(phase: str, info: dict) -> None:
    for clock in list(_CLOCKS):
        clock._callback(phase, info)


class GcClock:
    """Collections and their host time per generation, since the last ``take()``."""

    def __init__(self) -> None:
        self._began: float | None = None
        self._counts = [0, 0, 0]
        self._ms = [0.0, 0.0, 0.0]
        # One module-level callback for every clock, each held weakly: a clock dropped with
        # its timeline leaves no callback behind.
        if _dispatch not in gc.callbacks:
            gc.callbacks.append(_dispatch)
        _CLOCKS.add(self)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            generation = min(int(info.get("generation", 2)), 2)
            self._counts[generation] += 1
            self._ms[generation] += (time.perf_counter() - self._began) * 1e3
            self._began = None

    def take(self) -> dict:
        """``{"collections": [gen0, gen1, gen2], "ms": [...]}`` since the last call; resets."""
        out = {"collections": list(self._counts), "ms": [round(v, 3) for v in self._ms]}
        self._counts, self._ms = [0, 0, 0], [0.0, 0.0, 0.0]
        return out

    def close(self) -> None:
        _CLOCKS.discard(self)
