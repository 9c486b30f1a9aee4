"""The transport seam: how gathered weight bytes and reduced gradient bytes move.

[Note: ETP transports]
The runtime asks a ``GatherTransport`` to "gather these rows into this buffer" and a
``ReduceTransport`` to "reduce-scatter this full gradient into this shard"; it never knows
which transport moved the bytes. One pair is chosen per shard group, once, at wrap time
(``etp.transport.choose_transports``, logged once), from ``ETPConfig.transport``:

* ``nccl``: ``all_gather_into_tensor`` on the group's AG communicator and
  ``reduce_scatter_tensor`` on its RS communicator, in the gradient's dtype (NCCL kernels:
  SMs and HBM bandwidth taken from the GEMMs beside them; on gloo the same calls are the CPU
  path).
* ``copy_engine``: every rank's wire shard lives in a torch symmetric-memory pool; a gather
  is one ``copy_`` per peer out of the peers' pool (cudaMemcpyAsync on the copy engines) and a
  reduce-scatter pushes each peer's rows of the 16-bit weight gradient to it the same way
  ([Note: push reduce-scatter]), with the fp32 sum added into ``main_grad`` on the compute
  stream. Both are fenced by stream flag operations: no SM beside the GEMMs.

Both kinds of work are issued on the caller's current stream (the runtime makes that the AG
or RS side stream) and return a handle; ``handle.wait()`` makes the *current* stream wait for
the result and runs what is left to do (the NCCL reduction divides and adds into
``main_grad`` there). Synchronous calls return an already-waited handle's result.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch

from ..groups import ShardGroup
from ..streams import current_stream

__all__ = ["GatherTransport", "ReduceTransport", "SixteenBitWireReduce", "Handle", "DoneHandle", "EventHandle"]


class Handle(ABC):
    """Completion of one gather or reduction, waited for on the consumer's stream."""

    @abstractmethod
    def wait(self) -> torch.Tensor | None:
        """Makes the current stream wait for the work and returns its result tensor."""


class DoneHandle(Handle):
    """Work already complete (synchronous calls, groups of one); ``then`` runs at wait."""

    def __init__(self, result: torch.Tensor | None, then: Callable[[], torch.Tensor | None] | None = None):
        self.result, self.then = result, then

    def wait(self) -> torch.Tensor | None:
        return self.then() if self.then is not None else self.result


class EventHandle(Handle):
    """Work issued on a side stream; a CUDA event recorded behind it (None on CPU)."""

    def __init__(self, result: torch.Tensor | None, event: torch.cuda.Event | None,
                 keep: tuple = (), then: Callable[[], torch.Tensor | None] | None = None):
        self.result, self.event, self.keep, self.then = result, event, keep, then

    def wait(self) -> torch.Tensor | None:
        if self.event is not None:
            current_stream().wait_event(self.event)
        self.keep = ()
        return self.then() if self.then is not None else self.result


class GatherTransport(ABC):
    """Moves equal row shards of a group into one ``[size * rows, cols]`` buffer."""

    name: str = "?"

    def home(self, param: torch.Tensor) -> torch.Tensor | None:
        """Where ``param``'s wire shard must live for this transport (None: anywhere)."""
        return None

    @abstractmethod
    def gather(self, source: torch.Tensor, group: ShardGroup, out: torch.Tensor, async_op: bool) -> Handle:
        """Gathers ``source`` (this rank's ``[rows, cols]``) of every rank into ``out``."""

    def nbytes(self) -> int:
        """Bytes this transport holds beyond the parameters (reported to the audit)."""
        return 0

    # The weight cache's ticket buffers; a transport that aliases them overrides all three
    # ([Note: aliased own rows] in etp/transport/vmm.py).
    def allocate_backing(self, param: torch.Tensor, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new ticket buffer for gathers of ``param`` (and of every weight sharing its key)."""
        return torch.empty(shape, dtype=dtype, device=device)

    def alias(self, param: torch.Tensor, backing: torch.Tensor) -> torch.Tensor:
        """What a gather of ``param`` writes into on the ticket buffer ``backing``."""
        return backing

    def release_buffers(self) -> None:
        """The weight cache dropped its ticket buffers."""
        return None


class ReduceTransport(ABC):
    """Sums a full ``[size * rows, cols]`` gradient over a group into this rank's rows."""

    name: str = "?"

    def wire_dtype(self, param_dtype: torch.dtype, grad_dtype: torch.dtype) -> torch.dtype:
        """The dtype the full weight gradient is written (and sent) in."""
        return grad_dtype

    @abstractmethod
    def reduce_scatter(self, full: torch.Tensor, group: ShardGroup, target: torch.Tensor | None,
                       mean: bool, async_op: bool) -> Handle:
        """Issues ``target += reduce(full)[my rows]`` (``reduce`` = sum, or mean when
        ``mean``); with ``target`` None the handle's result is a new reduced shard."""

    def nbytes(self) -> int:
        return 0


class SixteenBitWireReduce(ReduceTransport):
    """A reduction whose wire is the 16-bit parameter dtype (bf16 / fp16) with fp32 sums at the
    receiver; fp32 / fp64 parameters send their gradient dtype."""

    WIRE_16 = (torch.bfloat16, torch.float16)

    def wire_dtype(self, param_dtype: torch.dtype, grad_dtype: torch.dtype) -> torch.dtype:
        return param_dtype if param_dtype in self.WIRE_16 else grad_dtype
