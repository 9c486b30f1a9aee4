"""The pack / unpack steps of the ``nccl`` backends, two ways: Triton kernels (GPU) and torch
indexing (CPU tensors, where the Triton interpreter would be far too slow to train with).

Both implement the same five steps on the same maps (see [Note: exchange layout] in
``etp.ep.backends.exchange``) and the same arithmetic: rows are copied, a token's K rows are
summed one k at a time in fp32 (fp64 for fp64 rows on the torch side, as ``sum_pairs``).
The Triton side is checked against the pure-torch references of ``etp.kernels.ep_reference``
(``tests/kernels/test_ep_kernels.py``), both against the float64 model of a MoE layer
(``tests/ep/``).
"""
from __future__ import annotations

import torch

from etp.ep.backends.base import sum_pairs
from etp.kernels import ep_move as km
from etp.kernels.ep_pack import copy_rows

__all__ = ["TritonPack", "TorchPack"]


class TritonPack:
    """Pack / unpack as Triton kernels over two-entry pointer tables: the exchange buffer,
    and this rank's receive rows (dispatch) or ``expert_out`` (combine), where the rows of
    pairs to local experts are. ``launch``: the kernels' launch options (shared, live)."""

    def __init__(self, rows: torch.Tensor, w: torch.Tensor, launch: dict):
        self.rows, self.w, self.launch = rows, w, launch
        device = rows.device
        # The second address is set per combine: a kernel argument, as any tensor's address is.
        self._y_table = torch.tensor([rows.data_ptr(), 0], dtype=torch.int64, device=device)
        self._v_table = torch.tensor([w.data_ptr(), 0], dtype=torch.int64, device=device)
        self._tables: dict[tuple, torch.Tensor] = {}

    def _table(self, exchange, out):
        key = (exchange.data_ptr(), out.data_ptr())
        if key not in self._tables:  # built once per receive buffer
            self._tables[key] = km.table_of([exchange, out], exchange.device)
        return self._tables[key]

    def pack(self, x, w, plan, out_x, out_w):
        km.push_rows(x, w, plan.pair_row, plan.pair_where, self._table(self.rows, out_x),
                     None if w is None else self._table(self.w, out_w), mode=km.X_ROWS, **self.launch)

    def unpack(self, buf, plan, r0, r1, out):
        copy_rows(buf, plan.arrival_row, out, r0, r1, scatter=True, **self.launch)

    def zero_tail(self, out, tokens_per_expert, totals):
        km.zero_tail(out.view(out.shape[0], -1), tokens_per_expert, totals, **self.launch)

    def gather(self, values, buf, plan, r0, r1):
        copy_rows(values, plan.arrival_row, buf, r0, r1, scatter=False, **self.launch)

    def reduce(self, y, plan, out):
        self._y_table[1:].fill_(_aligned(y, "expert_out").data_ptr())
        km.pull_reduce(self._y_table, plan.pair_row, plan.pair_where, out, **self.launch)

    def pairs(self, v, plan, out):
        self._v_table[1:].fill_(v.data_ptr())
        km.pull_pairs(self._v_table, plan.pair_row, plan.pair_where, out, **self.launch)


class TorchPack:
    """The same steps with torch indexing (allocates temporaries; for CPU tensors)."""

    def __init__(self, rows: torch.Tensor, w: torch.Tensor, launch: dict):
        self.rows, self.w = rows, w

    @staticmethod
    def _scatter_pairs(values, plan, exchange, out, topk):
        for where, dst in ((0, exchange), (1, out)):
            pairs = torch.nonzero((plan.pair_row >= 0) & (plan.pair_where == where)).reshape(-1)
            dst[plan.pair_row[pairs]] = values[pairs // topk] if topk else values.reshape(-1)[pairs]

    def pack(self, x, w, plan, out_x, out_w):
        if not x.shape[0]:
            return
        topk = plan.pair_row.numel() // x.shape[0]
        self._scatter_pairs(x, plan, self.rows, out_x, topk)
        if w is not None:
            self._scatter_pairs(w, plan, self.w, out_w, 0)

    def unpack(self, buf, plan, r0, r1, out):
        i = torch.arange(r0, r1, device=buf.device)
        i = i[plan.arrival_row[r0:r1] >= 0]
        out[plan.arrival_row[i]] = buf[i]

    def zero_tail(self, out, tokens_per_expert, totals):
        total, previous = int(tokens_per_expert.sum()), int(totals[0])
        out[total:max(total, previous)] = 0
        totals[0] = total

    def gather(self, values, buf, plan, r0, r1):
        i = torch.arange(r0, r1, device=buf.device)
        i = i[plan.arrival_row[r0:r1] >= 0]
        buf[i] = values[plan.arrival_row[i]]

    def _per_pair(self, exchange, values, plan):
        shape = (plan.pair_row.numel(), *values.shape[1:])
        per_pair = torch.zeros(shape, dtype=values.dtype, device=values.device)
        for where, src in ((0, exchange), (1, values)):
            pairs = torch.nonzero((plan.pair_row >= 0) & (plan.pair_where == where)).reshape(-1)
            per_pair[pairs] = src[plan.pair_row[pairs]]
        return per_pair

    def reduce(self, y, plan, out):
        if out.shape[0]:
            per_pair = self._per_pair(self.rows, y, plan)
            sum_pairs(per_pair.view(out.shape[0], -1, out.shape[1]), out)

    def pairs(self, v, plan, out):
        out.copy_(self._per_pair(self.w, v, plan))


def _aligned(t, name):
    # pull_reduce is told that every row start of its tables is 16-byte aligned (when a row
    # is a multiple of 16 bytes); a tensor is, unless it is a view at an odd offset.
    if t.shape[-1] * t.element_size() % 16 == 0 and t.data_ptr() % 16:
        raise ValueError(f"{name}: starts at an address that is not 16-byte aligned (a view at an offset); "
                         "pass a tensor of its own (.clone())")
    return t
