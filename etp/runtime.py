"""ETPRuntime: gathers, prefetches and reduce-scatters the ETP weights of one model.

The autograd Functions (``etp.autograd``) call three methods:

* ``acquire(param, role, dtype)`` returns the full logical weight for a GEMM. A prefetched
  gather is waited for; otherwise the weight is gathered on demand. Then the next weight of
  the chain is prefetched on the AG side stream. See [Note: ETP chains].
* ``wgrad_buffer(param)`` hands out a pooled, padded buffer for the full weight gradient.
* ``reduce_grad(param, buffer)`` issues its reduce-scatter on the RS side stream and
  finalizes the previously issued one (wait, add into ``main_grad`` / ``grad``, fire the
  grad-ready hooks, return the buffer). The last weight of the backward chain is finalized at
  once; ``drain()`` (called by ``etp.finalize_grads``) completes everything before the
  optimizer step.
* ``prefetch_after_step()`` (``etp.prefetch_after_step(model)``) starts the next pass right
  after the optimizer step and issues the gathers of every forward chain's head, so that no
  chain starts with a synchronous gather. See [Note: ETP passes].

Bytes move through the transports of each shard group (``etp.transport``), chosen once by
``setup_transports()`` at wrap time; the runtime never knows which one moved them.

[Note: ETP passes]
A *pass* is one forward (and its backward) of one microbatch. A new pass starts with the
first forward consume after a backward or after ``drain()``. Within a pass, a weight's
second consume in the same role (tied weights) is gathered on demand and not chained; so is
every consume of a second forward that follows a forward without a backward or ``drain()``
in between (call ``drain()`` between inference forwards to keep prefetching). At a pass
start, gathers still in flight are discarded: the optimizer may have changed the shards.
``prefetch_after_step()`` starts the pass early, right after the optimizer step (and the
FP8 quantization): the first forward consume then finds its chain head in flight.

[Note: ETP recompute chain]
Activation recompute (megatron's ``recompute_granularity``, ``torch.utils.checkpoint``)
runs a layer's forward again inside backward. A forward consume made while autograd
executes a backward (``torch._C._current_graph_task_id() != -1``) is a third role,
``Role.RECOMPUTE``: it neither starts a pass nor joins the forward chain. Its consumes are
recorded in their own order (layer L's weights, then layer L-1's, ...) and replayed one
consume ahead like the others, into buffers keyed by that role, so a recompute prefetch
never overwrites a weight the backward chain is reading. The chain head is issued at the
forward consume of the chain's last forward weight, so it arrives long before backward
reaches it. ``ETPConfig.prefetch_recompute=False`` gathers recomputed weights on demand.

[Note: gather reuse]
``ETPConfig.gather_reuse`` trades memory for gathers. "chain" keys forward buffers by chain
parity (two per shape), so backward gathers every weight again. "pass" and "step" give each
weight its own forward buffer (``_ParamState.slot`` in the key), so a forward gather stays
resident: backward and recompute consumes find it (``_resident``) and gather nothing, and
their prefetches skip it. "pass" forgets residency at every pass start (each micro-batch
gathers once); "step" keeps it across passes until ``drain()`` or ``prefetch_after_step()``
(the optimizer step may change the shards between them), so a step of M micro-batches
gathers each weight once instead of 2M times. A resident buffer also records the weight's
``_version`` at its gather, so an in-place update of the shard outside that protocol (a
plain optimizer step without ``drain()``) is never served stale.

Gradient counting (when the grad-ready hooks fire): a consume expects a gradient only when
autograd records it (grad mode on and the weight requires grad). A recompute consume
counts only in place of a forward consume that did not (megatron's and torch's reentrant
checkpoint run the first forward under ``no_grad``); the non-reentrant checkpoint records
the first forward and discards the recompute's graph, so its recompute does not count.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from .cache import Role, WeightCache, WgradPool
from .chain import Chain, ChainKey
from .config import ETPConfig
from .gather_buffers import GatherBuffers
from .quant import FP8Weight, QuantizedShard, quantize_shards
from .reductions import GradientReductions, PendingReduce
from .state import ETPStateError, GatherState, ReduceState, transition
from .streams import CommStreams, GemmSmCarveout, StreamRegistry, current_stream_event
from .transport import Handle, Transports, choose_transports

__all__ = ["ETPRuntime", "register_grad_ready_hook"]

log = logging.getLogger("etp.runtime")


@dataclass(eq=False)
class _InFlight:
    buffer: torch.Tensor
    handle: Handle  # the transport's completion handle
    source: torch.Tensor  # keeps a cast shard alive until the gather completes


@dataclass(eq=False)
class _ParamState:
    param: torch.Tensor
    name: str
    chain: Chain
    slot: int  # registration index: the forward buffer key under gather_reuse "pass" / "step"
    gather: dict = field(default_factory=lambda: {r: GatherState.IDLE for r in Role})
    in_flight: dict = field(default_factory=dict)
    reduce: ReduceState = ReduceState.IDLE
    pending: PendingReduce | None = None
    quant: QuantizedShard | None = None  # FP8 shard of this step (FP8 gathers only)
    quant_home: torch.Tensor | None = None  # where the FP8 shard must live (copy engine)
    staged_pass: int = -1  # the pass whose shard was last cast / staged into the home
    fwd_uses: int = 0  # consumes this pass that autograd recorded: gradients to expect
    untracked_uses: int = 0  # forward consumes under no_grad (a recompute may stand in)
    recompute_uses: int = 0  # recompute consumes counted in place of untracked ones
    grads_done: int = 0
    hooks: list = field(default_factory=list)


@dataclass(eq=False)
class RuntimeStats:
    """Counters a test or the memory audit reads."""

    gathers_on_demand: int = 0
    gathers_prefetched: int = 0
    gathers_reused: int = 0  # backward served from a forward buffer of the same pass
    order_misses: int = 0
    reduce_scatters: int = 0


class ETPRuntime(GatherBuffers, GradientReductions):
    """The per-model engine behind ETP weights. Created by ``wrap_module_params_etp``.

    Args:
        config: prefetch / async_reduce / debug_checks / reduction / gather dtype.

    ``reset()`` forgets recorded chains, buffers and streams (for rebuilding a model in the
    same process); no state is process-global.

    Example::

        runtime = etp.runtime_of(model)
        runtime.stats.gathers_prefetched, runtime.nbytes()["gather_fwd"]
    """

    def __init__(self, config: ETPConfig) -> None:
        self.config = config
        self.groups = None  # the ETPGroups of the wrapped model, set by wrap_module_params_etp
        self.cache = WeightCache(debug=config.debug_checks)
        self.pool = WgradPool(debug=config.debug_checks)
        self.streams = StreamRegistry()
        self.sm_carveout = GemmSmCarveout(config.gemm_sm_carveout)
        self.stats = RuntimeStats()
        self._chains: dict[ChainKey, Chain] = {}
        self._states: dict[int, _ParamState] = {}
        self._pending: deque[_ParamState] = deque()
        self._phase = Role.BWD  # so that the first forward consume starts a pass
        self._consumed: dict[Role, set[int]] = {role: set() for role in Role}
        self._expected: dict[tuple[ChainKey, Role], torch.Tensor | None] = {}
        # cache.holder_key(ticket buffer) -> (id(param), param._version) whose gather it holds:
        # valid within one pass (one step with gather_reuse "step"; the optimizer may update
        # shards without bumping any version). See [Note: gather reuse].
        self._holder: dict[int, tuple[int, int]] = {}
        self.transports: dict[tuple[int, ...], Transports] = {}  # by group ranks
        self._reduce_pools: dict[tuple[int, ...], WgradPool] = {}  # transports that allocate
        self._staging_logged = False
        self._pass_index = 0
        self.quant_plans: dict = {}  # etp.quant's per-group tensorwise plans (stable views)
        # Grad-ready hooks: fired at once, muted (CUDA-graph warm-up) or collected to fire
        # after a graph replay (capture). See [Note: ETP CUDA graphs] in etp/graphs.py.
        self._hooks_muted = False
        self._hook_sink: list | None = None

    # ------------------------------------------------------------------ registration
    def register(self, param: torch.Tensor, name: str, kind: str, chain_class: str = "eager") -> None:
        """Adds an ETP param to this runtime (done by the wrapping helper)."""
        key = ChainKey(chain_class, kind, param.etp_group.ranks)
        chain = self._chains.get(key)
        if chain is None:
            chain = self._chains[key] = Chain(key, tuple(Role))
        self._states[id(param)] = _ParamState(param, name, chain, slot=len(self._states))
        param.etp_runtime = self

    def state(self, param: torch.Tensor) -> _ParamState:
        try:
            return self._states[id(param)]
        except KeyError:
            raise ETPStateError(
                f"parameter {param!r} is not registered with this ETP runtime; wrap the model "
                "with etp.wrap_module_params_etp"
            ) from None

    def register_grad_ready_hook(self, param: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
        self.state(param).hooks.append(hook)

    def setup_transports(self) -> None:
        """Chooses the transports of every shard group with registered params (once per
        group) and gives new params their symmetric-memory homes. A collective over the
        groups: every rank calls it after registering the same params (wrap does)."""
        new, reducers = [], {}
        for st in self._states.values():
            group = st.param.etp_group
            if group.ranks not in self.transports:
                self.transports[group.ranks] = choose_transports(self.config, group, st.param.device)
                chosen = self.transports[group.ranks]
                allocate = chosen.reduce.allocator()
                if allocate is not None:
                    # Never drop a symmetric buffer (it would be rendezvoused again): the pool
                    # then holds at most the peak number in use at once.
                    self._reduce_pools[group.ranks] = WgradPool(max_free_per_key=1 << 30, allocator=allocate,
                                                                debug=self.config.debug_checks)
            reduce = self.transports[group.ranks].reduce
            if hasattr(reduce, "reserve"):  # staging sized for the largest shard it reduces
                reduce.reserve(st.param, self._grad_wire_dtype(st.param))
                reducers[id(reduce)] = reduce
            gather = self.transports[group.ranks].gather
            if hasattr(gather, "register") and gather.home(st.param) is None:
                gather.register(st.param, self._wire_dtype(st.param))
                new.append((st, gather))
        for gather in {id(g): g for _, g in new}.values():
            gather.materialize()
        for reduce in reducers.values():
            reduce.materialize()
        with torch.no_grad():
            for st, gather in new:
                home = gather.home(st.param)
                if self.fp8:
                    st.quant_home = home  # etp.quantize_shards writes the FP8 shard here
                elif home.dtype == st.param.dtype:
                    home.copy_(st.param.detach())
                    st.param.data = home  # the optimizer now updates the symmetric shard

    # ------------------------------------------------------------------ passes
    @property
    def fp8(self) -> bool:
        return self.config.gather_dtype.startswith("fp8")

    def _start_pass(self) -> None:
        # Reductions of the previous pass complete (and fire their grad-ready hooks) before
        # this pass counts gradients: a microbatch under DDP's no_sync must not have its last
        # reduction land in the next microbatch, where DDP would count it as the next one's.
        self.drain_reductions()
        self._discard_in_flight()
        # A shard changed since it was quantized (an optimizer step): quantize all of them
        # once for this step. Every rank sees the same versions, so all take part.
        self.refresh_fp8()
        for chain in self._chains.values():
            for role in (Role.BWD, Role.RECOMPUTE):
                if chain.orders[role].params:
                    chain.orders[role].freeze()
        self._consumed = {role: set() for role in Role}
        if self.config.gather_reuse != "step":
            self._holder.clear()
        self._pass_index += 1
        for st in self._states.values():
            st.fwd_uses = st.untracked_uses = st.recompute_uses = st.grads_done = 0
        self._expected = {
            (key, role): chain.orders[role].head()
            for key, chain in self._chains.items()
            for role in Role
        }
        self._phase = Role.FWD

    def _enter_backward(self) -> None:
        for chain in self._chains.values():
            if chain.orders[Role.FWD].params:
                chain.orders[Role.FWD].freeze()
        self._phase = Role.BWD

    def _discard_in_flight(self) -> None:
        for st in self._states.values():
            for role in Role:
                if st.gather[role] is GatherState.IN_FLIGHT:
                    self._take(st, role)

    # ------------------------------------------------------------------ gathers
    def _wire_dtype(self, param: torch.Tensor) -> torch.dtype:
        return self.config.gather_torch_dtype or param.dtype

    def _source(self, param: torch.Tensor) -> torch.Tensor:
        if self.fp8:
            quant = self.state(param).quant
            if quant is None or quant.version != param._version:
                raise ETPStateError(
                    f"the FP8 shard of '{self.state(param).name}' is older than the parameter: "
                    "call etp.quantize_shards(model) after changing weights mid-step"
                )
            return quant.data
        shard = param.detach()
        wire = self._wire_dtype(param)
        home = self._transports(param).gather.home(param)
        if home is not None and home.data_ptr() != shard.data_ptr():
            # The gather reads only the symmetric home: cast (or stage) the shard into it,
            # once per pass (shards do not change within a pass).
            st = self.state(param)
            if st.staged_pass != self._pass_index:
                if home.dtype == shard.dtype and not self._staging_logged:
                    self._staging_logged = True
                    log.warning("etp transport: a shard left its symmetric-memory home (its storage "
                                "was moved, e.g. into a DDP buffer); staging it there once per pass")
                home.copy_(shard)
                st.staged_pass = self._pass_index
            return home
        return shard if shard.dtype == wire else shard.to(wire)

    def _transports(self, param: torch.Tensor) -> Transports:
        chosen = self.transports.get(param.etp_group.ranks)
        if chosen is None:  # params registered outside wrap_module_params_etp
            self.setup_transports()
            chosen = self.transports[param.etp_group.ranks]
        return chosen

    def _issue(self, st: _ParamState, role: Role) -> None:
        """Starts the async gather of ``st``'s weight into its ticket buffer."""
        st.gather[role] = transition(st.name, f"{role.value} gather", st.gather[role], GatherState.IN_FLIGHT)
        param = st.param
        source = self._source(param)  # cast on the current stream, after the optimizer's writes
        streams: CommStreams = self.streams.get(st.chain.key.chain_class, st.chain.key.ranks, param.device)
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

    def _take(self, st: _ParamState, role: Role) -> torch.Tensor:
        """Waits for the in-flight gather of ``st`` and returns its buffer."""
        st.gather[role] = transition(st.name, f"{role.value} gather", st.gather[role], GatherState.IDLE)
        flight = st.in_flight.pop(role)
        flight.handle.wait()  # the current stream waits for the gather
        return flight.buffer

    def _gather_now(self, st: _ParamState, role: Role, into_ticket: bool) -> torch.Tensor:
        param = st.param
        if into_ticket:
            out = self._buffer(st, role)
        else:
            out = torch.empty(param.etp_layout.padded_shape, dtype=self._wire_dtype(param), device=param.device)
        buffer = self._transports(param).gather.gather(self._source(param), param.etp_group, out,
                                                       async_op=False).wait()
        if into_ticket:
            self._holder[self.cache.holder_key(buffer)] = (id(param), param._version)
        self.stats.gathers_on_demand += 1
        return buffer

    def acquire(
        self, param: torch.Tensor, role: Role, compute_dtype: torch.dtype, records_grad: bool = True
    ) -> torch.Tensor:
        """The full logical weight of ``param`` for a GEMM of ``role``; see the module doc.

        ``records_grad``: autograd records this consume (grad mode was on and the weight
        requires grad), so a gradient will come back for it. A forward consume made while
        autograd runs a backward becomes ``Role.RECOMPUTE``; see [Note: ETP recompute chain].
        """
        st = self.state(param)
        if role is Role.FWD and torch._C._current_graph_task_id() != -1:
            role = Role.RECOMPUTE
        chain, order = st.chain, st.chain.orders[role]
        pid = id(param)
        if role is Role.FWD:
            if self._phase is Role.BWD:
                self._start_pass()
            if records_grad:
                st.fwd_uses += 1
            else:
                st.untracked_uses += 1
        else:
            if self._phase is Role.FWD:
                self._enter_backward()
            if role is Role.RECOMPUTE and records_grad and st.recompute_uses < st.untracked_uses:
                st.recompute_uses += 1
                st.fwd_uses += 1
        first_use = pid not in self._consumed[role]
        self._consumed[role].add(pid)

        if first_use:
            order.observe(param)
        expected = self._expected.get((chain.key, role))
        if first_use and order.frozen and expected is not None and expected is not param:
            self.stats.order_misses += 1
            if self.config.debug_checks:
                raise ETPStateError(
                    f"ETP {role.value} consume of '{st.name}' while the chain expected "
                    f"'{self.state(expected).name}': the execution order differs from the "
                    "recorded chain (call runtime.reset() after changing the model)"
                )

        if st.gather[role] is GatherState.IN_FLIGHT:
            buffer = self._take(st, role)
        elif self.config.prefetch and (resident := self._resident(st)) is not None:
            buffer = resident
            self.stats.gathers_reused += 1
        else:
            if (
                self.config.debug_checks and self._prefetches(role) and first_use and order.frozen
                and expected is param and order.first() is not param
            ):
                raise ETPStateError(
                    f"ETP {role.value} consume of '{st.name}' found no gather in flight although "
                    "the chain prefetched it"
                )
            # A ticket buffer may be the target of another in-flight gather of this chain only
            # when prefetching is on; on-demand gathers then use a fresh buffer.
            anything_in_flight = any(
                s.gather[role] is GatherState.IN_FLIGHT for s in self._states.values() if s.chain is chain
            )
            buffer = self._gather_now(st, role, into_ticket=not anything_in_flight)

        successor = order.after(param) if first_use else None
        if first_use:
            self._expected[(chain.key, role)] = successor
        if self._prefetches(role):
            self._prefetch(successor, role)
            if role is Role.FWD and first_use and order.is_last(param) and self._prefetches(Role.RECOMPUTE):
                # The chain's last forward weight: backward's recompute of this chain starts
                # next; its head is gathered now, behind the rest of forward and backward.
                self._prefetch(chain.orders[Role.RECOMPUTE].head(), Role.RECOMPUTE)

        weight = param.etp_layout.unpad(buffer)
        if self.fp8:
            return FP8Weight(weight, st.quant.scale, st.quant.scale_inv,
                             self.config.gather_dtype == "fp8_blockwise",
                             buffer, param.etp_layout.rows, self.config.fp8_fast_accum)
        return weight if weight.dtype == compute_dtype else weight.to(compute_dtype)

    def _prefetches(self, role: Role) -> bool:
        return self.config.prefetch and (role is not Role.RECOMPUTE or self.config.prefetch_recompute)

    def _prefetch(self, successor: torch.Tensor | None, role: Role) -> None:
        """Issues the gather of ``successor`` for ``role`` unless this pass already
        consumed or gathered it."""
        if successor is None or id(successor) in self._consumed[role]:
            return
        nxt = self.state(successor)
        if self._resident(nxt) is not None:
            pass  # already gathered in this pass: its consume re-uses that buffer
        elif nxt.gather[role] is GatherState.IDLE:
            self._issue(nxt, role)
        elif self.config.debug_checks:
            raise ETPStateError(f"ETP {role.value} gather of '{nxt.name}' issued twice")

    def drain(self) -> None:
        """Completes every pending reduce-scatter, discards unconsumed gathers, freezes the
        orders recorded so far and ends the pass. Call before the optimizer step."""
        self.drain_reductions()
        self._discard_in_flight()
        for chain in self._chains.values():
            for order in chain.orders.values():
                if order.params:
                    order.freeze()
        self._holder.clear()  # the optimizer step may change the shards: nothing stays resident
        self._phase = Role.BWD  # the next forward consume starts a pass

    def prefetch_after_step(self) -> int:
        """Starts the next pass now and issues the gather of every forward chain's head on
        the AG stream; call right after the optimizer step (and FP8 quantization). Returns the
        number of gathers issued (0 before the chains are recorded or with prefetch off).
        See [Note: ETP passes]."""
        if not self.config.prefetch:
            return 0
        self.drain()
        self._start_pass()
        issued = 0
        for chain in self._chains.values():
            if chain.key.chain_class != "eager":
                continue  # a graphed chain's gathers run inside its graph; see etp/graphs.py
            order = chain.orders[Role.FWD]
            head = order.head()
            if head is not None and self.state(head).gather[Role.FWD] is GatherState.IDLE:
                self._issue(self.state(head), Role.FWD)
                issued += 1
        return issued

    # ------------------------------------------------------------------ chain classes
    def use_chain_class(self, params, chain_class: str) -> int:
        """Moves ``params`` onto chains of ``chain_class`` (e.g. ``"graphed"``), forgetting
        every recorded order and buffer; call before the passes that record the new chains.
        Returns the number of params moved. See [Note: ETP chains]."""
        self.drain()
        moved = 0
        for param in params:
            st = self.state(param)
            key = ChainKey(chain_class, st.chain.key.kind, st.chain.key.ranks)
            if st.chain.key != key:
                st.chain = self._chains.setdefault(key, Chain(key, tuple(Role)))
                moved += 1
        self._chains = {key: chain for key, chain in self._chains.items()
                        if any(st.chain is chain for st in self._states.values())}
        for chain in self._chains.values():
            chain.reset()
        self._clear_gather_buffers()
        self._expected.clear()
        self._holder.clear()
        return moved

    def refresh_fp8(self) -> bool:
        """Quantizes the FP8 shards now if any shard changed since (in place: the addresses a
        captured graph reads stay valid). Returns whether it quantized."""
        if self.fp8 and any(st.quant is None or st.quant.version != st.param._version
                            for st in self._states.values()):
            quantize_shards(st.param for st in self._states.values())
            return True
        return False

    # ------------------------------------------------------------------ housekeeping
    def reset(self) -> None:
        """Forgets recorded chains and frees buffers and streams (states are kept)."""
        self.drain()
        for chain in self._chains.values():
            chain.reset()
        self._clear_gather_buffers()
        self.pool.clear()
        self.quant_plans.clear()
        for pool in self._reduce_pools.values():
            pool.clear()
        self.streams.clear()
        self._phase = Role.BWD

    def nbytes(self) -> dict[str, int]:
        """Bytes held by the gather cache (per role), the wgrad pool and the transports. The
        backings of aliased gather buffers ([Note: aliased own rows]) count as gather bytes and
        are outside torch's caching allocator, like the transports' bytes."""
        return {
            "gather_fwd": self.cache.nbytes(Role.FWD),
            "gather_bwd": self.cache.nbytes(Role.BWD),
            "gather_recompute": self.cache.nbytes(Role.RECOMPUTE),
            "wgrad_pool": self.pool.nbytes(),
            # Symmetric memory (copy-engine shard pools, symmetric wgrad buffers): allocated
            # outside torch's caching allocator, so not in torch.cuda.memory_allocated().
            "transport": sum(t.gather.nbytes() + t.reduce.nbytes() for t in self.transports.values()),
        }


def register_grad_ready_hook(param: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
    """Calls ``hook(param)`` each time all of this pass's gradient contributions of the ETP
    weight ``param`` have been reduce-scattered and added into ``param.main_grad`` (or
    ``param.grad``): never before. megatron-core DDP uses it to start its bucket reduction.

    Example::

        register_grad_ready_hook(layer.weight, lambda p: print("ready", p.shape))
    """
    runtime = getattr(param, "etp_runtime", None)
    if runtime is None:
        raise ValueError(f"{param!r} is not an ETP weight of a wrapped model")
    runtime.register_grad_ready_hook(param, hook)
