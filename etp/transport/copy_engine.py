"""The copy-engine gather: peer copies out of symmetric memory, no SMs.

Each rank's wire shard (the bf16 parameter itself, or the FP8 shard written by
``etp.quantize_shards``) lives in a slot of the group's ``SymmetricPool``; the parameter's
storage *is* that slot when the wire dtype is the parameter's (set up by
``etp.transport.setup``), so the optimizer's update needs no copy. A gather is, on the
current (AG side) stream::

    fence     -- every peer's stream reached this gather: its shard is written
    copy_     -- one cudaMemcpyAsync per rank, peer slot -> rows of the ticket buffer
    fence     -- every peer finished reading this rank's shard (it may be overwritten)

The fences are stream flag operations (``FlagBarrier``: a fenced write into each peer's pad,
a wait on this rank's own; no kernel), and the copies run on the copy engines, so a GEMM
beside the gather keeps all its SMs. While a CUDA graph is being captured the fences are
symmetric-memory barrier kernels instead (one CTA each, spinning on an SM until the peers
arrive, beside the GEMMs), since flag values would be baked into the graph. Each stream that gathers gets its own channel
(assigned in first-use order, the same on every rank), so a synchronous gather on the
compute stream never pairs with a prefetch's fence.

[Note: the own-rows copy takes the SMs]
Only the peers' rows move on copy engines. This rank's own rows are a device-local copy, and
the driver runs a device-local ``cudaMemcpyAsync`` on the SMs (at a byte rate no copy engine
reaches): a grouped GEMM issued beside it does not start until it ends, so the two run
serialized (``tools/diag/probe_local_copy.py`` shows it). Neither another stream,
``cudaMemcpyPeerAsync`` within one device, nor ``cuMemcpyBatchAsync``'s
``PREFER_OVERLAP_WITH_COMPUTE`` hint changes that. On the bf16 expert stack these copies, one
per shard in forward and backward, stall the compute stream every step. Aliased buffers
remove them: the gather buffer's
own rows are the shard itself ([Note: aliased own rows] in etp/transport/vmm.py). They need
the ranks to share allocations through ``pidfd_getfd``; where they cannot
(``vmm.handle_sharing_status``), the own rows are copied and the wrap-time log line says why.
"""
from __future__ import annotations

import torch
from torch.autograd.profiler import record_function

from ..streams import current_raw_stream, current_stream_event
from .base import DoneHandle, EventHandle, GatherTransport, Handle
from .flag_barrier import FlagBarrier
from .symm_pool import SymmetricPool

__all__ = ["CopyEngineGather"]


class CopyEngineGather(GatherTransport):
    """Gathers out of the group's symmetric pools (one slot per param, keyed by ``id(param)``)."""

    name = "copy_engine"

    def __init__(self, process_group, device: torch.device) -> None:
        """A collective over ``process_group`` on CUDA: it asks whether the ranks can share
        allocations for aliased gather buffers (``self.aliasing``, ``self.aliasing_reason``)."""
        self.process_group, self.device = process_group, device
        # One pool per wrap call (normally one): slots are reserved, then materialized once.
        self.pools: list[SymmetricPool] = []
        self._pool_of: dict[object, SymmetricPool] = {}
        self._key_of_ptr: dict[int, tuple[object, SymmetricPool]] = {}
        self._channels: dict[int, int] = {}
        self._flags: FlagBarrier | None = None
        self.aliasing, self.aliasing_reason = False, "tensors not on CUDA"
        if device.type == "cuda":
            from .vmm import handle_sharing_status

            self.aliasing, self.aliasing_reason = handle_sharing_status(process_group)
        self._granularity = 0
        self._backings: dict[int, object] = {}  # backing data_ptr -> its vmm.Mapping
        self._aliases: dict[tuple[int, int], tuple] = {}  # (id(param), backing ptr) -> (buffer, mapping)
        self._aliased_ptrs: set[int] = set()  # data_ptr of every aliased buffer: no own-rows copy

    def register(self, param: torch.Tensor, wire_dtype: torch.dtype) -> None:
        """Reserves ``param``'s home slot ``[shard_rows, cols]`` of ``wire_dtype``."""
        if id(param) in self._pool_of:
            return
        if not self.pools or self.pools[-1].buffer is not None:
            if self.aliasing and not self._granularity:
                from .vmm import granularity

                self._granularity = granularity(self.device)
            self.pools.append(SymmetricPool(self.process_group, self.device, self._granularity))
        self.pools[-1].reserve(id(param), param.etp_layout.shard_shape, wire_dtype)
        self._pool_of[id(param)] = self.pools[-1]

    def materialize(self) -> None:
        """Allocates and rendezvouses the pending pool (a collective over the group)."""
        if not self.pools or self.pools[-1].buffer is not None:
            return
        pool = self.pools[-1]
        pool.materialize()
        if self._flags is None and self.device.type == "cuda":
            self._flags = FlagBarrier(self.process_group, self.device)
            self._flags.materialize()
        for key in pool.keys():
            self._key_of_ptr[pool.slot(key).data_ptr()] = (key, pool)

    def home(self, param: torch.Tensor) -> torch.Tensor | None:
        pool = self._pool_of.get(id(param))
        return None if pool is None or pool.buffer is None else pool.slot(id(param))

    # ------------------------------------------------------------------ aliased buffers
    def _aliased(self, param: torch.Tensor) -> bool:
        pool = self._pool_of.get(id(param))
        return self.aliasing and pool is not None and pool.owned(id(param)) is not None

    def allocate_backing(self, param: torch.Tensor, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A ticket's backing: for a weight whose gathers can be aliased (its shard is an
        allocation of its own), ``world - 1`` allocations of one shard each, for the peers'
        rows; else a plain full buffer."""
        if not self._aliased(param):
            return super().allocate_backing(param, shape, dtype, device)
        from .vmm import Mapping

        size = param.etp_group.size
        rows = shape[0] // size
        segment = rows * int(torch.Size(shape[1:]).numel()) * torch.empty((), dtype=dtype).element_size()
        mapping = Mapping(device, [(None, segment)] * (size - 1))
        backing = mapping.tensor(dtype, ((size - 1) * rows, *shape[1:]))
        self._backings[backing.data_ptr()] = mapping
        return backing

    def alias(self, param: torch.Tensor, backing: torch.Tensor) -> torch.Tensor:
        """``backing`` itself when it is a plain buffer, else (made once) the full padded weight
        whose own rows map onto ``param``'s shard and whose peers' rows map onto ``backing``."""
        mapping = self._backings.get(backing.data_ptr())
        if mapping is None:
            return backing
        made = self._aliases.get((id(param), backing.data_ptr()))
        if made is not None:
            return made[0]
        if not self._aliased(param):
            raise RuntimeError(f"etp copy-engine gather: a weight of shape {tuple(param.etp_layout.padded_shape)} "
                               "shares an aliased ticket but has no shard allocation of its own (an etp bug)")
        from .vmm import Mapping

        group = param.etp_group
        segment = mapping.nbytes // (group.size - 1)
        shard = self._pool_of[id(param)].owned(id(param))
        alias = Mapping(self.device, [(shard, segment) if peer == group.rank else
                                      (mapping.handles[peer if peer < group.rank else peer - 1], segment)
                                      for peer in range(group.size)])
        buffer = alias.tensor(backing.dtype, param.etp_layout.padded_shape)
        self._aliases[(id(param), backing.data_ptr())] = (buffer, alias)  # the mapping kept with its tensor
        self._aliased_ptrs.add(buffer.data_ptr())
        return buffer

    def release_buffers(self) -> None:
        """Forgets the backings and aliases (the weight cache dropped its tickets); their
        mappings are freed once no tensor refers to them."""
        self._backings.clear()
        self._aliases.clear()
        self._aliased_ptrs.clear()

    def _channel(self) -> tuple[int, int]:
        """The current stream's fence channel and its raw handle."""
        stream = current_raw_stream(self.device)
        return self._channels.setdefault(stream, len(self._channels)), stream

    def _fence(self, pool: SymmetricPool, channel: int, stream: int, capturing: bool) -> None:
        if self._flags is None or capturing:
            pool.barrier(channel)
        else:
            self._flags(channel, stream)

    def gather(self, source, group, out, async_op) -> Handle:
        found = self._key_of_ptr.get(source.data_ptr())
        if found is None:
            raise RuntimeError(
                "etp copy-engine gather: the source shard is not in the symmetric pool "
                "(the runtime stages it there; this is an etp bug)"
            )
        key, pool = found
        rows = source.shape[0]
        channel, stream = self._channel()
        capturing = out.is_cuda and torch.cuda.is_current_stream_capturing()
        with record_function("etp::all_gather_copy_engine"):
            self._fence(pool, channel, stream, capturing)
            aliased = out.data_ptr() in self._aliased_ptrs  # the own rows are the shard already
            for step in range(1 if aliased else 0, group.size):
                peer = (group.rank + step) % group.size
                src = source if peer == group.rank else pool.peer(key, peer)
                out[peer * rows : (peer + 1) * rows].copy_(src)
            self._fence(pool, channel, stream, capturing)
        if not async_op:
            return DoneHandle(out)
        return EventHandle(out, current_stream_event(out.device), keep=(source,))

    def nbytes(self) -> int:
        """Shard pools and flag pads (outside torch's allocator). Aliased tickets' backings are
        outside it too, but the weight cache counts them (``ETPRuntime.nbytes``' gather bytes)."""
        flags = 0 if self._flags is None else self._flags.nbytes()
        return sum(pool.nbytes() for pool in self.pools) + flags
