"""``reference``: pure torch + ``torch.distributed.all_to_all_single`` of per-destination lists.

The CPU truth (runs on gloo): each pair's row travels with its data, so the receiver needs
nothing but the rows it is sent. Allocates and reads split sizes on the host every step.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from etp.ep.backends.base import Backend, sum_pairs

__all__ = ["ReferenceBackend"]


def _pairs_to(handle, dest: int) -> torch.Tensor:
    """Flat pair indices sent to ``dest``, in increasing receive row."""
    layout = handle.layout
    pairs = torch.nonzero(layout.pair_rank == dest).reshape(-1)
    return pairs[torch.argsort(layout.pair_row[pairs])]


def _rows_from(handle, src: int) -> torch.Tensor:
    """Receive rows holding ``src``'s pairs, increasing."""
    layout = handle.layout
    base, kept = layout.recv_base[src].tolist(), layout.recv_kept[src].tolist()
    parts = [torch.arange(b, b + n, device=layout.pair_row.device) for b, n in zip(base, kept)]
    return torch.cat(parts)


class ReferenceBackend(Backend):
    name = "reference"

    def _exchange(self, send: list[torch.Tensor], recv_rows: list[int], tail: tuple, dtype) -> list:
        # gloo's list all_to_all needs equal sizes: concatenate and split instead.
        recv = torch.empty((sum(recv_rows), *tail), dtype=dtype, device=self.ctx.device)
        with record_function("etp::ep_all_to_all"):
            dist.all_to_all_single(recv, torch.cat(send), output_split_sizes=recv_rows,
                                   input_split_sizes=[s.shape[0] for s in send], group=self.ctx.group)
        return list(recv.split(recv_rows))

    def dispatch(self, x, w, handle, out_x, out_w):
        world, k = self.ctx.world_size, handle.topk
        pairs = [_pairs_to(handle, d) for d in range(world)]
        recv_counts = [int(n) for n in handle.layout.recv_kept.sum(1).tolist()]
        hidden = x.shape[1:]
        rows = self._exchange([handle.layout.pair_row[p] for p in pairs], recv_counts, (), torch.int64)
        data = self._exchange([x[p // k] for p in pairs], recv_counts, hidden, x.dtype)
        out_x.zero_()
        out_x.index_copy_(0, torch.cat(rows), torch.cat(data).to(out_x.dtype))
        if w is not None:
            weights = self._exchange([w.reshape(-1)[p] for p in pairs], recv_counts, (), w.dtype)
            out_w.zero_()
            out_w.index_copy_(0, torch.cat(rows), torch.cat(weights).to(out_w.dtype))

    def _return(self, values: torch.Tensor, handle) -> torch.Tensor:
        """Per pair [T*K, ...]: the value at its (rank, row), zero for pairs not sent."""
        world = self.ctx.world_size
        pairs = [_pairs_to(handle, d) for d in range(world)]
        rows = [_rows_from(handle, s) for s in range(world)]
        back = self._exchange([values[r] for r in rows], [p.numel() for p in pairs], values.shape[1:], values.dtype)
        per_pair = torch.zeros((handle.layout.pair_row.numel(), *values.shape[1:]), dtype=values.dtype,
                               device=values.device)
        per_pair.index_copy_(0, torch.cat(pairs), torch.cat(back))
        return per_pair

    def combine(self, y, handle, out):
        per_pair = self._return(y, handle)
        sum_pairs(per_pair.reshape(handle.tokens, handle.topk, out.shape[1]), out)

    def combine_pairs(self, v, handle, out):
        out.copy_(self._return(v, handle).reshape(handle.tokens, handle.topk))
