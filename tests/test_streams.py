"""``etp.streams.StreamRegistry.side_streams``: every AG and RS stream ``get`` made, in order,
each once (under the stream model of tests/stream_model.py on CPU, and on a GPU); none on
plain CPU, where side streams are None."""
import pytest
import torch
from stream_model import installed

import etp.streams as streams

CPU = torch.device("cpu")


def _made(device):
    registry = streams.StreamRegistry()
    eager = registry.get("eager", (0, 1), device)
    graphed = registry.get("graphed", (0, 1), device)
    again = registry.get("eager", (0, 1), device)  # kept: no new streams
    return registry, [eager.ag, eager.rs, graphed.ag, graphed.rs], again is eager


def _same(got, want):
    return len(got) == len(want) and all(a is b for a, b in zip(got, want))


def test_side_streams_are_every_stream_get_made():
    with installed():
        registry, made, kept = _made(CPU)
        assert kept and _same(registry.side_streams(), made)
        registry.clear()
        assert registry.side_streams() == []


def test_side_streams_on_plain_cpu_are_none():
    registry, made, _ = _made(CPU)
    assert made == [None] * 4 and registry.side_streams() == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_side_streams_on_a_gpu_are_the_streams_get_made():
    registry, made, kept = _made(torch.device("cuda", torch.cuda.current_device()))
    assert kept and _same(registry.side_streams(), made) and len({s.cuda_stream for s in made}) == 4
