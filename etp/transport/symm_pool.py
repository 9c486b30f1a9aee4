"""SymmetricPool: one torch symmetric-memory allocation per shard group, carved into slots.

Allocating and rendezvousing symmetric memory is a collective that opens IPC handles to
every peer: it is done once per pool (at wrap time), never per step. Slots are reserved by
key first (``reserve``), then ``materialize`` allocates the whole pool, zeroes it (padding
rows of shards are structural zeros) and rendezvouses once. Every rank reserves the same
slots in the same order, so a slot has the same offset on every rank and a peer's slot is a
view of the peer's pool (``peer``).
"""
from __future__ import annotations

import logging
import warnings

import torch

__all__ = ["SymmetricPool", "flag_pad", "rendezvous_offset", "symm_mem_module"]

log = logging.getLogger("etp.transport")

_ALIGN = 256  # bytes: every slot starts on a 256-byte boundary (vector loads, copy engines)


def symm_mem_module(process_group=None):
    """``torch.distributed._symmetric_memory``, enabled for ``process_group`` where the torch
    version needs that (older ones); raises ImportError when torch has none."""
    import torch.distributed._symmetric_memory as symm_mem

    if process_group is not None and hasattr(symm_mem, "enable_symm_mem_for_group"):
        try:  # needed by older torch; newer versions rendezvous without it (and warn)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(process_group.group_name)
        except Exception:  # noqa: BLE001 - already enabled / deprecated: both fine
            pass
    return symm_mem


def rendezvous_offset(tensor: torch.Tensor, process_group) -> tuple:
    """Rendezvouses the symmetric ``tensor`` over ``process_group``; returns the handle and the
    byte offset of ``tensor`` inside its symmetric allocation. The offset is the same on every
    rank (same allocations in the same order), so rank ``r``'s copy of ``tensor`` starts at
    ``handle.buffer_ptrs[r] + offset``."""
    handle = symm_mem_module(process_group).rendezvous(tensor, process_group)
    return handle, tensor.data_ptr() - handle.buffer_ptrs[handle.rank]


def flag_pad(process_group, device: torch.device, words: int) -> tuple[torch.Tensor, list[int]]:
    """A zeroed symmetric pad of ``words`` int32 flags over ``process_group`` and its address on
    every rank (for ``etp.transport.stream_ops``). The caller synchronizes and barriers the
    group once its pads are set up, before any peer may write a flag."""
    pad = symm_mem_module(process_group).empty(words, dtype=torch.int32, device=device)
    pad.zero_()
    handle, offset = rendezvous_offset(pad, process_group)
    return pad, [ptr + offset for ptr in handle.buffer_ptrs]


class SymmetricPool:
    """Slots of one symmetric allocation over ``process_group`` on ``device``; with
    ``granularity``, slots whose size is a multiple of it get an exported allocation of their
    own instead, which an aliased gather buffer can map ([Note: aliased own rows] in
    etp/transport/vmm.py; ``owned``).

    Example::

        pool = SymmetricPool(group.ag_group, torch.device("cuda", 0))
        pool.reserve("w", (128, 64), torch.bfloat16)
        pool.materialize()
        local, peer1 = pool.slot("w"), pool.peer("w", 1)
    """

    def __init__(self, process_group, device: torch.device, granularity: int = 0) -> None:
        self.process_group = process_group
        self.device = device
        self.granularity = granularity
        self._slots: dict[object, tuple[int, tuple[int, ...], torch.dtype]] = {}
        self._owned: dict[object, tuple[tuple[int, ...], torch.dtype, int]] = {}  # key -> shape, dtype, bytes
        self._mappings: dict[tuple, object] = {}  # (key, rank or None) -> vmm.Mapping
        self._size = 0
        self.buffer: torch.Tensor | None = None
        self.handle = None
        self._views: dict[tuple, torch.Tensor] = {}
        self._base = 0

    def reserve(self, key, shape, dtype: torch.dtype) -> None:
        if self.buffer is not None:
            raise RuntimeError("SymmetricPool.reserve after materialize: reserve every slot first")
        if key in self._slots or key in self._owned:
            return
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        if self.granularity and nbytes % self.granularity == 0:
            self._owned[key] = (tuple(shape), dtype, nbytes)
            return
        self._slots[key] = (self._size, tuple(shape), dtype)
        self._size += -(-nbytes // _ALIGN) * _ALIGN

    def materialize(self) -> None:
        """Allocates, zeroes and rendezvouses the pool (a collective over the group)."""
        if self.buffer is not None or not (self._slots or self._owned):
            return
        symm_mem = symm_mem_module(self.process_group)
        # At least one aligned unit, so that the pool has a handle for barrier kernels.
        self.buffer = symm_mem.empty(max(self._size, _ALIGN), dtype=torch.uint8, device=self.device)
        self.buffer.zero_()
        # buffer_ptrs are the bases of the peers' allocations; this buffer may start inside
        # its allocation (a mem pool), at the same offset on every rank (same allocations).
        self.handle, self._base = rendezvous_offset(self.buffer, self.process_group)
        if self._owned:
            self._materialize_owned()
        log.info("etp transport: symmetric pool of %d slots, %d bytes; %d shards in allocations of their own",
                 len(self._slots), self._size, len(self._owned))

    def _materialize_owned(self) -> None:
        import torch.distributed as dist

        from .vmm import Mapping, exchange, release

        keys = list(self._owned)
        for key in keys:
            mapping = Mapping(self.device, [(None, self._owned[key][2])], exportable=True)
            mapping.tensor(torch.uint8, (mapping.nbytes,)).zero_()  # padding rows are structural zeros
            self._mappings[(key, None)] = mapping
        everyone = exchange(self.process_group, [self._mappings[(k, None)].handles[0] for k in keys], self.device)
        me = dist.get_rank(self.process_group)
        for rank, handles in enumerate(everyone):
            if rank == me:
                continue
            for key, handle in zip(keys, handles):
                try:
                    self._mappings[(key, rank)] = Mapping(self.device, [(handle, self._owned[key][2])])
                finally:
                    release(handle)  # the mapping keeps the peer's memory
        torch.cuda.synchronize(self.device)  # zeroed before any peer reads

    def __contains__(self, key) -> bool:
        return key in self._slots or key in self._owned

    def keys(self) -> list:
        return [*self._slots, *self._owned]

    def slot(self, key) -> torch.Tensor:
        """This rank's slot ``key`` (a view of the pool)."""
        return self.peer(key, None)

    def peer(self, key, rank: int | None) -> torch.Tensor:
        """Rank ``rank``'s slot ``key`` (None: this rank's), as a tensor this rank can read."""
        cached = self._views.get((key, rank))
        if cached is not None:
            return cached
        if key in self._owned:
            shape, dtype, _ = self._owned[key]
            view = self._mappings[(key, None if rank == self.handle.rank else rank)].tensor(dtype, shape)
        else:
            offset, shape, dtype = self._slots[key]
            nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            if rank is None:
                view = self.buffer[offset : offset + nbytes].view(dtype).view(shape)
            else:
                whole = self.handle.get_buffer(rank, (self._size,), torch.uint8, self._base)
                view = whole[offset : offset + nbytes].view(dtype).view(shape)
        self._views[(key, rank)] = view
        return view

    def owned(self, key) -> int | None:
        """The allocation handle of this rank's slot ``key`` when it is an allocation of its own
        (mappable whole by an aliased buffer; the pool keeps it), else None."""
        mapping = self._mappings.get((key, None))
        return None if mapping is None else mapping.handles[0]

    def barrier(self, channel: int) -> None:
        """Symmetric-memory barrier on the current stream (a one-CTA signal kernel)."""
        self.handle.barrier(channel=channel)

    def nbytes(self) -> int:
        if self.buffer is None:
            return 0
        return self._size + sum(m.nbytes for (k, r), m in self._mappings.items() if r is None)
