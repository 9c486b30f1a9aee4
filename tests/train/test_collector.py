"""The collector's pauses measured per window ([Note: collector pauses] in
etp/train/collector.py)."""
import gc

from etp.train.collector import CollectorPauses


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
