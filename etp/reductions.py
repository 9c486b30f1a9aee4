"""The weight-gradient side of ``ETPRuntime``: pooled wgrad buffers, reduce-scatters on the
RS side stream, their finalization into ``main_grad`` / ``grad`` and the grad-ready hooks
(fired at once, muted in a CUDA-graph warm-up, or deferred past a capture).

A mixin: it uses the runtime's ``state``, ``streams``, ``pool``, ``_pending`` and transports;
see [Note: ETP passes] in etp/runtime.py for when reductions complete.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .cache import Role, WgradPool
from .state import ETPStateError, ReduceState, transition
from .streams import CommStreams, current_stream_event
from .transport import Handle

__all__ = ["GradientReductions", "PendingReduce"]


@dataclass(eq=False)
class PendingReduce:
    """An issued reduce-scatter: its padded wgrad buffer and the transport's handle."""

    padded: torch.Tensor
    handle: Handle


class GradientReductions:
    """Reduce-scatter and finalize weight gradients (mixed into ``ETPRuntime``)."""

    def _grad_dtype(self, param: torch.Tensor) -> torch.dtype:
        main_grad = getattr(param, "main_grad", None)
        return main_grad.dtype if main_grad is not None else param.dtype

    def _grad_wire_dtype(self, param: torch.Tensor) -> torch.dtype:
        """The dtype the full weight gradient is written and reduced in (the transport's)."""
        return self._transports(param).reduce.wire_dtype(param.dtype, self._grad_dtype(param))

    def _pool(self, param: torch.Tensor) -> WgradPool:
        self._transports(param)
        return self._reduce_pools.get(param.etp_group.ranks, self.pool)

    def wgrad_buffer(self, param: torch.Tensor) -> torch.Tensor:
        """A pooled ``[padded_rows, cols]`` buffer whose padding rows are zero."""
        layout = param.etp_layout
        padded = self._pool(param).acquire(layout.padded_shape, self._grad_wire_dtype(param), param.device)
        padded[layout.rows :].zero_()
        return padded

    def reduce_grad(self, param: torch.Tensor, wgrad: torch.Tensor) -> None:
        """Issues the reduce-scatter of a weight gradient; see the module doc.

        ``wgrad`` is either a buffer from ``wgrad_buffer`` or any tensor of the logical
        shape; the latter is reduced in place when it needs no padding and has the gradient
        dtype, and copied into a pooled padded buffer otherwise."""
        layout, wire = param.etp_layout, self._grad_wire_dtype(param)
        own_buffers = param.etp_group.ranks in self._reduce_pools  # the transport reads only those
        if tuple(wgrad.shape) == tuple(layout.padded_shape) and wgrad.dtype == wire and (
            not own_buffers or self._pool(param).owns(wgrad)
        ):
            padded = wgrad
        elif layout.rows == layout.padded_rows and wgrad.dtype == wire and wgrad.is_contiguous() and not own_buffers:
            padded = wgrad.view(layout.padded_shape)
        else:
            padded = self.wgrad_buffer(param)
            layout.unpad(padded).copy_(wgrad)
        st = self.state(param)
        if st.reduce is ReduceState.PENDING:
            # A weight consumed twice: its first reduction must land before the second.
            self._finalize(st)
        streams = self.streams.get(st.chain.key.chain_class, st.chain.key.ranks, param.device)
        target = getattr(param, "main_grad", None)  # None: the handle returns the reduced shard
        CommStreams.wait(streams.rs, current_stream_event(param.device))
        with streams.use(streams.rs):
            handle = self._transports(param).reduce.reduce_scatter(
                padded, param.etp_group, target, self.config.reduction == "mean", async_op=True)
        st.reduce = transition(st.name, "reduce-scatter", st.reduce, ReduceState.PENDING)
        st.pending = PendingReduce(padded, handle)
        self._pending.append(st)
        self.stats.reduce_scatters += 1
        self.sm_carveout.hold()  # the GEMMs from here on may run beside it
        if not self.config.async_reduce or st.chain.orders[Role.BWD].is_last(param):
            self.drain_reductions()
        else:
            while len(self._pending) > 1:
                self._finalize(self._pending.popleft())

    def _finalize(self, st) -> None:  # st: the runtime's per-param state
        if st.reduce is not ReduceState.PENDING:
            raise ETPStateError(f"ETP reduce-scatter of parameter '{st.name}' finalized with none pending")
        if st in self._pending:
            self._pending.remove(st)
        pending, param = st.pending, st.param
        # Waits on the current stream; the NCCL transport then divides (mean) and adds into
        # main_grad, the symmetric one already added in its kernel.
        shard_grad = pending.handle.wait()
        if getattr(param, "main_grad", None) is None:
            if param.grad is None:
                param.grad = shard_grad if shard_grad.dtype == param.dtype else shard_grad.to(param.dtype)
            else:
                param.grad.add_(shard_grad)
        self._pool(param).release(pending.padded)  # a no-op for buffers the pool does not own
        st.pending = None
        st.reduce = transition(st.name, "reduce-scatter", st.reduce, ReduceState.IDLE)
        st.grads_done += 1
        if st.grads_done >= st.fwd_uses and not self._hooks_muted:
            if self._hook_sink is not None:
                self._hook_sink.append(param)
            else:
                self.fire_grad_ready([param])

    def fire_grad_ready(self, params) -> None:
        """Calls the grad-ready hooks of ``params`` in order (after a CUDA-graph replay)."""
        for param in params:
            for hook in self.state(param).hooks:
                hook(param)

    @contextlib.contextmanager
    def hooks_muted(self):
        """Grad-ready hooks do not fire inside (gradients computed here are thrown away)."""
        before, self._hooks_muted = self._hooks_muted, True
        try:
            yield
        finally:
            self._hooks_muted = before

    @contextlib.contextmanager
    def hooks_deferred(self):
        """Yields the list of params whose grad-ready hooks came due inside, in order, and
        fires none of them (a capture: the hooks must fire after each replay instead)."""
        before, self._hook_sink = self._hook_sink, []
        try:
            yield self._hook_sink
        finally:
            self._hook_sink = before

    def drain_reductions(self) -> None:
        while self._pending:
            self._finalize(self._pending[0])
        self.sm_carveout.release()  # nothing in flight: the GEMMs may take every SM again
