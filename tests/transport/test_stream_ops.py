"""``stream_ops.MemoryOps`` on CPU: the parameters it hands ``cuStreamBatchMemOp`` (the driver
replaced by a recorder), laid out as CUDA's ``CUstreamBatchMemOpParams`` wait / write members
(operation at byte 0, address at 8, value at 16, flags at 24; 48 bytes each), in order, in
calls of at most 255, with a new value after ``set_value``. The driver itself runs in
``test_stream_ops_gpu.py``."""
import ctypes
import struct

import pytest

import etp.transport.stream_ops as stream_ops
from etp.transport.stream_ops import WAIT_GEQ, WRITE, MemoryOps


@pytest.fixture
def calls(monkeypatch):
    recorded = []

    def batch(handle, count, params, flags):
        raw = ctypes.string_at(ctypes.cast(params, ctypes.c_void_p).value, 48 * count)  # what the real call reads
        recorded.append((handle, flags, [struct.unpack_from("<I4xQQI", raw, 48 * i) for i in range(count)]))
        return 0

    monkeypatch.setattr(stream_ops, "_driver", lambda: {"cuStreamBatchMemOp": batch})
    return recorded


def test_operations_go_in_order_with_cuda_layout(calls):
    MemoryOps([(WAIT_GEQ, 0x1000, 1), (WRITE, 0x1004, 0), (WRITE, 0x2000, (1 << 32) + 5)]).enqueue(77)
    # CU_STREAM_MEM_OP_WAIT_VALUE_32 = 1, WRITE_VALUE_32 = 2; values taken modulo 2**32; flags 0
    assert calls == [(77, 0, [(1, 0x1000, 1, 0), (2, 0x1004, 0, 0), (2, 0x2000, 5, 0)])]


def test_long_batches_split_into_driver_calls_of_255(calls):
    MemoryOps([(WRITE, 4 * i, i) for i in range(600)]).enqueue(1)
    assert [len(ops) for _, _, ops in calls] == [255, 255, 90]
    assert [op[1] for _, _, ops in calls for op in ops] == [4 * i for i in range(600)]
    assert [op[2] for _, _, ops in calls for op in ops] == list(range(600))


def test_set_value_changes_every_value_and_nothing_else(calls):
    ops = MemoryOps([(WRITE, 0x10, 1), (WAIT_GEQ, 0x20, 1)] * 200)
    ops.set_value(-3)
    ops.enqueue(5)
    sent = [op for _, _, chunk in calls for op in chunk]
    assert len(sent) == 400
    assert sent[:2] == [(2, 0x10, 0xFFFFFFFD, 0), (1, 0x20, 0xFFFFFFFD, 0)] and sent[-1] == (1, 0x20, 0xFFFFFFFD, 0)


def test_an_empty_batch_calls_nothing(calls):
    MemoryOps([]).enqueue(1)
    assert calls == []


def test_an_unknown_kind_is_refused(calls):
    with pytest.raises(ValueError, match="kind 3"):
        MemoryOps([(3, 0, 0)])


def test_a_driver_error_names_the_call(monkeypatch):
    monkeypatch.setattr(stream_ops, "_driver", lambda: {"cuStreamBatchMemOp": lambda *a: 1})
    with pytest.raises(RuntimeError, match=r"cuStreamBatchMemOp\(1 operations\) failed with CUDA driver error 1"):
        MemoryOps([(WRITE, 0, 0)]).enqueue(1)
