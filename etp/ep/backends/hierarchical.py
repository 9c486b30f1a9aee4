"""``hierarchical``: for expert-parallel groups that span hosts. A token crosses to another
host once (over NCCL, to the rank of the same local index there: its rail peer, see [Note:
host groups] in ``etp.ep.backends.hosts``), however many of its experts live on that host;
the rail peer then hands it to the ranks of its host that hold its experts, over symmetric
memory (GPU) or ``all_to_all_single`` within the host (any other group: the CPU tests).

[Note: hierarchical moves]
Per ``prepare`` (one host sync): each token's *first* pair to each other host marks one row
to send there; the rows go host by host, in token order, with their K pairs' receive rows
and host-local ranks (-1 for pairs to other hosts), exchanged once over the rail group.
Then a rank holds two *sources* for its host: its own tokens (their pairs to this host)
and the rows relayed to it.

* dispatch: pack the rows to send (``index_select``), exchange them (and their routing
  weights) over the rail, push both sources into this host's receive buffers.
* combine: each source row's sum over its pairs on this host (fp32, k order), pulled within
  the host; the relayed rows' sums go back over the rail; each token adds its own host's
  sum and the returned ones in the order of its first pair to each host (fp32). Like
  ``symm_dedup``, partial sums per host are rounded to the row dtype.
* combine of routing weights (backward): one value per pair, pulled within the host and
  returned over the rail in the same way (exact: each pair is on one host).

Moves allocate nothing on the GPU side (static buffers, ``out=`` packing); ``prepare`` reads
split sizes on the host, so the backend is not capturable in a CUDA graph.
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from etp.ep.backends.base import Backend, first_pairs, sum_pairs
from etp.ep.backends.hosts import host_groups
from etp.ep.backends.intra import GlooIntra, SymmIntra
from etp.kernels import ep_move as km

__all__ = ["HierarchicalBackend"]


class _Plan(NamedTuple):
    send_tok: torch.Tensor  # [S] the tokens sent over the rail, host by host
    send_splits: list  # rows to each rail peer (host); 0 to this host
    recv_splits: list
    own_row: torch.Tensor  # [T*K] receive row of each pair to this host, else -1
    own_rank: torch.Tensor  # [T*K] its host-local rank
    relay_row: torch.Tensor  # [R*K] the same for the relayed rows
    relay_rank: torch.Tensor
    sum_row: torch.Tensor  # [T*K] row of the partial-sum buffer to add at this pair (first per host), else -1


class HierarchicalBackend(Backend):
    name = "hierarchical"
    needs_host_layout = True

    def __init__(self, ctx):
        super().__init__(ctx)
        groups = host_groups(ctx.group, ctx.cfg.ranks_per_host)
        if groups.hosts < 2:
            raise ValueError(f"EP backend 'hierarchical': the group of {ctx.world_size} ranks is on one host; "
                             "declare EPConfig.ranks_per_host to run it over simulated hosts")
        self.groups = groups
        intra_ctx = replace(ctx, group=groups.host_group, rank=groups.local, world_size=groups.ranks_per_host)
        from etp.ep.backends import symm_unavailable_reason

        symm = not symm_unavailable_reason(ctx.group)
        self._intra = SymmIntra(intra_ctx) if symm else GlooIntra(intra_ctx)
        self._kernels = symm  # the per-host sums: a kernel beside symmetric memory, torch beside gloo
        cfg, device = ctx.cfg, ctx.device
        T, K, H = cfg.max_tokens_per_rank, cfg.topk, cfg.hidden_size
        rows = T * (groups.hosts - 1)
        self._send = torch.zeros(rows, H, dtype=cfg.dtype, device=device)
        self._relay = torch.zeros(rows, H, dtype=cfg.dtype, device=device)
        self._send_w = torch.zeros(rows, K, dtype=cfg.weight_dtype, device=device)
        self._relay_w = torch.zeros(rows, K, dtype=cfg.weight_dtype, device=device)
        # Partial sums: this rank's own (rows [0, T)), then those the other hosts return.
        self._sums = torch.zeros(T + rows, H, dtype=cfg.dtype, device=device)
        self._own_pairs = torch.zeros(T * K, dtype=cfg.weight_dtype, device=device)
        self._sums_table = km.table_of([self._sums], device)
        self._zeros = torch.zeros(T * K, dtype=torch.int64, device=device)

    def alloc_rows(self, rows, width=None, dtype=None):
        return self._intra.alloc_rows(rows, width, dtype)

    def _rail(self, out, inp, out_splits, in_splits):
        with record_function("etp::ep_hier_rail_all_to_all"):
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.groups.rail_group)

    def on_prepare(self, handle):
        with record_function("etp::ep_hier_plan"):
            handle.backend_state[self.name] = self._plan(handle)

    def _plan(self, handle) -> _Plan:
        lay, g = handle.layout, self.groups
        T, K, t_max = handle.tokens, handle.topk, self.ctx.cfg.max_tokens_per_rank
        sent = (lay.pair_row >= 0).view(T, K)
        host = torch.where(sent, lay.pair_rank.view(T, K) // g.ranks_per_host, -1)
        first = first_pairs(host, sent)
        away = (first & (host != g.host)).reshape(-1)
        pairs = torch.nonzero(away).reshape(-1)
        to_host = host.reshape(-1)[pairs]
        order = torch.argsort(to_host * max(T, 1) + pairs // K, stable=True)
        pairs, to_host = pairs[order], to_host[order]
        send_tok = pairs // K
        counts = torch.bincount(to_host, minlength=g.hosts)
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=g.rail_group)
        send_splits, recv_splits = counts.tolist(), recv.tolist()  # the one host sync
        local_rank = lay.pair_rank.view(T, K) % g.ranks_per_host
        meta = torch.cat([torch.where(host[send_tok] == to_host[:, None], lay.pair_row.view(T, K)[send_tok], -1),
                          local_rank[send_tok]], dim=1)
        relay = meta.new_empty((sum(recv_splits), 2 * K))
        self._rail(relay, meta, recv_splits, send_splits)
        mine = host == g.host
        position = torch.full((T * K,), -1, dtype=torch.int64, device=host.device)
        position[pairs] = torch.arange(pairs.numel(), device=host.device)
        token = torch.arange(T, device=host.device)[:, None].expand(T, K).reshape(-1)
        sum_row = torch.where((first & mine).reshape(-1), token, torch.where(away, t_max + position, -1))
        return _Plan(send_tok, send_splits, recv_splits, torch.where(mine, lay.pair_row.view(T, K), -1).reshape(-1),
                     local_rank.reshape(-1), relay[:, :K].reshape(-1), relay[:, K:].reshape(-1), sum_row)

    def wire_rows(self, handle, move):
        """Rows to each rail peer (one per token and host), plus the pairs pushed to the other
        ranks of this host (of this rank's tokens and of those relayed to it); the same both ways."""
        plan, g = handle.backend_state[self.name], self.groups
        counts = [0] * self.ctx.world_size
        for host, n in enumerate(plan.send_splits):
            counts[host * g.ranks_per_host + g.local] += n
        for row, rank in ((plan.own_row, plan.own_rank), (plan.relay_row, plan.relay_rank)):
            for local, n in enumerate(torch.bincount(rank[row >= 0], minlength=g.ranks_per_host).tolist()):
                if local != g.local:
                    counts[g.host * g.ranks_per_host + local] += n
        return counts

    def dispatch(self, x, w, handle, out_x, out_w):
        plan = handle.backend_state[self.name]
        S, R = plan.send_tok.numel(), sum(plan.recv_splits)
        with record_function("etp::ep_hier_pack"):
            torch.index_select(x, 0, plan.send_tok, out=self._send[:S])
            if w is not None:
                w = w.to(out_w.dtype)
                torch.index_select(w, 0, plan.send_tok, out=self._send_w[:S])
        self._rail(self._relay[:R], self._send[:S], plan.recv_splits, plan.send_splits)
        if w is not None:
            self._rail(self._relay_w[:R], self._send_w[:S], plan.recv_splits, plan.send_splits)
        sources = [(x.contiguous(), w, plan.own_row, plan.own_rank),
                   (self._relay[:R], None if w is None else self._relay_w[:R], plan.relay_row, plan.relay_rank)]
        self._intra.push(sources, out_x, out_w, handle.layout.tokens_per_expert)

    def combine(self, y, handle, out):
        plan, T, t_max = handle.backend_state[self.name], handle.tokens, self.ctx.cfg.max_tokens_per_rank
        S, R = plan.send_tok.numel(), sum(plan.recv_splits)
        self._intra.reduce(y, [(plan.own_row, plan.own_rank, self._sums[:T]),
                               (plan.relay_row, plan.relay_rank, self._relay[:R])], handle.layout.tokens_per_expert)
        self._rail(self._sums[t_max:t_max + S], self._relay[:R], plan.send_splits, plan.recv_splits)
        with record_function("etp::ep_hier_sum_hosts"):
            if self._kernels:
                km.pull_reduce(self._sums_table, plan.sum_row, self._zeros[:plan.sum_row.numel()], out)
            elif T:
                per_pair = torch.where((plan.sum_row >= 0)[:, None], self._sums[plan.sum_row.clamp(min=0)], 0)
                sum_pairs(per_pair.view(T, -1, out.shape[1]), out)

    def combine_pairs(self, v, handle, out):
        plan, T, K = handle.backend_state[self.name], handle.tokens, handle.topk
        S, R = plan.send_tok.numel(), sum(plan.recv_splits)
        v = v.contiguous().to(self._own_pairs.dtype)
        self._intra.pairs(v, [(plan.own_row, plan.own_rank, self._own_pairs[:T * K]),
                              (plan.relay_row, plan.relay_rank, self._relay_w[:R].view(-1))],
                          handle.layout.tokens_per_expert)
        self._rail(self._send_w[:S], self._relay_w[:R], plan.send_splits, plan.recv_splits)
        out.copy_(self._own_pairs[:T * K].view(T, K))
        out.index_add_(0, plan.send_tok, self._send_w[:S].to(out.dtype))  # each pair is non-zero on one host
