"""WgradPool: bounded full-size scratch buffers for weight-gradient GEMM outputs.

A wgrad buffer lives from its GEMM until its reduce-scatter is finalized (one weight later,
see [Note: ETP autograd contract]), so two per (shape, dtype) are in use at a time. The pool
tags the buffers it allocated and takes back only those: a foreign tensor handed to
``release`` is ignored, never kept (an earlier implementation grew without bound that way).
At most ``max_free_per_key`` idle buffers are kept per key; extras are dropped. ``debug``
turns logging on, see [Note: ETP buffer logging] in weight_cache.py.
"""
from __future__ import annotations

import logging

import torch

__all__ = ["WgradPool"]

log = logging.getLogger("etp.cache")


class WgradPool:
    """Pooled wgrad scratch buffers; ``debug`` logs acquire / release / allocations.

    Example::

        pool = WgradPool()
        buffer = pool.acquire((32, 8), torch.float32, "cpu")
        pool.release(buffer)   # kept for the next acquire of that key
    """

    def __init__(self, max_free_per_key: int = 2, debug: bool = False) -> None:
        if max_free_per_key < 1:
            raise ValueError(f"max_free_per_key={max_free_per_key}: must be >= 1")
        self.max_free_per_key = max_free_per_key
        self.debug = debug
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self.in_use = 0
        self.allocations = 0

    @staticmethod
    def _key(shape, dtype, device) -> tuple:
        return (tuple(shape), dtype, torch.device(device))

    def acquire(self, shape, dtype: torch.dtype, device) -> torch.Tensor:
        key = self._key(shape, dtype, device)
        free = self._free.get(key)
        self.in_use += 1
        if free:
            if self.debug:
                log.debug("etp wgrad pool: acquire %s re-uses a free buffer (%d in use)", key, self.in_use)
            return free.pop()
        buffer = torch.empty(key[0], dtype=dtype, device=key[2])
        buffer._etp_pool_tag = (id(self), key)  # the tag marks our own buffers
        self.allocations += 1
        if self.debug:
            log.info("etp wgrad pool: allocated %s (%d bytes; allocation %d, %d in use)", key,
                     buffer.numel() * buffer.element_size(), self.allocations, self.in_use)
        return buffer

    def owns(self, buffer: torch.Tensor) -> bool:
        """Whether ``buffer`` was made by this pool."""
        tag = getattr(buffer, "_etp_pool_tag", None)
        return tag is not None and tag[0] == id(self)

    def release(self, buffer: torch.Tensor) -> None:
        tag = getattr(buffer, "_etp_pool_tag", None)
        if tag is None or tag[0] != id(self):
            if self.debug:
                log.debug("etp wgrad pool: release of %s: not a pool buffer, ignored", tuple(buffer.shape))
            return  # not ours: never keep foreign buffers
        self.in_use -= 1
        free = self._free.setdefault(tag[1], [])
        kept = len(free) < self.max_free_per_key and all(b is not buffer for b in free)
        if kept:
            free.append(buffer)
        if self.debug:
            log.debug("etp wgrad pool: release %s %s (%d in use)", tag[1],
                      "kept" if kept else "dropped", self.in_use)

    @property
    def num_free(self) -> int:
        """Idle buffers kept for re-use."""
        return sum(len(free) for free in self._free.values())

    def nbytes(self) -> int:
        """Bytes of the idle buffers the pool keeps; reported to the memory audit."""
        return sum(b.numel() * b.element_size() for free in self._free.values() for b in free)

    def clear(self) -> None:
        if self.debug:
            log.info("etp wgrad pool: cleared %d free buffers (%d bytes)", self.num_free, self.nbytes())
        self._free.clear()
        self.in_use = 0
