"""The only place etp creates CUDA streams and events.

[Note: ETP streams]
Each (chain class, shard group) gets two side streams:

* ``ag``: weight all-gathers, so the next weight arrives while the current GEMM runs;
* ``rs``: weight-gradient reduce-scatters, so reductions leave the backward critical path.

AG and RS run on different communicators too (``ShardGroup.ag_group`` / ``rs_group``), so
NCCL can execute them at the same time. Graphed and eager chains never share streams: a
stream shared across a CUDA-graph boundary leaves a stale event at replay.

Anything handed from one stream to another carries an event: a side stream waits on an
event recorded on the producer's stream before it reads (the shard written by the
optimizer, the wgrad written by the GEMM), and the consumer waits on the collective's work
handle before it reads the result. On CPU every stream is a no-op and events are None;
gloo work handles give the same asynchrony.

A buffer a side stream will write is allocated *before* the event it waits on is recorded:
an allocation may itself enqueue a write on the current stream (torch's deterministic mode
fills new memory with NaN), and that write must come before the side stream's, not race
it. (Found as NaN gradients on 2 GPUs: a ticket buffer first allocated by a prefetch, behind
the event, was NaN-filled after its gather had landed.)
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

__all__ = ["CommStreams", "StreamRegistry", "current_raw_stream", "current_stream", "current_stream_event",
           "to_device_async", "warmup_stream"]


@dataclass(frozen=True)
class CommStreams:
    """The AG and RS side streams of one (chain class, group); None on CPU."""

    ag: torch.cuda.Stream | None
    rs: torch.cuda.Stream | None

    def use(self, stream: torch.cuda.Stream | None):
        """Context that makes ``stream`` current (nothing on CPU)."""
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    @staticmethod
    def wait(stream: torch.cuda.Stream | None, event: torch.cuda.Event | None) -> None:
        """Makes ``stream`` wait for ``event`` (no-op on CPU)."""
        if stream is not None and event is not None:
            stream.wait_event(event)


_STREAMS: dict = {}  # (device index, raw cudaStream_t) -> its torch.cuda.Stream


def _index(device: torch.device | int | None) -> int:
    if isinstance(device, torch.device):
        return device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.current_device() if device is None else device


def current_raw_stream(device: torch.device | int | None = None) -> int:
    """``device``'s (default: the current device's) current stream as a raw ``cudaStream_t``
    (what driver calls such as ``cuStreamBatchMemOp`` take), without making a
    ``torch.cuda.Stream`` object (see ``current_stream``)."""
    return torch._C._cuda_getCurrentRawStream(_index(device))


def current_stream(device: torch.device | int | None = None) -> torch.cuda.Stream:
    """``torch.cuda.current_stream(device)`` for the hot paths: the raw handle is read (well
    under a microsecond) and its ``torch.cuda.Stream`` object made once. Making one each call,
    as ``torch.cuda.current_stream`` does, costs several microseconds of host time (measured by
    ``tools/diag/bench_host_ops.py``), and an eager step asks hundreds of times. The same raw handle
    is the same stream (torch's pool streams live as long as the process; an external stream's
    id is its handle).

    Example::

        current_stream(x.device).wait_event(event)
    """
    index = _index(device)
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    stream = _STREAMS.get(key)
    if stream is None:
        stream = _STREAMS[key] = torch.cuda.current_stream(index)
    return stream


def current_stream_event(device: torch.device) -> torch.cuda.Event | None:
    """An event recorded now on ``device``'s current stream (None on CPU): what a side
    stream waits on before reading anything the current stream produced."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(current_stream(device))
    return event


def to_device_async(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` copied to ``device`` without making the host wait for the GPU: from pinned
    memory, non-blocking. A pageable source makes the driver wait until the stream has run
    everything queued before the copy, and the GPU then idles while Python catches up (seen
    in traces as a gap after ``Memcpy HtoD (Pageable -> Device)``).

    Example::

        index = to_device_async(torch.tensor([0, 0, 1]), torch.device("cuda"))
    """
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def warmup_stream(device: torch.device) -> torch.cuda.Stream:
    """A fresh side stream for the warm-up passes before a CUDA-graph capture (torch's
    recipe: warm-up off the default stream, so lazily made handles and autograd's stream
    state match the capture's)."""
    return torch.cuda.Stream(device)


class StreamRegistry:
    """Creates and keeps the ``CommStreams`` of each (chain class, group ranks, device)."""

    def __init__(self) -> None:
        self._streams: dict[tuple, CommStreams] = {}

    def get(self, chain_class: str, ranks: tuple[int, ...], device: torch.device) -> CommStreams:
        key = (chain_class, ranks, device)
        if key not in self._streams:
            if device.type == "cuda":
                # Priority -1 (high): a gather the next GEMM waits on should not queue behind
                # compute kernels in the hardware scheduler.
                self._streams[key] = CommStreams(
                    torch.cuda.Stream(device, priority=-1), torch.cuda.Stream(device, priority=-1)
                )
            else:
                self._streams[key] = CommStreams(None, None)
        return self._streams[key]

    def side_streams(self) -> list[torch.cuda.Stream]:
        """Every AG and RS stream made so far, in the order ``get`` made them (none on CPU):
        what a caller that must see all of etp's side-stream work, a timer's end event for
        one, makes its stream wait on.

        Example::

            for stream in etp.runtime_of(model).streams.side_streams():
                torch.cuda.current_stream().wait_stream(stream)
        """
        return [stream for pair in self._streams.values() for stream in (pair.ag, pair.rs) if stream is not None]

    def clear(self) -> None:
        self._streams.clear()
