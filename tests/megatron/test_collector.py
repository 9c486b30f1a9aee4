"""The collector's pauses measured and the heap frozen after the first iteration
([Note: collector pauses] in etp/megatron/trainer/collector.py)."""
import gc
import weakref

from etp.megatron.trainer.collector import CollectorPauses, freeze_heap, unfreeze_heap


class _Node:
    def __init__(self):
        self.other = None


def _cycle():
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return a


def test_pauses_count_every_collection_and_reset_on_take():
    pauses = CollectorPauses()
    try:
        pauses.take()
        before = pauses.collections
        garbage = [_cycle() for _ in range(20000)]
        del garbage
        gc.collect()
        assert pauses.collections > before
        assert pauses.take() > 0
        assert pauses.take() == 0.0
    finally:
        pauses.close()
    assert pauses._callback not in gc.callbacks


def test_freeze_moves_live_objects_out_of_every_generation_and_still_frees_new_cycles():
    alive = _Node()
    try:
        assert freeze_heap() >= 1
        assert gc.get_freeze_count() > 0
        tracked = {id(o) for generation in range(3) for o in gc.get_objects(generation)}
        assert id(alive) not in tracked  # frozen: no collection walks it
        late = _cycle()
        freed = []
        weakref.finalize(late, freed.append, True)
        del late
        gc.collect()
        assert freed == [True]  # a cycle made after the freeze is still collected
    finally:
        unfreeze_heap()
    assert gc.get_freeze_count() == 0


def test_uncounted_collections_stay_out_of_the_window():
    pauses = CollectorPauses()
    try:
        pauses.take()
        with pauses.uncounted():
            gc.collect()
        assert pauses.take() == 0.0
    finally:
        pauses.close()
