"""The within-host step of the ``hierarchical`` backend: rows to the ranks of this host, and
sums of rows back from them, two ways.

Each *source* is rows (``[N, H]``), their routing weights (``[N, K]`` or None) and per pair
``(row, local rank)`` (``[N*K]`` each, row -1: the pair does not go to this host). ``push``
writes row n to row ``row[n*K + k]`` of host rank ``local_rank[...]``'s receive buffer;
``reduce`` sums, per source row, the rows its pairs point at (fp32 in k order, fp64 for
fp64 rows); ``pairs`` reads one value per pair.

* ``SymmIntra``: symmetric memory over the host group (GPU, NVLink): the move kernels of
  ``etp.kernels.ep_move`` (push, pull-reduce), fenced by barriers, as ``symm_push``.
* ``GlooIntra``: ``all_to_all_single`` over the host group with the rows' receive indices
  beside them (any process group, CPU included: the tests' hosts).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from etp.ep.backends.base import sum_pairs
from etp.kernels import ep_move as km

__all__ = ["GlooIntra", "SymmIntra"]


class SymmIntra:
    """Within-host moves over symmetric memory (``ctx``: the host group's context)."""

    def __init__(self, ctx):
        from etp.ep.backends.symm import _SymmBackend

        self.symm = _SymmBackend(ctx)  # the buffers, tables, barriers and row selection of every symm backend

    def alloc_rows(self, rows, width=None, dtype=None):
        return self.symm.alloc_rows(rows, width, dtype)

    def push(self, sources, out_x, out_w, tokens_per_expert):
        symm = self.symm
        symm._barrier()
        with record_function("etp::ep_hier_intra_push"):
            for rows, w, row, rank in sources:
                km.push_rows(rows, w, row, rank, symm._table(out_x), None if w is None else symm._table(out_w),
                             mode=km.X_ROWS, **symm._launch)
        symm._barrier()
        symm._select(out_x, None, out_x, tokens_per_expert, identity=True, zero_only=True)
        if out_w is not None:
            symm._select(out_w, None, out_w, tokens_per_expert, identity=True, zero_only=True)

    def _pull(self, values, stage, sources, tokens_per_expert, kernel):
        symm = self.symm
        symm._barrier()
        table = symm._staged(values.contiguous(), stage, tokens_per_expert)
        symm._barrier()
        for row, rank, out in sources:
            kernel(table, row, rank, out, **symm._launch)

    def reduce(self, y, sources, tokens_per_expert):
        with record_function("etp::ep_hier_intra_pull_reduce"):
            self._pull(y, self.symm._stage, sources, tokens_per_expert, km.pull_reduce)

    def pairs(self, v, sources, tokens_per_expert):
        with record_function("etp::ep_hier_intra_pull_pairs"):
            self._pull(v, self.symm._stage_w, sources, tokens_per_expert, km.pull_pairs)


class GlooIntra:
    """Within-host moves by ``all_to_all_single`` over the host group (any backend)."""

    def __init__(self, ctx):
        self.ctx, self.topk = ctx, ctx.cfg.topk

    def alloc_rows(self, rows, width=None, dtype=None):
        shape = (rows,) if width is None else (rows, width)
        return torch.zeros(shape, dtype=dtype or self.ctx.cfg.dtype, device=self.ctx.device)

    def _exchange(self, send, send_counts, recv_counts):
        recv = send.new_empty((sum(recv_counts), *send.shape[1:]))
        with record_function("etp::ep_hier_intra_all_to_all"):
            dist.all_to_all_single(recv, send, recv_counts, send_counts, group=self.ctx.group)
        return recv

    def _route(self, row, rank):
        """The sent pairs of the concatenated sources, by destination, and the counts each
        way (host lists)."""
        sent = torch.nonzero(row >= 0).reshape(-1)
        dest = rank[sent]
        pairs = sent[torch.argsort(dest, stable=True)]
        counts = torch.bincount(dest, minlength=self.ctx.world_size)
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.ctx.group)
        return pairs, counts.tolist(), recv.tolist()

    def push(self, sources, out_x, out_w, tokens_per_expert):
        rows = torch.cat([src[0].to(out_x.dtype) for src in sources])
        row, rank = torch.cat([src[2] for src in sources]), torch.cat([src[3] for src in sources])
        pairs, counts, recv_counts = self._route(row, rank)
        with record_function("etp::ep_hier_intra_push"):
            where = self._exchange(row[pairs], counts, recv_counts)
            out_x.zero_()
            out_x[where] = self._exchange(rows[pairs // self.topk], counts, recv_counts)
            if out_w is not None:
                w = torch.cat([src[1].to(out_w.dtype).reshape(-1) for src in sources])
                out_w.zero_()
                out_w[where] = self._exchange(w[pairs], counts, recv_counts)

    def _per_pair(self, values, sources):
        """Per source, ``[N*K, ...]``: the value each pair's (row, local rank) points at (0 if none)."""
        row, rank = torch.cat([src[0] for src in sources]), torch.cat([src[1] for src in sources])
        pairs, counts, recv_counts = self._route(row, rank)
        asked = self._exchange(row[pairs], counts, recv_counts)
        got = self._exchange(values[asked], recv_counts, counts)  # served, back the way the requests came
        per_pair = values.new_zeros((row.numel(), *values.shape[1:]))
        per_pair[pairs] = got
        return per_pair.split([src[0].numel() for src in sources])

    def reduce(self, y, sources, tokens_per_expert):
        with record_function("etp::ep_hier_intra_pull_reduce"):
            for (_, _, out), values in zip(sources, self._per_pair(y, sources)):
                if out.shape[0]:
                    sum_pairs(values.view(out.shape[0], -1, out.shape[1]), out)

    def pairs(self, v, sources, tokens_per_expert):
        with record_function("etp::ep_hier_intra_pull_pairs"):
            for (_, _, out), values in zip(sources, self._per_pair(v, sources)):
                out.copy_(values)
