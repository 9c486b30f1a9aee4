"""FlagBarrier: a barrier over a process group built from stream memory operations.

A symmetric-memory barrier (``handle.barrier``) is a one-CTA kernel that spins on an SM until
every peer arrives; the copy-engine gather needs two per gather, so an expert stack's dozens
of them would each hold an SM beside the GEMMs while they spin. Here a
barrier is, on the current stream, one fenced flag write into every peer's pad ("this rank
reached barrier ``n`` of channel ``c``") and one flag wait per peer on this rank's own pad
("peer ``p`` reached it"), all in one ``cuStreamBatchMemOp`` (``stream_ops.MemoryOps``, laid
out once per channel; only the barrier number changes): the stream's front end, no kernel, no
SM. The write's memory fence orders everything the stream did before it (the peer copies of a
gather, the optimizer's update of a shard the stream waited for) before the flag, as the
kernel barrier's release/acquire does.

Channels: each stream that fences gets its own channel (a row of the pad), so a synchronous
gather on the compute stream never pairs with a prefetch on the gather stream. Barrier numbers
count per channel on the host; every rank fences the same gathers on the same channels in the
same order (the program is the same everywhere), so number ``n`` of channel ``c`` means the
same point everywhere. Waits are ``>=`` (wrap-safe), so a peer running one barrier ahead is
harmless.

Flag values are baked into a CUDA graph at capture: callers fence with the kernel barrier
while capturing (``CopyEngineGather._fence``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .symm_pool import flag_pad

__all__ = ["FlagBarrier"]


class FlagBarrier:
    """Kernel-free barriers over ``process_group`` on up to ``channels`` streams.

    Example::

        barrier = FlagBarrier(group.ag_group, torch.device("cuda", 0))
        barrier.materialize()          # collective, once
        barrier(channel=0)             # on the current stream: write to peers, wait for them
    """

    # Every stream that ever fences takes a channel for good (a GraphedStep's warm-up stream is
    # new each capture), so the pad has room for many: 256 x world int32s.
    def __init__(self, process_group, device: torch.device, channels: int = 256) -> None:
        self.process_group, self.device, self.channels = process_group, device, channels
        self.rank = dist.get_rank(process_group)
        self.world = dist.get_world_size(process_group)
        self._pads: list[int] | None = None  # the pad's address on every rank
        self._pad = None  # keeps this rank's pad alive
        self._count = [0] * channels
        self._fences: dict[int, object] = {}  # channel -> its MemoryOps (addresses fixed, values set per barrier)

    def materialize(self) -> None:
        """Allocates, zeroes and rendezvouses the flag pads (a collective over the group)."""
        if self._pads is not None:
            return
        self._pad, self._pads = flag_pad(self.process_group, self.device, self.channels * self.world)
        torch.cuda.synchronize(self.device)  # every pad zeroed before any peer may write one
        dist.barrier(group=self.process_group)

    def _flag(self, owner: int, channel: int, arriving: int) -> int:
        return self._pads[owner] + 4 * (channel * self.world + arriving)

    def __call__(self, channel: int, stream: torch.cuda.Stream | int | None = None) -> None:
        """Barrier number ``n + 1`` of ``channel`` on ``stream`` (default: the current stream; or
        its raw ``cuda_stream`` handle)."""
        if not 0 <= channel < self.channels:
            raise RuntimeError(
                f"etp flag barrier: channel {channel} out of range: {self.channels} streams fence "
                "gathers at most (one channel per stream that ever gathered, e.g. one per GraphedStep "
                "warm-up); use transport='nccl' for a process that gathers on that many streams")
        self._count[channel] += 1
        value = self._count[channel]
        fence = self._fences.get(channel)
        if fence is None:
            fence = self._fences[channel] = self._fence(channel)
        fence.set_value(value)
        fence.enqueue(stream)

    def _fence(self, channel: int):
        """Arrive at every peer, then wait for every peer's arrival: one batch, one driver call."""
        from .stream_ops import WAIT_GEQ, WRITE, MemoryOps

        steps = range(1, self.world)
        return MemoryOps([(WRITE, self._flag((self.rank + step) % self.world, channel, self.rank), 0) for step in steps]
                         + [(WAIT_GEQ, self._flag(self.rank, channel, (self.rank - step) % self.world), 0)
                            for step in steps])

    def nbytes(self) -> int:
        """The flag pad (symmetric memory, outside torch's allocator)."""
        return 0 if self._pad is None else self._pad.numel() * 4
