"""The gather side of ``ETPRuntime``'s ticket buffers: which buffer a gather of a weight
writes into (the weight cache's ticket, or the transport's aliased view of it), whether a
buffer still holds this pass's gather of a weight, and dropping them all.

A mixin: it uses the runtime's ``cache``, ``config``, ``state``, ``_holder``, ``transports``
and ``_transports``; see [Note: ETP buffer keys] in etp/cache/weight_cache.py and [Note:
aliased own rows] in etp/transport/vmm.py.
"""
from __future__ import annotations

import functools

import torch

from .cache import BufferKey, Role
from .state import GatherState

__all__ = ["GatherBuffers"]


class GatherBuffers:
    """Ticket buffers for gathers (mixed into ``ETPRuntime``)."""

    def _buffer(self, st, role: Role) -> torch.Tensor:  # st: the runtime's per-param state
        param = st.param
        order = st.chain.orders[role]
        keep = role is Role.FWD and self.config.gather_reuse != "chain"
        key = BufferKey(
            shape=param.etp_layout.padded_shape,
            dtype=self._wire_dtype(param),
            role=role,
            expert_index=int(getattr(param, "etp_expert_index", -1)),
            # A buffer of its own (negative: never a chain parity) keeps the gather resident.
            parity=-1 - st.slot if keep else order.parity(param),
            device=param.device,
            chain=st.chain.key,
        )
        gather = self._transports(param).gather
        return self.cache.ticket(id(param), role, key, allocate=functools.partial(gather.allocate_backing, param),
                                 alias=functools.partial(gather.alias, param))

    def _clear_gather_buffers(self) -> None:
        """Drops every ticket buffer (and the transports' aliases of them)."""
        self.cache.clear()
        for chosen in self.transports.values():
            chosen.gather.release_buffers()

    def _resident(self, st) -> torch.Tensor | None:
        """A ticket buffer that already holds this pass's complete gather of ``st``'s weight
        (the last forward weights of a chain are the first backward ones: no second gather)."""
        alias = functools.partial(self._transports(st.param).gather.alias, st.param)
        for role in Role:
            buffer = self.cache.existing(id(st.param), role, alias)
            if (
                buffer is not None
                and self._holder.get(self.cache.holder_key(buffer)) == (id(st.param), st.param._version)
                and st.gather[role] is GatherState.IDLE
            ):
                return buffer
        return None
