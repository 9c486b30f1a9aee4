"""etp.megatron.host_gc: collections counted per generation."""
from __future__ import annotations

import gc

from etp.megatron.host_gc import GcClock


def test_clock_counts_collections_by_generation():
    clock = GcClock()
    try:
        clock.take()
        gc.collect(0)
        gc.collect(2)
        taken = clock.take()
        assert taken["collections"][0] >= 1 and taken["collections"][2] >= 1
        assert all(ms >= 0 for ms in taken["ms"])
        assert clock.take()["collections"] == [0, 0, 0]
    finally:
        clock.close()
