"""Prefetch chains: the observed order in which a model consumes its ETP weights.

[Note: ETP chains]
Weights are grouped into chains by ``ChainKey``: the class (``eager`` or ``graphed``, so a
later CUDA-graph integration keeps captured and eager weights on separate chains and
streams), the kind (``dense``, or ``expert:<role>`` for routed experts: each expert role,
e.g. every MoE block's ``fc1_weight``, forms its own chain, so the next block's experts are
gathered one whole block ahead instead of one GEMM ahead) and the shard group.

Each chain keeps one order per role (forward, backward), observed in the first pass that
uses it: forward order in the first forward, backward order in the first backward (for a
weight consumed twice, e.g. tied embeddings, that is not simply the reverse). Afterwards the
order is replayed: consuming position i in forward prefetches position i + 1 of the forward
order, and likewise in backward. A weight's *parity* (position mod 2) enters its buffer key
so chain neighbours never share a buffer (see [Note: ETP buffer keys]).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["ChainKey", "ObservedOrder", "Chain"]


class ChainKey(NamedTuple):
    chain_class: str  # "eager" | "graphed"
    kind: str  # "dense" | "expert:<role>"
    ranks: tuple[int, ...]


class ObservedOrder:
    """The first-consume order of one role, recorded once and then frozen."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self._position: dict[int, int] = {}
        self.frozen = False

    def observe(self, param: torch.Tensor) -> None:
        if not self.frozen and id(param) not in self._position:
            self._position[id(param)] = len(self.params)
            self.params.append(param)

    def freeze(self) -> None:
        self.frozen = True

    def position(self, param: torch.Tensor) -> int | None:
        return self._position.get(id(param))

    def parity(self, param: torch.Tensor) -> int:
        position = self._position.get(id(param))
        return 0 if position is None else position % 2

    def first(self) -> torch.Tensor | None:
        return self.params[0] if self.params else None

    def head(self) -> torch.Tensor | None:
        """The first weight once the order is frozen (what a pass prefetches first), else None."""
        return self.first() if self.frozen else None

    def after(self, param: torch.Tensor) -> torch.Tensor | None:
        """The next weight in this order (None at the end, or if unknown / not frozen)."""
        position = self._position.get(id(param))
        if not self.frozen or position is None or position + 1 >= len(self.params):
            return None
        return self.params[position + 1]

    def is_last(self, param: torch.Tensor) -> bool:
        return self.frozen and bool(self.params) and self.params[-1] is param


class Chain:
    """One chain: its key and the observed forward and backward orders."""

    def __init__(self, key: ChainKey, roles) -> None:
        self.key = key
        self.orders = {role: ObservedOrder() for role in roles}

    def reset(self) -> None:
        for role in list(self.orders):
            self.orders[role] = ObservedOrder()
