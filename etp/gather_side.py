"""The gather side of ``ETPRuntime``: where each ETP weight's gathers come from, go to and when
they are issued. It owns the weight cache's ticket buffers, every gather's state machine and
in-flight handle, the prefetch plan of each chain (what was consumed this pass, what comes
next), the record of which buffer holds which weight's gather, and the quantized shards
(and their homes) of a quantized gather format (``etp.formats``: the format object decides what
travels and what the GEMMs get).

[Note: gather reuse]
``ETPConfig.gather_reuse`` trades memory for gathers. "chain" keys forward buffers by chain
parity (two per shape), so backward gathers every weight again. "pass" and "step" give each
weight its own forward buffer (the registration ``slot`` in the key), so a forward gather stays
resident: backward and recompute consumes find it (``_resident``) and gather nothing, and
their prefetches skip it. "pass" forgets residency at every pass start (each micro-batch
gathers once); "step" keeps it across passes until ``drain()`` or ``prefetch_after_step()``
(the optimizer step may change the shards between them), so a step of M micro-batches
gathers each weight once instead of 2M times. A resident buffer also records the weight's
``_version`` at its gather, so an in-place update of the shard outside that protocol (a
plain optimizer step without ``drain()``) is never served stale.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from .cache import BufferKey, Role, WeightCache
from .config import ETPConfig
from .formats import QuantizedShard
from .prefetch_chains import Chain
from .state_machines import ETPStateError, GatherState, transition
from .streams import CommStreams, StreamRegistry, current_stream_event
from .transport import Handle, Transports

__all__ = ["GatherSide", "GatherStats", "Registered"]

log = logging.getLogger("etp.runtime")


@dataclass(eq=False)
class Registered:
    """What the runtime knows of one ETP weight for good: its chain and registration slot.
    The sides keep their changing state of it themselves."""

    param: torch.Tensor
    name: str
    chain: Chain
    slot: int  # registration index: the forward buffer key under gather_reuse "pass" / "step"


@dataclass(eq=False)
class _InFlight:
    buffer: torch.Tensor
    handle: Handle  # the transport's completion handle
    source: torch.Tensor  # keeps a cast shard alive until the gather completes


@dataclass(eq=False)
class _WeightGathers:
    """The gather side's state of one weight."""

    record: Registered
    roles: dict = field(default_factory=lambda: {r: GatherState.IDLE for r in Role})
    in_flight: dict = field(default_factory=dict)
    quant: QuantizedShard | None = None  # quantized shard of this step (quantized formats only)
    quant_home: torch.Tensor | None = None  # where the quantized shard must live (copy engine)
    staged_pass: int = -1  # the pass whose shard was last cast / staged into the home


@dataclass
class GatherStats:
    """Counters a test or the memory audit reads."""

    gathers_on_demand: int = 0
    gathers_prefetched: int = 0
    gathers_reused: int = 0  # backward served from a forward buffer of the same pass
    order_misses: int = 0


class GatherSide:
    """Gathers, prefetches and residency of every ETP weight of one runtime.

    Args:
        config: the runtime's settings.
        transports_of: ``param -> Transports`` (the runtime chooses them once per group).
        streams: the runtime's stream registry (the AG side streams).
    """

    def __init__(self, config: ETPConfig, transports_of: Callable[[torch.Tensor], Transports],
                 streams: StreamRegistry) -> None:
        self.config = config
        self.format = config.gather_format
        self.cache = WeightCache(debug=config.debug_checks)
        self.stats = GatherStats()
        self._transports = transports_of
        self._streams = streams
        self._weights: dict[int, _WeightGathers] = {}
        self._consumed: dict[Role, set[int]] = {role: set() for role in Role}
        self._expected: dict[tuple, torch.Tensor | None] = {}
        # cache.holder_key(ticket buffer) -> (id(param), param._version) whose gather it holds:
        # valid within one pass (one step with gather_reuse "step"; the optimizer may update
        # shards without bumping any version). See [Note: gather reuse].
        self._holder: dict[int, tuple[int, int]] = {}
        self._pass_index = 0
        self._staging_logged = False

    # ------------------------------------------------------------------ registration
    def add(self, record: Registered) -> None:
        self._weights[id(record.param)] = _WeightGathers(record)

    def state(self, param: torch.Tensor) -> _WeightGathers:
        return self._weights[id(param)]

    @property
    def quantized(self) -> bool:
        """Whether the gather format keeps a quantized shard per step (``etp.quantize_shards``)."""
        return self.format.quantized

    def wire_dtype(self, param: torch.Tensor) -> torch.dtype:
        """The dtype ``param``'s shard travels in."""
        return self.format.wire_dtype(param.dtype)

    # ------------------------------------------------------------------ passes
    def start_pass(self, chains) -> None:
        """A new pass: nothing consumed yet; each chain expects its head first."""
        self._consumed = {role: set() for role in Role}
        if self.config.gather_reuse != "step":
            self._holder.clear()
        self._pass_index += 1
        self._expected = {(key, role): chain.orders[role].head() for key, chain in chains.items() for role in Role}

    def end_step(self) -> None:
        """The optimizer step may change the shards: nothing stays resident."""
        self._holder.clear()

    def discard_in_flight(self) -> None:
        for st in self._weights.values():
            for role in Role:
                if st.roles[role] is GatherState.IN_FLIGHT:
                    self._take(st, role)

    def forget_buffers(self, transports) -> None:
        """Drops every ticket buffer (and ``transports``' aliases of them) and what they held."""
        self.cache.clear()
        for chosen in transports:
            chosen.gather.release_buffers()
        self._expected.clear()
        self._holder.clear()

    # ------------------------------------------------------------------ sources and buffers
    def _source(self, st: _WeightGathers) -> torch.Tensor:
        param = st.record.param
        if self.quantized:
            if st.quant is None or st.quant.version != param._version:
                raise ETPStateError(
                    f"the quantized shard of '{st.record.name}' is older than the parameter: "
                    "call etp.quantize_shards(model) after changing weights mid-step"
                )
            return st.quant.data
        shard = param.detach()
        wire = self.wire_dtype(param)
        home = self._transports(param).gather.home(param)
        if home is not None and home.data_ptr() != shard.data_ptr():
            # The gather reads only the symmetric home: cast (or stage) the shard into it,
            # once per pass (shards do not change within a pass).
            if st.staged_pass != self._pass_index:
                if home.dtype == shard.dtype and not self._staging_logged:
                    self._staging_logged = True
                    log.warning("etp transport: a shard left its symmetric-memory home (its storage "
                                "was moved, e.g. into a DDP buffer); staging it there once per pass")
                home.copy_(shard)
                st.staged_pass = self._pass_index
            return home
        return shard if shard.dtype == wire else shard.to(wire)

    def _buffer(self, st: _WeightGathers, role: Role) -> torch.Tensor:
        record = st.record
        param, order = record.param, record.chain.orders[role]
        keep = role is Role.FWD and self.config.gather_reuse != "chain"
        key = BufferKey(
            shape=param.etp_layout.padded_shape,
            dtype=self.wire_dtype(param),
            role=role,
            expert_index=int(getattr(param, "etp_expert_index", -1)),
            # A buffer of its own (negative: never a chain parity) keeps the gather resident.
            parity=-1 - record.slot if keep else order.parity(param),
            device=param.device,
            chain=record.chain.key,
        )
        gather = self._transports(param).gather
        return self.cache.ticket(id(param), role, key, allocate=functools.partial(gather.allocate_backing, param),
                                 alias=functools.partial(gather.alias, param))

    def _resident(self, st: _WeightGathers) -> torch.Tensor | None:
        """A ticket buffer that already holds this pass's complete gather of ``st``'s weight
        (the last forward weights of a chain are the first backward ones: no second gather)."""
        param = st.record.param
        alias = functools.partial(self._transports(param).gather.alias, param)
        for role in Role:
            buffer = self.cache.existing(id(param), role, alias)
            if (
                buffer is not None
                and self._holder.get(self.cache.holder_key(buffer)) == (id(param), param._version)
                and st.roles[role] is GatherState.IDLE
            ):
                return buffer
        return None

    # ------------------------------------------------------------------ gathers
    def _issue(self, st: _WeightGathers, role: Role) -> None:
        """Starts the async gather of ``st``'s weight into its ticket buffer."""
        record = st.record
        st.roles[role] = transition(record.name, f"{role.value} gather", st.roles[role], GatherState.IN_FLIGHT)
        param = record.param
        source = self._source(st)  # cast on the current stream, after the optimizer's writes
        streams: CommStreams = self._streams.get(record.chain.key.chain_class, record.chain.key.ranks, param.device)
        # The ticket buffer first: its first allocation may enqueue a write on the current
        # stream (torch's deterministic mode fills new memory with NaN), which the gather must
        # follow, not race (it did: NaN gradients under recompute, see [Note: ETP streams]).
        buffer = self._buffer(st, role)
        # See [Note: ETP streams]: the AG stream must not read the shard (or overwrite a buffer
        # a queued GEMM reads) before the current stream has got there.
        CommStreams.wait(streams.ag, current_stream_event(param.device))
        with streams.use(streams.ag):
            handle = self._transports(param).gather.gather(source, param.etp_group, buffer, async_op=True)
        self._holder[self.cache.holder_key(buffer)] = (id(param), param._version)
        st.in_flight[role] = _InFlight(buffer, handle, source)
        self.stats.gathers_prefetched += 1

    def _take(self, st: _WeightGathers, role: Role) -> torch.Tensor:
        """Waits for the in-flight gather of ``st`` and returns its buffer."""
        st.roles[role] = transition(st.record.name, f"{role.value} gather", st.roles[role], GatherState.IDLE)
        flight = st.in_flight.pop(role)
        flight.handle.wait()  # the current stream waits for the gather
        return flight.buffer

    def _gather_now(self, st: _WeightGathers, role: Role, into_ticket: bool) -> torch.Tensor:
        param = st.record.param
        if into_ticket:
            out = self._buffer(st, role)
        else:
            out = torch.empty(param.etp_layout.padded_shape, dtype=self.wire_dtype(param), device=param.device)
        buffer = self._transports(param).gather.gather(self._source(st), param.etp_group, out,
                                                       async_op=False).wait()
        if into_ticket:
            self._holder[self.cache.holder_key(buffer)] = (id(param), param._version)
        self.stats.gathers_on_demand += 1
        return buffer

    def acquire(self, param: torch.Tensor, role: Role, compute_dtype: torch.dtype):
        """The full logical weight of ``param`` for a GEMM of ``role`` (the runtime has already
        started the pass or entered backward); prefetches the next weight of its chain."""
        st = self._weights[id(param)]
        chain = st.record.chain
        order = chain.orders[role]
        first_use = id(param) not in self._consumed[role]
        self._consumed[role].add(id(param))
        if first_use:
            order.observe(param)
        expected = self._expected.get((chain.key, role))
        if first_use and order.frozen and expected is not None and expected is not param:
            self.stats.order_misses += 1
            if self.config.debug_checks:
                raise ETPStateError(
                    f"ETP {role.value} consume of '{st.record.name}' while the chain expected "
                    f"'{self._weights[id(expected)].record.name}': the execution order differs from "
                    "the recorded chain (call runtime.reset() after changing the model)"
                )
        buffer = self._consumed_buffer(st, role, first_use and order.frozen and expected is param)
        successor = order.after(param) if first_use else None
        if first_use:
            self._expected[(chain.key, role)] = successor
        if self.config.prefetch:
            self._prefetch(successor, role)
            if role is Role.FWD and first_use and order.is_last(param):
                # The chain's last forward weight: backward's recompute of this chain starts
                # next; its head is gathered now, behind the rest of forward and backward.
                self._prefetch(chain.orders[Role.RECOMPUTE].head(), Role.RECOMPUTE)
        return self.format.operand(param.etp_layout.unpad(buffer), buffer, st.quant, param.etp_layout.rows,
                                   compute_dtype)

    def _consumed_buffer(self, st: _WeightGathers, role: Role, was_expected: bool) -> torch.Tensor:
        """The buffer holding ``st``'s weight for this consume: its prefetch, a resident gather
        of this pass, or a gather made now."""
        if st.roles[role] is GatherState.IN_FLIGHT:
            return self._take(st, role)
        if self.config.prefetch and (resident := self._resident(st)) is not None:
            self.stats.gathers_reused += 1
            return resident
        order = st.record.chain.orders[role]
        if self.config.debug_checks and self.config.prefetch and was_expected and order.first() is not st.record.param:
            raise ETPStateError(
                f"ETP {role.value} consume of '{st.record.name}' found no gather in flight although "
                "the chain prefetched it"
            )
        # A ticket buffer may be the target of another in-flight gather of this chain only
        # when prefetching is on; on-demand gathers then use a fresh buffer.
        chain = st.record.chain
        anything_in_flight = any(s.roles[role] is GatherState.IN_FLIGHT
                                 for s in self._weights.values() if s.record.chain is chain)
        return self._gather_now(st, role, into_ticket=not anything_in_flight)

    def _prefetch(self, successor: torch.Tensor | None, role: Role) -> None:
        """Issues the gather of ``successor`` for ``role`` unless this pass already
        consumed or gathered it."""
        if successor is None or id(successor) in self._consumed[role]:
            return
        nxt = self._weights[id(successor)]
        if self._resident(nxt) is not None:
            pass  # already gathered in this pass: its consume re-uses that buffer
        elif nxt.roles[role] is GatherState.IDLE:
            self._issue(nxt, role)
        elif self.config.debug_checks:
            raise ETPStateError(f"ETP {role.value} gather of '{nxt.record.name}' issued twice")

    def prefetch_heads(self, chains) -> int:
        """Issues the gather of every eager forward chain's head; returns how many."""
        issued = 0
        for chain in chains.values():
            if chain.key.chain_class != "eager":
                continue  # a graphed chain's gathers run inside its graph; see etp/graphs.py
            head = chain.orders[Role.FWD].head()
            if head is not None and self._weights[id(head)].roles[Role.FWD] is GatherState.IDLE:
                self._issue(self._weights[id(head)], Role.FWD)
                issued += 1
        return issued
