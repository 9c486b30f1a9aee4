"""Triton kernels over torch symmetric memory (CUDA, NVLink): ``symm_push``,
``symm_allgather``, ``symm_dedup``.

[Note: symmetric-memory phases]
Every buffer a peer writes or reads is a symmetric-memory allocation; the kernels address
peers through a pointer table (``buffer_ptrs`` of its rendezvous handle) built once at
construction. Each move is phases separated by a symmetric-memory barrier (``handle.barrier``,
a kernel on the current stream: release/acquire signals, capturable in a CUDA graph):

    barrier  -- the peers finished reading / expanding what this move overwrites
    write    -- push rows (or stage them locally)
    barrier  -- every peer's writes landed
    read     -- expand / pull / reduce locally

so nothing waits on the host, and ``prepare`` + ``dispatch`` + ``combine`` and their
backward are plain kernel launches on one stream.

[Note: graph-safe moves]
A CUDA graph captures each launch with the arguments it had at capture, so a move must
launch the same kernels with the same arguments (tensor addresses and Python scalars) on
every call with the same shapes: no host-side counter, parity, ``.item()``, or tensor
built from a Python value that changes per call. State that carries from one call to the
next (how many rows of a receive buffer the last step left valid, which the next one must
zero) lives on device in a tensor allocated with the buffer (``alloc_rows``) and is updated
by stream-ordered kernels; the barriers are device-side signal exchanges on the buffers'
signal pads. ``tests/kernels/test_ep_kernels.py`` checks the invariant on CPU (launch
arguments identical step to step, no tensor allocated by a move). The copy kernels are persistent and take
``EPConfig.num_ctas`` thread blocks, each moving ``[tile_rows, H]`` tiles (see [Note: row
tiles] in ``etp.kernels.ep_move``, where the kernels are).

Algorithms (all share the layout of [Note: receive layout] and produce the same rows):

* ``symm_push``: dispatch writes each (token, expert) row straight into its row of the
  receiver's buffer (the permutation into expert order fused into the transfer); combine
  writes each row of ``expert_out`` back into its source's slot for that pair and every
  source sums its K slots locally (fp32, k order: bit-identical to ``reference``).
* ``symm_dedup``: a token crosses to a rank once however many of its experts live there:
  dispatch pushes it into the receiver's per-token slot and the receiver expands it into
  its rows locally (its own tokens straight from ``x``: they skip the slot); combine first
  sums each source token's rows locally and pushes that one partial sum per (token, rank)
  into the source's slot, where the source reduces its slots locally (summation order
  differs from ``reference``: per rank first, then over ranks in the order of the token's
  first pair to each; bf16 partial sums). Both moves write to peers and walk the peers in
  rotation ([Note: peer order] in ``etp.kernels.ep_move``).
* ``symm_allgather``: every rank pulls every peer's tokens (all-gather), then selects its
  rows locally (its own from ``x``); combine as ``symm_dedup``. Moves tokens routed nowhere
  here too, and wins where nearly every token has an expert on every rank (large K, few
  ranks).
"""
from __future__ import annotations

import warnings

import torch
from torch.autograd.profiler import record_function

from etp.ep.backends.base import Backend, first_pairs
from etp.kernels import ep_move as km
from etp.kernels.ep_pack import copy_rows

__all__ = ["SYMM_BACKENDS"]


class _SymmBackend(Backend):
    needs_host_layout = False

    def __init__(self, ctx):
        super().__init__(ctx)
        import torch.distributed._symmetric_memory as symm_mem

        self._symm_mem = symm_mem
        if hasattr(symm_mem, "enable_symm_mem_for_group") and ctx.group is not None:
            try:  # needed by older torch; newer versions rendezvous without it (and warn)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    symm_mem.enable_symm_mem_for_group(ctx.group.group_name)
            except Exception:  # noqa: BLE001 - already enabled / deprecated: both fine
                pass
        # data_ptr -> (tensor, handle, pointer table, valid-row totals [2] on device)
        self._buffers: dict[int, tuple] = {}
        cfg = ctx.cfg
        # Launch parameters of every kernel (the same on every call: see [Note: graph-safe moves]).
        self._launch = dict(num_ctas=cfg.num_ctas, rows=cfg.tile_rows, num_warps=cfg.num_warps,
                            stages=cfg.num_stages)
        self._stage = self.alloc_rows(ctx.capacity, cfg.hidden_size)
        self._stage_w = self.alloc_rows(ctx.capacity, None, cfg.weight_dtype)

    def alloc_rows(self, rows, width=None, dtype=None):
        shape = (rows,) if width is None else (rows, width)
        t = self._symm_mem.empty(*shape, dtype=dtype or self.ctx.cfg.dtype, device=self.ctx.device)
        t.zero_()
        handle = self._symm_mem.rendezvous(t, self.ctx.group)
        table = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=self.ctx.device)
        # The rows select_rows left valid in t (all zero now): read and updated on device.
        totals = torch.zeros(2, dtype=torch.int64, device=self.ctx.device)
        self._buffers[t.data_ptr()] = (t, handle, table, totals)
        return t

    def tune(self, *, num_ctas=None, tile_rows=None, num_warps=None, num_stages=None) -> None:
        """Changes the copy kernels' launch parameters (``EPConfig``'s fields of those names;
        None keeps one) from the next move on, e.g. to sweep them in a benchmark without
        reallocating the buffers. A CUDA graph captured before keeps the old ones."""
        new = dict(num_ctas=num_ctas, rows=tile_rows, num_warps=num_warps, stages=num_stages)
        self._launch.update({key: value for key, value in new.items() if value is not None})

    def _table(self, t):
        entry = self._buffers.get(t.data_ptr())
        return entry[2] if entry is not None and t.is_contiguous() and t.numel() == entry[0].numel() else None

    def _barrier(self):
        with record_function("etp::ep_symm_barrier"):
            self._buffers[self._stage.data_ptr()][1].barrier(channel=0)

    def _select(self, src, src_map, out, tokens_per_expert, *, identity=False, zero_only=False, local=None,
                kept_rows=0):
        """Valid rows from ``src`` (unless zero_only; this rank's own slot from ``local``, or
        left as they are with ``kept_rows``), zeros over the previous step's rest."""
        out2 = out if out.dim() == 2 else out.view(-1, 1)
        src2 = src if src.dim() == 2 else src.view(-1, 1)
        totals = self._buffers[out.data_ptr()][3]  # out is always one of alloc_rows' buffers
        local_first = self.ctx.rank * self.ctx.cfg.max_tokens_per_rank
        km.select_rows(src2, src_map, out2, tokens_per_expert, totals, identity=identity, zero_only=zero_only,
                       local=local, local_first=local_first, kept_rows=kept_rows, **self._launch)

    def _staged(self, y, stage, tokens_per_expert):
        """A symmetric buffer holding ``y``'s valid rows (``y`` itself when it is one)."""
        table = self._table(y)
        if table is not None:
            return table
        self._select(y, None, stage, tokens_per_expert, identity=True)
        return self._table(stage)

    def combine_pairs(self, v, handle, out):
        lay = handle.layout
        self._barrier()
        table = self._staged(v, self._stage_w, lay.tokens_per_expert)
        self._barrier()
        km.pull_pairs(table, lay.pair_row, lay.pair_rank, out.view(-1), **self._launch)


class SymmPushBackend(_SymmBackend):
    name = "symm_push"

    def __init__(self, ctx):
        super().__init__(ctx)
        cfg, world = ctx.cfg, ctx.world_size
        self._slots = cfg.max_tokens_per_rank * cfg.topk
        # Per pair of this rank's tokens: the expert row its destination pushes back in combine.
        self._pairs = self.alloc_rows(self._slots, cfg.hidden_size)
        # Receive row -> (source rank, pair) slot, pushed by prepare (and push_meta's per-source
        # table, which this backend does not read).
        self._pair_map = self.alloc_rows(ctx.capacity, None, torch.int64)
        self._pair_red = self.alloc_rows(world * self._slots, None, torch.int64)
        self._pairs_here = km.table_of([self._pairs], ctx.device)
        self._zeros = torch.zeros(self._slots, dtype=torch.int64, device=ctx.device)

    def on_prepare(self, handle):
        lay, ctx = handle.layout, self.ctx
        self._barrier()
        with record_function("etp::ep_symm_push_meta"):
            # One "token" per pair (topk 1): slot me * T*K + p of each pair's destination.
            km.push_meta(lay.pair_row, lay.pair_rank, self._table(self._pair_map), self._table(self._pair_red),
                         ctx.world_size, ctx.rank, self._slots, 1, **self._launch)
        self._barrier()
        sent = lay.pair_row >= 0
        handle.backend_state[self.name] = torch.where(sent, torch.arange(sent.numel(), device=sent.device), -1)

    def dispatch(self, x, w, handle, out_x, out_w):
        lay = handle.layout
        self._barrier()
        with record_function("etp::ep_symm_push"):
            km.push_rows(x.contiguous(), None if w is None else w.contiguous().to(out_w.dtype), lay.pair_row,
                         lay.pair_rank, self._table(out_x), None if w is None else self._table(out_w),
                         mode=km.X_ROWS, **self._launch)
        self._barrier()
        self._select(out_x, None, out_x, lay.tokens_per_expert, identity=True, zero_only=True)
        if w is not None:
            self._select(out_w, None, out_w, lay.tokens_per_expert, identity=True, zero_only=True)

    def combine(self, y, handle, out):
        """Each destination pushes its rows back into their sources' per-pair slots (posted
        writes, see [Note: peer order]); each source sums its K slots locally (fp32, k order:
        bit-identical to ``reference``)."""
        lay = handle.layout
        self._barrier()
        with record_function("etp::ep_symm_push_back"):
            copy_rows(y.contiguous(), self._pair_map, self._table(self._pairs), 0, y.shape[0], scatter=True,
                      tokens_per_expert=lay.tokens_per_expert, slot_rows=self._slots, **self._launch)
        self._barrier()
        pairs = handle.backend_state[self.name]
        with record_function("etp::ep_symm_slot_reduce"):
            km.pull_reduce(self._pairs_here, pairs, self._zeros[:pairs.numel()], out, **self._launch)


class SymmDedupBackend(_SymmBackend):
    name = "symm_dedup"

    def __init__(self, ctx):
        if ctx.world_size > 64:  # the kernels track a token's ranks in one int64 bitmask
            raise ValueError(f"EP backend {self.name!r} takes at most 64 ranks, the group has {ctx.world_size}: "
                             "use symm_push")
        super().__init__(ctx)
        cfg, world = ctx.cfg, ctx.world_size
        self._t_max = cfg.max_tokens_per_rank
        # Per (source rank, token) slot: its row pushed once (dispatch), its partial sum (combine).
        self._tokens = self.alloc_rows(world * self._t_max, cfg.hidden_size)
        # Receive row -> source slot, and source slot -> its rows here (-1: none), pushed by prepare.
        self._map = self.alloc_rows(ctx.capacity, None, torch.int64)
        self._red = self.alloc_rows(world * self._t_max * cfg.topk, None, torch.int64)
        # This rank's slots as W blocks: the partial sums the peers push back in combine.
        self._slots = km.slot_table(self._tokens, world)

    def wire_rows(self, handle, move):
        """One row per token and other rank it has experts on (a partial sum in combine)."""
        lay, T, K = handle.layout, handle.tokens, handle.topk
        sent = (lay.pair_row >= 0).view(T, K)
        rank = lay.pair_rank.view(T, K)
        counts = torch.bincount(rank[first_pairs(rank, sent)], minlength=self.ctx.world_size)
        counts[self.ctx.rank] = 0
        return counts.tolist()

    def on_prepare(self, handle):
        lay, ctx = handle.layout, self.ctx
        self._barrier()
        with record_function("etp::ep_symm_push_meta"):
            km.push_meta(lay.pair_row, lay.pair_rank, self._table(self._map), self._table(self._red),
                         ctx.world_size, ctx.rank, self._t_max, ctx.cfg.topk, **self._launch)
        self._barrier()

    def dispatch(self, x, w, handle, out_x, out_w):
        lay = handle.layout
        x = x.contiguous()
        self._barrier()
        with record_function("etp::ep_symm_push_dedup"):
            # This rank's own tokens skip their slot and go straight into out_x ([Note: own rows]).
            km.push_rows(x, None if w is None else w.contiguous().to(out_w.dtype), lay.pair_row,
                         lay.pair_rank, self._table(self._tokens), None if w is None else self._table(out_w),
                         mode=km.X_DEDUP, me=self.ctx.rank, t_max=self._t_max, own=out_x,
                         **self._launch)
        self._barrier()
        with record_function("etp::ep_symm_expand"):
            self._select(self._tokens, self._map, out_x, lay.tokens_per_expert, kept_rows=self._t_max)
        if w is not None:
            self._select(out_w, None, out_w, lay.tokens_per_expert, identity=True, zero_only=True)

    def combine(self, y, handle, out):
        lay, me, red = handle.layout, self.ctx.rank, self._red.view(-1, self.ctx.cfg.topk)
        self._barrier()
        with record_function("etp::ep_symm_reduce_push"):
            km.local_reduce(y.contiguous(), red, lay.tokens, self._table(self._tokens), self._t_max, me=me,
                            **self._launch)
        self._barrier()
        with record_function("etp::ep_symm_slot_reduce"):
            km.pull_reduce(self._slots, lay.pair_row, lay.pair_rank, out, dedup=True, **self._launch)


class SymmAllGatherBackend(SymmDedupBackend):
    name = "symm_allgather"

    def __init__(self, ctx):
        super().__init__(ctx)
        self._x_stage = self.alloc_rows(self._t_max, ctx.cfg.hidden_size)

    def wire_rows(self, handle, move):
        """Dispatch: every peer reads all of this rank's tokens; combine as ``symm_dedup``."""
        if move == "combine":
            return super().wire_rows(handle, move)
        return [0 if d == self.ctx.rank else handle.tokens for d in range(self.ctx.world_size)]

    def _send_tokens(self, x, w, handle, out_w):
        lay = handle.layout
        self._x_stage[: x.shape[0]].copy_(x)
        if w is not None:
            km.push_rows(x, w.contiguous().to(out_w.dtype), lay.pair_row, lay.pair_rank, None, self._table(out_w),
                         mode=km.X_NONE, **self._launch)

    def dispatch(self, x, w, handle, out_x, out_w):
        lay = handle.layout
        x = x.contiguous()
        self._barrier()
        self._send_tokens(x, w, handle, out_w)
        self._barrier()
        with record_function("etp::ep_symm_all_gather"):
            km.gather_tokens(self._table(self._x_stage), lay.tokens, self._tokens, self._t_max, skip=self.ctx.rank,
                             **self._launch)
        with record_function("etp::ep_symm_expand"):
            self._select(self._tokens, self._map, out_x, lay.tokens_per_expert, local=x)
        if w is not None:
            self._select(out_w, None, out_w, lay.tokens_per_expert, identity=True, zero_only=True)


SYMM_BACKENDS = {cls.name: cls for cls in (SymmPushBackend, SymmAllGatherBackend, SymmDedupBackend)}
