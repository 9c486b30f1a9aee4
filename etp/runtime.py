"""ETPRuntime: gathers, prefetches and reduce-scatters the ETP weights of one model.

The autograd Functions (``etp.autograd``) call three methods:

* ``acquire(param, role, dtype)`` returns the full logical weight for a GEMM. A prefetched
  gather is waited for; otherwise the weight is gathered on demand. Then the next weight of
  the chain is prefetched on the AG side stream. See [Note: ETP chains]. The gather side
  (``etp/gather_side.py``, ``runtime.gathers``) owns all of that.
* ``wgrad_buffer(param)`` hands out a pooled, padded buffer for the full weight gradient.
* ``reduce_grad(param, buffer)`` issues its reduce-scatter on the RS side stream and
  finalizes the previously issued one (wait, add into ``main_grad`` / ``grad``, fire the
  grad-ready hooks, return the buffer). The last weight of the backward chain is finalized at
  once; ``drain()`` (called by ``etp.finalize_grads``) completes everything before the
  optimizer step. The reduce side (``etp/reduce_side.py``, ``runtime.reductions``) owns
  that, and how many gradients each weight expects per pass.
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
reaches it.
"""
from __future__ import annotations

from typing import Callable

import torch

from .cache import Role
from .config import ETPConfig
from .gather_side import GatherSide, Registered
from .prefetch_chains import Chain, ChainKey
from .quant import quantize_shards
from .reduce_side import ReduceSide
from .state_machines import ETPStateError
from .streams import StreamRegistry
from .transport import Transports, choose_transports

__all__ = ["ETPRuntime", "RuntimeStats", "engine_of", "register_grad_ready_hook"]


class RuntimeStats:
    """Counters a test or the memory audit reads: a live view of the two sides' counters."""

    def __init__(self, gathers: GatherSide, reductions: ReduceSide) -> None:
        self._gathers, self._reductions = gathers, reductions

    gathers_on_demand = property(lambda self: self._gathers.stats.gathers_on_demand)
    gathers_prefetched = property(lambda self: self._gathers.stats.gathers_prefetched)
    #: backward served from a forward buffer of the same pass
    gathers_reused = property(lambda self: self._gathers.stats.gathers_reused)
    order_misses = property(lambda self: self._gathers.stats.order_misses)
    reduce_scatters = property(lambda self: self._reductions.reduce_scatters)

    NAMES = ("gathers_on_demand", "gathers_prefetched", "gathers_reused", "order_misses", "reduce_scatters")

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.NAMES}

    def __repr__(self) -> str:
        return "RuntimeStats(" + ", ".join(f"{n}={v}" for n, v in self.as_dict().items()) + ")"


class ETPRuntime:
    """The per-model engine behind ETP weights. Created by ``wrap_module_params_etp``.

    It owns the registered weights, their chains, the pass lifecycle and the transports,
    and is composed of a gather side (``gathers``) and a reduce side (``reductions``), each
    owning its own state of every weight.

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
        self.streams = StreamRegistry()
        self.transports: dict[tuple[int, ...], Transports] = {}  # by group ranks
        self.gathers = GatherSide(config, self._transports_of, self.streams)
        self.reductions = ReduceSide(config, self._transports_of, self.streams)
        self.quant_plans: dict = {}  # (group ranks, format) -> the plans its quantization keeps
        self._chains: dict[ChainKey, Chain] = {}
        self._records: dict[int, Registered] = {}
        self._phase = Role.BWD  # so that the first forward consume starts a pass

    # ------------------------------------------------------------------ registration
    def register(self, param: torch.Tensor, name: str, kind: str, chain_class: str = "eager") -> None:
        """Adds an ETP param to this runtime (done by the wrapping helper)."""
        key = ChainKey(chain_class, kind, param.etp_group.ranks)
        chain = self._chains.get(key)
        if chain is None:
            chain = self._chains[key] = Chain(key, tuple(Role))
        record = self._records[id(param)] = Registered(param, name, chain, slot=len(self._records))
        self.gathers.add(record)
        self.reductions.add(record)
        param.etp_runtime = self

    def record(self, param: torch.Tensor) -> Registered:
        try:
            return self._records[id(param)]
        except KeyError:
            raise ETPStateError(
                f"parameter {param!r} is not registered with this ETP runtime; wrap the model "
                "with etp.wrap_module_params_etp"
            ) from None

    def fp8_shard(self, param: torch.Tensor):
        """``param``'s quantized (FP8) shard of this step (``etp.formats.QuantizedShard``), None
        before the first quantization or with a format that keeps none."""
        self.record(param)
        return self.gathers.state(param).quant

    def register_grad_ready_hook(self, param: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
        self.record(param)
        self.reductions.add_hook(param, hook)

    @property
    def stats(self) -> RuntimeStats:
        return RuntimeStats(self.gathers, self.reductions)

    @property
    def quantized(self) -> bool:
        """Whether the gather format keeps quantized shards (``etp.formats``)."""
        return self.gathers.quantized

    # ------------------------------------------------------------------ transports
    def _transports_of(self, param: torch.Tensor) -> Transports:
        chosen = self.transports.get(param.etp_group.ranks)
        if chosen is None:  # params registered outside wrap_module_params_etp
            self.setup_transports()
            chosen = self.transports[param.etp_group.ranks]
        return chosen

    def setup_transports(self) -> None:
        """Chooses the transports of every shard group with registered params (once per
        group) and gives new params their symmetric-memory homes. A collective over the
        groups: every rank calls it after registering the same params (wrap does)."""
        new, reducers = [], {}
        for record in self._records.values():
            param = record.param
            group = param.etp_group
            if group.ranks not in self.transports:
                self.transports[group.ranks] = choose_transports(self.config, group, param.device)
            reduce = self.transports[group.ranks].reduce
            if hasattr(reduce, "reserve"):  # staging sized for the largest shard it reduces
                reduce.reserve(param, self.reductions.grad_wire_dtype(param))
                reducers[id(reduce)] = reduce
            gather = self.transports[group.ranks].gather
            if hasattr(gather, "register") and gather.home(param) is None:
                gather.register(param, self.gathers.wire_dtype(param))
                new.append((param, gather))
        for gather in {id(g): g for _, g in new}.values():
            gather.materialize()
        for reduce in reducers.values():
            reduce.materialize()
        with torch.no_grad():
            for param, gather in new:
                home = gather.home(param)
                if self.quantized:
                    self.gathers.state(param).quant_home = home  # etp.quantize_shards writes the quantized shard here
                elif home.dtype == param.dtype:
                    home.copy_(param.detach())
                    param.data = home  # the optimizer now updates the symmetric shard

    # ------------------------------------------------------------------ passes
    def _start_pass(self) -> None:
        # Reductions of the previous pass complete (and fire their grad-ready hooks) before
        # this pass counts gradients: a microbatch under DDP's no_sync must not have its last
        # reduction land in the next microbatch, where DDP would count it as the next one's.
        self.reductions.drain()
        self.gathers.discard_in_flight()
        # A shard changed since it was quantized (an optimizer step): quantize all of them
        # once for this step. Every rank sees the same versions, so all take part.
        self.refresh_fp8()
        for chain in self._chains.values():
            for role in (Role.BWD, Role.RECOMPUTE):
                if chain.orders[role].params:
                    chain.orders[role].freeze()
        self.gathers.start_pass(self._chains)
        self.reductions.start_pass()
        self._phase = Role.FWD

    def _enter_backward(self) -> None:
        for chain in self._chains.values():
            if chain.orders[Role.FWD].params:
                chain.orders[Role.FWD].freeze()
        self._phase = Role.BWD

    def acquire(
        self, param: torch.Tensor, role: Role, compute_dtype: torch.dtype, records_grad: bool = True
    ) -> torch.Tensor:
        """The full logical weight of ``param`` for a GEMM of ``role``; see the module doc.

        ``records_grad``: autograd records this consume (grad mode was on and the weight
        requires grad), so a gradient will come back for it. A forward consume made while
        autograd runs a backward becomes ``Role.RECOMPUTE``; see [Note: ETP recompute chain].
        """
        self.record(param)
        if role is Role.FWD and torch._C._current_graph_task_id() != -1:
            role = Role.RECOMPUTE
        if role is Role.FWD and self._phase is Role.BWD:
            self._start_pass()
        elif role is not Role.FWD and self._phase is Role.FWD:
            self._enter_backward()
        self.reductions.count_consume(param, role, records_grad)
        return self.gathers.acquire(param, role, compute_dtype)

    def wgrad_buffer(self, param: torch.Tensor) -> torch.Tensor:
        """A pooled ``[padded_rows, cols]`` buffer for ``param``'s full weight gradient."""
        return self.reductions.wgrad_buffer(param)

    def reduce_grad(self, param: torch.Tensor, wgrad: torch.Tensor) -> None:
        """Issues the reduce-scatter of ``param``'s weight gradient; see ``ReduceSide``."""
        self.record(param)
        self.reductions.reduce_grad(param, wgrad)

    def drain(self) -> None:
        """Completes every pending reduce-scatter, discards unconsumed gathers, freezes the
        orders recorded so far and ends the pass. Call before the optimizer step."""
        self.reductions.drain()
        self.gathers.discard_in_flight()
        for chain in self._chains.values():
            for order in chain.orders.values():
                if order.params:
                    order.freeze()
        self.gathers.end_step()
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
        return self.gathers.prefetch_heads(self._chains)

    # ------------------------------------------------------------------ chain classes
    def use_chain_class(self, params, chain_class: str) -> int:
        """Moves ``params`` onto chains of ``chain_class`` (e.g. ``"graphed"``), forgetting
        every recorded order and buffer; call before the passes that record the new chains.
        Returns the number of params moved. See [Note: ETP chains]."""
        self.drain()
        moved = 0
        for param in params:
            record = self.record(param)
            key = ChainKey(chain_class, record.chain.key.kind, record.chain.key.ranks)
            if record.chain.key != key:
                record.chain = self._chains.setdefault(key, Chain(key, tuple(Role)))
                moved += 1
        self._chains = {key: chain for key, chain in self._chains.items()
                        if any(r.chain is chain for r in self._records.values())}
        for chain in self._chains.values():
            chain.reset()
        self.gathers.forget_buffers(self.transports.values())
        return moved

    def refresh_fp8(self) -> bool:
        """Quantizes the quantized (FP8) shards now if any shard changed since (in place: the
        addresses a captured graph reads stay valid). Returns whether it quantized."""
        if self.quantized and any((q := self.gathers.state(r.param).quant) is None or q.version != r.param._version
                            for r in self._records.values()):
            quantize_shards(r.param for r in self._records.values())
            return True
        return False

    # ------------------------------------------------------------------ grad-ready hooks
    def fire_grad_ready(self, params) -> None:
        """Calls the grad-ready hooks of ``params`` in order (after a CUDA-graph replay)."""
        self.reductions.fire_grad_ready(params)

    def hooks_muted(self):
        """Grad-ready hooks do not fire inside (gradients computed here are thrown away)."""
        return self.reductions.hooks_muted()

    def hooks_deferred(self):
        """Yields the params whose grad-ready hooks came due inside and fires none of them."""
        return self.reductions.hooks_deferred()

    # ------------------------------------------------------------------ housekeeping
    def reset(self) -> None:
        """Forgets recorded chains and frees buffers and streams (states are kept)."""
        self.drain()
        for chain in self._chains.values():
            chain.reset()
        self.gathers.forget_buffers(self.transports.values())
        self.reductions.pool.clear()
        self.quant_plans.clear()
        self.streams.clear()
        self._phase = Role.BWD

    def nbytes(self) -> dict[str, int]:
        """Bytes held by the gather cache (per role), the wgrad pool and the transports. The
        backings of aliased gather buffers ([Note: aliased own rows]) count as gather bytes and
        are outside torch's caching allocator, like the transports' bytes."""
        cache = self.gathers.cache
        return {
            "gather_fwd": cache.nbytes(Role.FWD),
            "gather_bwd": cache.nbytes(Role.BWD),
            "gather_recompute": cache.nbytes(Role.RECOMPUTE),
            "wgrad_pool": self.reductions.pool.nbytes(),
            # Symmetric memory (copy-engine shard pools, push staging): allocated outside
            # torch's caching allocator, so not in torch.cuda.memory_allocated().
            "transport": sum(t.gather.nbytes() + t.reduce.nbytes() for t in self.transports.values()),
        }


def engine_of(param: torch.Tensor) -> ETPRuntime:
    """The runtime that gathers and reduce-scatters the ETP weight ``param``: the one seam
    through which the ETP Functions (``etp.autograd``) reach the engine, an import the
    architecture test sees rather than an attribute it cannot.

    Example::

        weight = engine_of(param).acquire(param, Role.FWD, x.dtype, records_grad)
    """
    runtime = getattr(param, "etp_runtime", None)
    if runtime is None:
        raise ValueError(f"{param!r} is not an ETP weight of a wrapped model (etp.wrap_module_params_etp)")
    return runtime


def register_grad_ready_hook(param: torch.Tensor, hook: Callable[[torch.Tensor], None]) -> None:
    """Calls ``hook(param)`` each time all of this pass's gradient contributions of the ETP
    weight ``param`` have been reduce-scattered and added into ``param.main_grad`` (or
    ``param.grad``): never before. megatron-core DDP uses it to start its bucket reduction.

    Example::

        register_grad_ready_hook(layer.weight, lambda p: print("ready", p.shape))
    """
    runtime = engine_of(param)
    runtime.register_grad_ready_hook(param, hook)
