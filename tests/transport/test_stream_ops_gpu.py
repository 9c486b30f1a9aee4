"""Stream memory operations (etp.transport.stream_ops) on a real GPU: a wait on one stream
really holds back the work queued behind it until another stream's write lands, and a
write is ordered after the work queued before it. One GPU; skipped without CUDA."""
import pytest
import torch

from etp.transport.stream_ops import wait_value_geq, write_value

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_wait_holds_back_the_stream_until_the_write_lands():
    flag = torch.zeros(4, dtype=torch.int32, device="cuda")
    x = torch.zeros(1 << 20, device="cuda")
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    # Load the kernels first: with lazy module loading a kernel's first launch blocks the host
    # while a stream is parked on a flag, and the producer below would never be enqueued.
    torch.cuda._sleep(1)
    x.fill_(1.0)
    x.mul_(2.0)
    x.zero_()
    torch.cuda.synchronize()
    with torch.cuda.stream(consumer):
        wait_value_geq(flag.data_ptr() + 4, 7)  # not yet: the producer writes 7 after ~50 ms
        x.mul_(2.0)  # must see the producer's fill of 1.0, not the zeros
    with torch.cuda.stream(producer):
        torch.cuda._sleep(50_000_000)
        x.fill_(1.0)
        write_value(flag.data_ptr() + 4, 7)  # fenced: the fill is visible before the flag
    torch.cuda.synchronize()
    assert torch.all(x == 2.0)
    assert flag.tolist() == [0, 7, 0, 0]


def test_wait_is_a_signed_comparison_past_the_value():
    flag = torch.full((1,), 9, dtype=torch.int32, device="cuda")
    wait_value_geq(flag.data_ptr(), 5)  # already past: returns at once
    write_value(flag.data_ptr(), 11)
    torch.cuda.synchronize()
    assert flag.item() == 11
