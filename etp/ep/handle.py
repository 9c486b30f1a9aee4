"""``EPHandle``: the routing of one ``prepare``, and its small state machine."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

import torch

from etp.ep.routing_layout import Layout

__all__ = ["EPHandle", "HandleState"]


class HandleState(enum.Enum):
    """Where a handle is in its step."""

    #: ``prepare`` ran: the layout is on device, nothing moved yet.
    PREPARED = "prepared"
    #: ``dispatch`` filled the receive buffer; ``combine`` may run.
    DISPATCHED = "dispatched"
    #: ``combine`` ran; backward may still use the handle until the next ``prepare``.
    COMBINED = "combined"


@dataclass
class EPHandle:
    """Routing of one step on one rank. Valid until the dispatcher's next ``prepare``.

    Attributes:
        topk_idx: the [T, K] expert indices given to ``prepare``.
        layout: device tensors, see :class:`etp.ep.routing_layout.Layout`.
        generation: which ``prepare`` of its dispatcher made it.
        rows: set by ``dispatch(..., trim=True)``: the valid receive rows (host int), the
            length of ``recv_x`` / ``recv_w`` and of the ``expert_out`` ``combine`` takes.
        trim: ``dispatch`` was asked to trim (``rows`` is read once its move is queued).
    """

    topk_idx: torch.Tensor
    layout: Layout
    generation: int
    state: HandleState = HandleState.PREPARED
    backend_state: dict = field(default_factory=dict)
    rows: Optional[int] = None
    trim: bool = False

    @property
    def tokens(self) -> int:
        return self.topk_idx.shape[0]

    @property
    def topk(self) -> int:
        return self.topk_idx.shape[1]

    def _to(self, *allowed: HandleState, new: HandleState, op: str) -> None:
        if self.state not in allowed:
            raise RuntimeError(f"{op} on a handle in state {self.state.value}; expected "
                               f"{' or '.join(s.value for s in allowed)}")
        self.state = new
