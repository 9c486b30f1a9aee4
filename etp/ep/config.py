"""``EPConfig``: the static shape of one MoE layer's token exchange.

Everything a dispatcher allocates is derived from this config at construction, so a step
never allocates. See [Note: receive capacity].
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["EPConfig"]

# [Note: receive capacity]
# A rank receives one row per (token, local expert) pair routed to it. That count varies
# per step, the buffer that holds it does not: it is ``capacity`` rows, fixed at
# construction. The default can never overflow: every one of the W ranks sends at most
# ``max_tokens_per_rank`` tokens, each to at most ``min(topk, experts_per_rank)`` experts of
# this rank (a token's K experts are distinct). ``capacity_factor`` shrinks it to
# ``ceil(capacity_factor * max_tokens_per_rank * topk)`` (1.0 = the average load of a
# rank). Rows that do not fit are either an error reported at ``check()``
# (``drop_tokens=False``) or dropped megatron-style (``drop_tokens=True``: each local expert
# keeps at most ``capacity // experts_per_rank`` rows, earlier source ranks and earlier
# tokens first, the rest contribute nothing to ``combine``).

_BACKEND_PREFIXES = ("auto", "reference", "nccl", "symm_", "hierarchical")


def _is_power_of_two(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1 and not value & (value - 1)


@dataclass(frozen=True)
class EPConfig:
    """Static description of an expert-parallel token exchange.

    Args:
        num_experts: experts in the layer (all ranks); divisible by the group size.
        topk: experts per token (K).
        hidden_size: row width H of the tokens moved.
        max_tokens_per_rank: largest T a rank passes to ``prepare``; sizes every buffer.
        dtype: dtype of the token rows (``x`` and ``expert_out``).
        backend: ``"auto"`` (profile once, cached), ``"reference"``, ``"nccl"``,
            ``"nccl_padded"``, a ``"symm_<algo>"`` name, ``"hierarchical"``, or
            ``"<dispatch>+<combine>"`` to mix two.
        capacity_factor: receive buffer as a multiple of the average load; ``None`` sizes
            it so that it cannot overflow. See [Note: receive capacity].
        drop_tokens: drop the rows beyond each local expert's capacity instead of
            reporting an overflow.
        weight_dtype: dtype of the routing weights moved beside the rows.
        validate: check ``topk_idx`` on the host in ``prepare`` (a host sync). ``None``:
            on for CPU tensors, off on GPU, where bad indices are counted on device,
            left out of the exchange, and raised by ``check()``.
        num_ctas: thread blocks the Triton copy kernels use (the symm backends); the default
            is an H100 / H200's SM count. Fewer leave SMs to compute that runs beside the move,
            and move slower: the copies are bound by how many blocks issue loads and stores.
        tile_rows: rows each of those blocks copies per loop iteration (a power of two;
            the reductions, which read K rows per row they write, take ``tile_rows // K``).
            ``None``: about 32 KB of bf16 rows per iteration. See [Note: row tiles] in
            ``etp.kernels.ep_move``.
        num_warps: warps per thread block of the copy kernels.
        num_stages: loop iterations of a copy kernel in flight at once (software
            pipelining through shared memory; lowered per kernel to what fits).
        cache_dir: where ``backend="auto"`` caches its choice (default
            ``$ETP_CACHE_DIR`` or ``~/.cache/etp``).
        ranks_per_host: ranks of the group per host, in contiguous blocks (None: detected
            from the host names). Which ranks share NVLink: the ``symm_*`` backends need one
            host, ``hierarchical`` more than one. Declaring fewer than a machine has runs the
            cross-host code on one machine (the tests' 4 ranks as 2 hosts x 2). See [Note:
            host groups] in ``etp.ep.backends.hosts``.
        capturable: the moves will be captured in a CUDA graph, so no backend may read split
            sizes on the host: ``backend="auto"`` chooses among the capturable backends only
            (from the same profile and cache), and a named backend that reads them
            (``nccl``, ``hierarchical``, ``reference``) is refused.

    Example::

        cfg = EPConfig(num_experts=128, topk=8, hidden_size=4096, max_tokens_per_rank=32768,
                       dtype=torch.bfloat16, backend="auto")
    """

    num_experts: int
    topk: int
    hidden_size: int
    max_tokens_per_rank: int
    dtype: torch.dtype = torch.bfloat16
    backend: str = "auto"
    capacity_factor: Optional[float] = None
    drop_tokens: bool = False
    weight_dtype: torch.dtype = torch.float32
    validate: Optional[bool] = None
    num_ctas: int = 132
    tile_rows: Optional[int] = None
    num_warps: int = 8
    num_stages: int = 3
    cache_dir: Optional[str] = None
    ranks_per_host: Optional[int] = None
    capturable: bool = False

    def __post_init__(self):
        for name in ("num_experts", "topk", "hidden_size", "max_tokens_per_rank", "num_ctas", "num_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EPConfig.{name}={value!r}: expected a positive int")
        if self.tile_rows is not None and not _is_power_of_two(self.tile_rows):
            raise ValueError(f"EPConfig.tile_rows={self.tile_rows!r}: expected a power of two (a Triton tile's "
                             "row count), or None to pick it per kernel")
        if not _is_power_of_two(self.num_warps) or self.num_warps > 32:
            raise ValueError(f"EPConfig.num_warps={self.num_warps!r}: expected a power of two (1 to 32)")
        if self.topk > self.num_experts:
            raise ValueError(f"EPConfig.topk={self.topk} is larger than num_experts={self.num_experts}")
        for name in ("dtype", "weight_dtype"):
            value = getattr(self, name)
            if not isinstance(value, torch.dtype) or not value.is_floating_point:
                raise TypeError(f"EPConfig.{name}={value!r}: expected a floating torch.dtype")
        if not isinstance(self.backend, str) or not all(
            part.startswith(_BACKEND_PREFIXES) for part in self.backend.split("+")
        ):
            raise ValueError(
                f"EPConfig.backend={self.backend!r}: expected auto, reference, nccl, nccl_padded, symm_<algo>, "
                "hierarchical or '<dispatch>+<combine>'"
            )
        if self.ranks_per_host is not None and (not isinstance(self.ranks_per_host, int)
                                                or isinstance(self.ranks_per_host, bool) or self.ranks_per_host < 1):
            raise ValueError(f"EPConfig.ranks_per_host={self.ranks_per_host!r}: expected a positive int or None "
                             "(detected)")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"EPConfig.capacity_factor={self.capacity_factor!r}: expected > 0 or None")
        if self.drop_tokens and self.capacity_factor is None:
            raise ValueError("EPConfig.drop_tokens=True needs a capacity_factor (the default capacity never drops)")

    def experts_per_rank(self, world_size: int) -> int:
        """Experts each rank holds; raises ValueError unless ``num_experts % world_size == 0``."""
        if self.num_experts % world_size:
            raise ValueError(
                f"num_experts={self.num_experts} is not divisible by the expert-parallel group "
                f"size {world_size}: every rank must hold the same number of experts"
            )
        return self.num_experts // world_size

    def capacity(self, world_size: int) -> int:
        """Rows of the receive buffer. See [Note: receive capacity]."""
        local = self.experts_per_rank(world_size)
        exact = world_size * self.max_tokens_per_rank * min(self.topk, local)
        if self.capacity_factor is None:
            return exact
        return max(local, min(exact, math.ceil(self.capacity_factor * self.max_tokens_per_rank * self.topk)))

    def expert_capacity(self, world_size: int) -> Optional[int]:
        """Rows one local expert keeps with ``drop_tokens``; ``None`` without dropping."""
        if not self.drop_tokens:
            return None
        return self.capacity(world_size) // self.experts_per_rank(world_size)
