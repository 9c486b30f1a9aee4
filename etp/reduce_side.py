"""The reduce side of ``ETPRuntime``: pooled wgrad buffers, reduce-scatters on the RS side
stream, their finalization into ``main_grad`` / ``grad``, how many gradients each weight
expects this pass, and the grad-ready hooks (fired at once, muted in a CUDA-graph warm-up, or
deferred past a capture). See [Note: ETP passes] in etp/runtime.py for when reductions
complete.

Gradient counting (when the grad-ready hooks fire): a consume expects a gradient only when
autograd records it (grad mode on and the weight requires grad). A recompute consume
counts only in place of a forward consume that did not (megatron's and torch's reentrant
checkpoint run the first forward under ``no_grad``); the non-reentrant checkpoint records
the first forward and discards the recompute's graph, so its recompute does not count.
"""
from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from .cache import Role, WgradPool
from .config import ETPConfig
from .state_machines import ETPStateError, ReduceState, transition
from .streams import CommStreams, StreamRegistry, current_stream_event
from .transport import Handle, Transports

__all__ = ["PendingReduce", "ReduceSide"]


@dataclass(eq=False)
class PendingReduce:
    """An issued reduce-scatter: its padded wgrad buffer and the transport's handle."""

    padded: torch.Tensor
    handle: Handle


@dataclass(eq=False)
class _WeightReductions:
    """The reduce side's state of one weight."""

    record: object  # the runtime's Registered record (param, name, chain)
    state: ReduceState = ReduceState.IDLE
    pending: PendingReduce | None = None
    fwd_uses: int = 0  # consumes this pass that autograd recorded: gradients to expect
    untracked_uses: int = 0  # forward consumes under no_grad (a recompute may stand in)
    recompute_uses: int = 0  # recompute consumes counted in place of untracked ones
    grads_done: int = 0
    hooks: list = field(default_factory=list)


class ReduceSide:
    """Weight-gradient reduce-scatters of every ETP weight of one runtime.

    Args:
        config: the runtime's settings (``reduction``, ``async_reduce``, ``debug_checks``).
        transports_of: ``param -> Transports``.
        streams: the runtime's stream registry (the RS side streams).
    """

    def __init__(self, config: ETPConfig, transports_of: Callable[[torch.Tensor], Transports],
                 streams: StreamRegistry) -> None:
        self.config = config
        self.pool = WgradPool(debug=config.debug_checks)
        self.reduce_scatters = 0
        self._transports = transports_of
        self._streams = streams
        self._weights: dict[int, _WeightReductions] = {}
        self._pending: deque[_WeightReductions] = deque()
        self._hooks_muted = False
        self._hook_sink: list | None = None

    def add(self, record) -> None:
        self._weights[id(record.param)] = _WeightReductions(record)

    def state(self, param: torch.Tensor) -> _WeightReductions:
        return self._weights[id(param)]

    def add_hook(self, param: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
        self._weights[id(param)].hooks.append(hook)

    # ------------------------------------------------------------------ gradient counting
    def start_pass(self) -> None:
        for st in self._weights.values():
            st.fwd_uses = st.untracked_uses = st.recompute_uses = st.grads_done = 0

    def count_consume(self, param: torch.Tensor, role: Role, records_grad: bool) -> None:
        """One consume of ``param`` by ``role``; see the module doc for what it expects."""
        st = self._weights[id(param)]
        if role is Role.FWD:
            if records_grad:
                st.fwd_uses += 1
            else:
                st.untracked_uses += 1
        elif role is Role.RECOMPUTE and records_grad and st.recompute_uses < st.untracked_uses:
            st.recompute_uses += 1
            st.fwd_uses += 1

    # ------------------------------------------------------------------ buffers
    def grad_wire_dtype(self, param: torch.Tensor) -> torch.dtype:
        """The dtype the full weight gradient is written and reduced in (the transport's)."""
        main_grad = getattr(param, "main_grad", None)
        grad_dtype = main_grad.dtype if main_grad is not None else param.dtype
        return self._transports(param).reduce.wire_dtype(param.dtype, grad_dtype)

    def wgrad_buffer(self, param: torch.Tensor) -> torch.Tensor:
        """A pooled ``[padded_rows, cols]`` buffer whose padding rows are zero."""
        layout = param.etp_layout
        padded = self.pool.acquire(layout.padded_shape, self.grad_wire_dtype(param), param.device)
        padded[layout.rows :].zero_()
        return padded

    # ------------------------------------------------------------------ reductions
    def reduce_grad(self, param: torch.Tensor, wgrad: torch.Tensor) -> None:
        """Issues the reduce-scatter of a weight gradient on the RS stream and finalizes the
        one issued before it (or every one, synchronously or at the end of the backward chain).

        ``wgrad`` is either a buffer from ``wgrad_buffer`` or any tensor of the logical
        shape; the latter is reduced in place when it needs no padding and has the gradient
        dtype, and copied into a pooled padded buffer otherwise."""
        layout, wire = param.etp_layout, self.grad_wire_dtype(param)
        if tuple(wgrad.shape) == tuple(layout.padded_shape) and wgrad.dtype == wire:
            padded = wgrad
        elif layout.rows == layout.padded_rows and wgrad.dtype == wire and wgrad.is_contiguous():
            padded = wgrad.view(layout.padded_shape)
        else:
            padded = self.wgrad_buffer(param)
            layout.unpad(padded).copy_(wgrad)
        st = self._weights[id(param)]
        if st.state is ReduceState.PENDING:
            # A weight consumed twice: its first reduction must land before the second.
            self._finalize(st)
        chain = st.record.chain
        streams = self._streams.get(chain.key.chain_class, chain.key.ranks, param.device)
        target = getattr(param, "main_grad", None)  # None: the handle returns the reduced shard
        CommStreams.wait(streams.rs, current_stream_event(param.device))
        with streams.use(streams.rs):
            handle = self._transports(param).reduce.reduce_scatter(
                padded, param.etp_group, target, self.config.reduction == "mean", async_op=True)
        st.state = transition(st.record.name, "reduce-scatter", st.state, ReduceState.PENDING)
        st.pending = PendingReduce(padded, handle)
        self._pending.append(st)
        self.reduce_scatters += 1
        if not self.config.async_reduce or chain.orders[Role.BWD].is_last(param):
            self.drain()
        else:
            while len(self._pending) > 1:
                self._finalize(self._pending.popleft())

    def _finalize(self, st: _WeightReductions) -> None:
        if st.state is not ReduceState.PENDING:
            raise ETPStateError(f"ETP reduce-scatter of parameter '{st.record.name}' finalized with none pending")
        if st in self._pending:
            self._pending.remove(st)
        pending, param = st.pending, st.record.param
        # Waits on the current stream; the NCCL transport then divides (mean) and adds into
        # main_grad, the copy-engine one sums into it.
        shard_grad = pending.handle.wait()
        if getattr(param, "main_grad", None) is None:
            if param.grad is None:
                param.grad = shard_grad if shard_grad.dtype == param.dtype else shard_grad.to(param.dtype)
            else:
                param.grad.add_(shard_grad)
        self.pool.release(pending.padded)  # a no-op for buffers the pool does not own
        st.pending = None
        st.state = transition(st.record.name, "reduce-scatter", st.state, ReduceState.IDLE)
        st.grads_done += 1
        if st.grads_done >= st.fwd_uses and not self._hooks_muted:
            if self._hook_sink is not None:
                self._hook_sink.append(param)
            else:
                self.fire_grad_ready([param])

    def drain(self) -> None:
        """Finalizes every pending reduce-scatter, in issue order."""
        while self._pending:
            self._finalize(self._pending[0])

    # ------------------------------------------------------------------ grad-ready hooks
    def fire_grad_ready(self, params) -> None:
        """Calls the grad-ready hooks of ``params`` in order (after a CUDA-graph replay)."""
        for param in params:
            for hook in self._weights[id(param)].hooks:
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
