"""Stream memory operations (etp.transport.stream_ops) on a real GPU: a wait on one stream
really holds back the work queued behind it until another stream's write lands, a write is
ordered after the work queued before it, a batch runs in its order, and a batch longer than
one driver call and a changed value arrive whole. One GPU; skipped without CUDA."""
import pytest
import torch

from etp.transport.stream_ops import WAIT_GEQ, WRITE, MemoryOps

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _load_kernels(x: torch.Tensor) -> None:
    # With lazy module loading a kernel's first launch blocks the host while a stream is
    # parked on a flag, and the producer below would never be enqueued: load them first.
    torch.cuda._sleep(1)
    x.fill_(1.0)
    x.mul_(2.0)
    x.zero_()
    torch.cuda.synchronize()


def test_wait_holds_back_the_stream_until_the_write_lands():
    """A wait, then the writes after it in the same batch: they land after the producer's
    write, in order (two writes to one word: the last remains)."""
    flag = torch.zeros(8, dtype=torch.int32, device="cuda")
    x = torch.zeros(1 << 20, device="cuda")
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    _load_kernels(x)
    base = flag.data_ptr()
    with torch.cuda.stream(consumer):
        # not yet: the producer writes 7 after ~50 ms
        MemoryOps([(WAIT_GEQ, base + 4, 7), (WRITE, base + 8, 3), (WRITE, base + 8, 4), (WRITE, base + 12, 5)]).enqueue()
        x.mul_(2.0)  # must see the producer's fill of 1.0, not the zeros
    with torch.cuda.stream(producer):
        torch.cuda._sleep(50_000_000)
        x.fill_(1.0)
        MemoryOps([(WRITE, base + 4, 7)]).enqueue()  # fenced: the fill is visible before the flag
    torch.cuda.synchronize()
    assert torch.all(x == 2.0)
    assert flag.tolist() == [0, 7, 4, 5, 0, 0, 0, 0]


def test_wait_is_a_signed_comparison_past_the_value():
    flag = torch.full((1,), 9, dtype=torch.int32, device="cuda")
    MemoryOps([(WAIT_GEQ, flag.data_ptr(), 5), (WRITE, flag.data_ptr(), 11)]).enqueue()  # 9 is past 5
    torch.cuda.synchronize()
    assert flag.item() == 11


def test_a_batch_longer_than_one_driver_call_and_a_new_value():
    flag = torch.zeros(600, dtype=torch.int32, device="cuda")
    ops = MemoryOps([(WRITE, flag.data_ptr() + 4 * i, i + 1) for i in range(600)])
    ops.enqueue(torch.cuda.current_stream())
    torch.cuda.synchronize()
    assert flag.tolist() == list(range(1, 601))
    ops.set_value(-1)  # modulo 2**32: every word 0xFFFFFFFF
    ops.enqueue()
    torch.cuda.synchronize()
    assert flag.tolist() == [-1] * 600
