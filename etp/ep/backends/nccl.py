"""``nccl`` and ``nccl_padded``: ``all_to_all_single`` on static buffers, the permutations
fused into Triton pack / unpack kernels around it.

Both cross hosts (NCCL's transports), move only the rows of pairs whose expert lives on
another rank (a pair to a local expert is written straight into, or read straight from, the
receive rows), and allocate nothing per move. See [Note: exchange layout] in
``etp.ep.backends.exchange`` for where the rows sit.

* ``nccl``: exact split sizes, read on the host once per ``prepare`` (one sync; not
  capturable). Moves exactly the rows routed to other ranks.
* ``nccl_padded``: a fixed number of rows per peer (``peer_capacity``) and equal static
  splits: no host sync, capturable in a CUDA graph; moves the padding too. Rows past a
  peer's capacity are not sent and ``check()`` raises (a capacity the routing must fit).

A move: dispatch packs x rows and routing weights into the send region (``push_rows`` with
a two-buffer table: the exchange buffer, or this rank's receive rows for a local expert),
exchanges, and scatters the arrival rows into the receive layout (``copy_rows``); combine
gathers ``expert_out`` rows into the arrival region, exchanges back, and sums each token's K
rows in fp32 in k order (``pull_reduce`` over the exchange buffer and ``expert_out``:
bit-identical to ``reference``). Runs on gloo too (the CPU tests).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from etp.ep.backends.base import Backend
from etp.ep.backends.exchange import plan_exchange
from etp.ep.backends.pack import TorchPack, TritonPack

__all__ = ["NcclBackend", "NcclPaddedBackend", "peer_capacity"]


def peer_capacity(cfg, world_size: int) -> int:
    """Rows ``nccl_padded`` sends to each peer: ``ceil(capacity_factor * T * K / W)``, or with
    ``capacity_factor=None`` the most a rank can route to one peer, ``T * min(K, E / W)``."""
    exact = cfg.max_tokens_per_rank * min(cfg.topk, cfg.experts_per_rank(world_size))
    if cfg.capacity_factor is None:
        return exact
    return max(1, min(exact, math.ceil(cfg.capacity_factor * cfg.max_tokens_per_rank * cfg.topk / world_size)))


class NcclBackend(Backend):
    name = "nccl"
    needs_host_layout = True

    def __init__(self, ctx):
        super().__init__(ctx)
        cfg = ctx.cfg
        self._peer_rows = self._peer_counts = None
        self._arrival, send = self._regions()
        self._launch = dict(num_ctas=cfg.num_ctas, rows=cfg.tile_rows, num_warps=cfg.num_warps, stages=cfg.num_stages)
        total = self._arrival + send
        self._rows = torch.zeros(total, cfg.hidden_size, dtype=cfg.dtype, device=ctx.device)
        self._w = torch.zeros(total, dtype=cfg.weight_dtype, device=ctx.device)
        self._totals: dict[int, torch.Tensor] = {}  # receive buffer address -> valid rows (see select_rows)
        self.tune(kernels="triton" if ctx.device.type == "cuda" else "torch")

    def _regions(self) -> tuple[int, int]:
        """Rows of the arrival and send regions: at most every receive row arrives, at most
        every pair leaves."""
        cfg = self.ctx.cfg
        return self.ctx.capacity, cfg.max_tokens_per_rank * cfg.topk

    def alloc_rows(self, rows, width=None, dtype=None):
        t = super().alloc_rows(rows, width, dtype)
        self._totals[t.data_ptr()] = torch.zeros(2, dtype=torch.int64, device=self.ctx.device)
        return t

    def tune(self, *, kernels=None, num_ctas=None, tile_rows=None, num_warps=None, num_stages=None) -> None:
        """``kernels``: ``"triton"`` (default on CUDA) or ``"torch"`` (default on CPU, where
        Triton runs in its slow interpreter) for the pack / unpack steps. The rest as
        ``EPConfig``'s fields of those names, for the Triton kernels."""
        if kernels is not None:
            if kernels not in ("triton", "torch"):
                raise ValueError(f"kernels={kernels!r}: expected 'triton' or 'torch'")
            self._pack = (TritonPack if kernels == "triton" else TorchPack)(self._rows, self._w, self._launch)
        new = dict(num_ctas=num_ctas, rows=tile_rows, num_warps=num_warps, stages=num_stages)
        self._launch.update({key: value for key, value in new.items() if value is not None})

    def on_prepare(self, handle):
        with record_function("etp::ep_nccl_plan"):
            handle.backend_state[self.name] = plan_exchange(
                handle, self.ctx, arrival_rows=self._arrival, peer_rows=self._peer_rows,
                peer_counts=self._peer_counts)

    def _exchange(self, buf, plan, *, forward: bool) -> None:
        """The ``all_to_all_single``: send region -> peers' arrival regions (dispatch) or back."""
        (s0, s1), (r0, r1) = plan.send_range, plan.recv_range
        out, inp, out_splits, in_splits = buf[r0:r1], buf[s0:s1], plan.recv_splits, plan.send_splits
        if not forward:
            out, inp, out_splits, in_splits = inp, out, in_splits, out_splits
        with record_function("etp::ep_all_to_all_single"):
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.ctx.group)

    def dispatch(self, x, w, handle, out_x, out_w):
        plan, x = handle.backend_state[self.name], x.contiguous()
        w = None if w is None else w.contiguous().to(out_w.dtype)
        with record_function("etp::ep_nccl_pack"):
            self._pack.pack(x, w, plan, out_x, out_w)
        self._exchange(self._rows, plan, forward=True)
        if w is not None:
            self._exchange(self._w, plan, forward=True)
        with record_function("etp::ep_nccl_unpack"):
            r0, r1 = plan.recv_range
            self._pack.unpack(self._rows, plan, r0, r1, out_x)
            if w is not None:
                self._pack.unpack(self._w, plan, r0, r1, out_w)
            tokens_per_expert = handle.layout.tokens_per_expert
            self._pack.zero_tail(out_x, tokens_per_expert, self._totals[out_x.data_ptr()])
            if w is not None:
                self._pack.zero_tail(out_w, tokens_per_expert, self._totals[out_w.data_ptr()])

    def _return(self, values, buf, plan):
        """Gathers ``values``' arrival rows and sends them back."""
        with record_function("etp::ep_nccl_pack"):
            self._pack.gather(values, buf, plan, *plan.recv_range)
        self._exchange(buf, plan, forward=False)

    def combine(self, y, handle, out):
        plan, y = handle.backend_state[self.name], y.contiguous()
        self._return(y, self._rows, plan)
        with record_function("etp::ep_nccl_unpack"):
            self._pack.reduce(y, plan, out)

    def combine_pairs(self, v, handle, out):
        plan, v = handle.backend_state[self.name], v.contiguous().to(self._w.dtype)
        self._return(v, self._w, plan)
        with record_function("etp::ep_nccl_unpack"):
            self._pack.pairs(v, plan, out.view(-1))


class NcclPaddedBackend(NcclBackend):
    name = "nccl_padded"
    needs_host_layout = False

    def __init__(self, ctx):
        super().__init__(ctx)
        self._peer_rows = peer_capacity(ctx.cfg, ctx.world_size)
        counts = [0 if d == ctx.rank else self._peer_rows for d in range(ctx.world_size)]
        self._peer_counts = torch.tensor(counts, dtype=torch.int64, device=ctx.device)
        self._needed = torch.zeros((), dtype=torch.int64, device=ctx.device)  # sticky until check()

    def wire_rows(self, handle, move):
        """The padded exchange moves every peer's whole capacity."""
        return [0 if d == self.ctx.rank else self._peer_rows for d in range(self.ctx.world_size)]

    def _regions(self):
        rows = (self.ctx.world_size - 1) * peer_capacity(self.ctx.cfg, self.ctx.world_size)
        return rows, rows

    def on_prepare(self, handle):
        super().on_prepare(handle)
        torch.maximum(self._needed, handle.backend_state[self.name].needed, out=self._needed)

    def check(self, layer: str) -> None:
        needed = int(self._needed)
        self._needed.zero_()
        if needed > self._peer_rows:
            raise RuntimeError(
                f"layer {layer!r}: nccl_padded sends at most {self._peer_rows} rows to a peer, a rank needed "
                f"{needed}; the rows past it were not exchanged. Raise capacity_factor (the per-peer capacity "
                "is ceil(capacity_factor * max_tokens_per_rank * topk / world)) or use backend nccl")
