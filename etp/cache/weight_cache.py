"""WeightCache: stable gather buffers, one ticket per (param, role).

[Note: ETP buffer keys]
A ticket's buffer is looked up by ``BufferKey(shape, dtype, role, expert_index, parity,
device, chain)``;
tickets with equal keys share one buffer, which bounds memory to two buffers per shape and
role. ``parity`` is the param's position in its chain modulo 2, so chain neighbours (a
weight being read by the running GEMM and the next weight being prefetched) never share a
buffer, even with the same shape. A buffer is only re-used two chain positions later, after
the side stream has waited on an event recorded behind the GEMM that read it (see
[Note: ETP streams]). Buffers are allocated lazily, never freed until ``clear()``, and so
keep their addresses across iterations (what CUDA-graph replay needs).

[Note: ETP buffer logging]
The cache and the wgrad pool log on the ``etp.cache`` logger only when built with
``debug=True`` (the runtime passes ``ETPConfig.debug_checks``); otherwise they log nothing,
not even a filtered record, since they run once per GEMM. Allocations and ``clear()`` log at
INFO, every ticket / acquire / release at DEBUG. To see them::

    logging.basicConfig()
    logging.getLogger("etp.cache").setLevel(logging.DEBUG)
"""
from __future__ import annotations

import enum
import logging
from typing import NamedTuple

import torch

__all__ = ["BufferKey", "Role", "WeightCache"]

log = logging.getLogger("etp.cache")


class Role(enum.Enum):
    """Who consumes a gathered weight: the forward, the backward, or a forward that
    activation recompute re-runs inside backward (its own chain and buffers)."""

    FWD = "fwd"
    BWD = "bwd"
    RECOMPUTE = "recompute"


class BufferKey(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype
    role: Role
    expert_index: int
    parity: int
    device: torch.device
    chain: tuple = ()  # the ChainKey: different chains prefetch independently


class WeightCache:
    """Buffers for gathered weights. ``debug`` logs allocations and tickets (off by
    default); see [Note: ETP buffer logging].

    Example::

        cache = WeightCache()
        buffer = cache.ticket(id(param), Role.FWD, key)   # allocated on first use
    """

    def __init__(self, debug: bool = False) -> None:
        self._buffers: dict[BufferKey, torch.Tensor] = {}
        self._tickets: dict[tuple[int, Role], BufferKey] = {}
        self._backing_of: dict[int, int] = {}  # id(aliased buffer) -> id(its backing)
        self.debug = debug

    def ticket(self, param_id: int, role: Role, key: BufferKey, allocate=None, alias=None) -> torch.Tensor:
        """The buffer of (param, role), allocated on first use: by ``allocate(shape, dtype,
        device)`` when given (a transport's backing for aliased buffers, which may be smaller
        than ``key.shape``), else ``torch.empty``. With ``alias``, what ``alias(backing)``
        returns: this param's own view of the backing ([Note: aliased own rows] in
        etp/transport/vmm.py)."""
        self._tickets[(param_id, role)] = key
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = (allocate or torch.empty)(key.shape, dtype=key.dtype, device=key.device)
            self._buffers[key] = buffer
            if self.debug:
                log.info("etp cache: allocated %s (%d bytes; %d buffers)", key,
                         buffer.numel() * buffer.element_size(), len(self._buffers))
        elif self.debug:
            log.debug("etp cache: ticket (param %#x, %s) -> %s", param_id, role.value, key)
        return self._aliased(buffer, alias)

    def existing(self, param_id: int, role: Role, alias=None) -> torch.Tensor | None:
        """The buffer of (param, role) if that ticket was ever issued, else None."""
        key = self._tickets.get((param_id, role))
        buffer = None if key is None else self._buffers.get(key)
        return None if buffer is None else self._aliased(buffer, alias)

    def _aliased(self, backing: torch.Tensor, alias) -> torch.Tensor:
        if alias is None:
            return backing
        buffer = alias(backing)
        if buffer is not backing:
            self._backing_of[id(buffer)] = id(backing)
        return buffer

    def holder_key(self, buffer: torch.Tensor) -> int:
        """Which gather ``buffer`` holds is tracked under this key: its backing's, since every
        weight of an aliased ticket writes its peers' rows into the same backing."""
        return self._backing_of.get(id(buffer), id(buffer))

    @property
    def num_buffers(self) -> int:
        return len(self._buffers)

    @property
    def num_tickets(self) -> int:
        return len(self._tickets)

    def nbytes(self, role: Role | None = None) -> int:
        """Bytes held (of one role, or all); reported to the memory audit."""
        return sum(
            b.numel() * b.element_size()
            for k, b in self._buffers.items()
            if role is None or k.role == role
        )

    def clear(self) -> None:
        if self.debug:
            log.info("etp cache: cleared %d buffers (%d bytes)", len(self._buffers), self.nbytes())
        self._buffers.clear()
        self._tickets.clear()
        self._backing_of.clear()
