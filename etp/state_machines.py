"""Per-parameter state machines of the gather and the reduce-scatter, with checked
transitions. Checks raise ``ETPStateError`` naming the parameter."""
from __future__ import annotations

import enum

__all__ = ["ETPStateError", "GatherState", "ReduceState", "transition"]


class ETPStateError(RuntimeError):
    """An ETP gather / reduce-scatter was used out of order (see the message's param)."""


class GatherState(enum.Enum):
    """State of one (param, role) gather ticket."""

    #: No gather in flight; the ticket's buffer holds nothing anyone waits for.
    IDLE = "idle"
    #: An async all-gather into the ticket's buffer was issued and not yet consumed.
    IN_FLIGHT = "in_flight"


class ReduceState(enum.Enum):
    """State of one param's weight-gradient reduce-scatter."""

    #: Nothing pending; ``main_grad`` / ``grad`` holds every finished contribution.
    IDLE = "idle"
    #: A reduce-scatter was issued; its pooled wgrad buffer and output are held until it is
    #: finalized (waited, added into the gradient, grad-ready hook fired).
    PENDING = "pending"


_ALLOWED = {
    (GatherState.IDLE, GatherState.IN_FLIGHT),
    (GatherState.IN_FLIGHT, GatherState.IDLE),
    (ReduceState.IDLE, ReduceState.PENDING),
    (ReduceState.PENDING, ReduceState.IDLE),
}


def transition(name: str, what: str, current: enum.Enum, new: enum.Enum) -> enum.Enum:
    """Returns ``new`` if ``current -> new`` is allowed, else raises naming the param."""
    if (current, new) not in _ALLOWED:
        raise ETPStateError(
            f"ETP {what} of parameter '{name}': illegal transition {current.value} -> {new.value}"
        )
    return new
