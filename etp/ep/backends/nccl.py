"""``nccl``: one ``all_to_all_single`` per move on static send / arrival buffers.

NCCL takes split sizes on the host, so this backend reads the layout's per-rank counts on
the host once per ``prepare`` (a sync; not CUDA-graph capturable). Rows are permuted into a
static send buffer (destination-major, expert order), exchanged, and permuted from the
arrival order (source-major) into the receive layout. Combine runs the same exchange
backwards: a row returns to the arrival position its pair was sent from. Runs on gloo too
(gloo's ``all_to_all_single`` has the same semantics), which is how CPU tests cover it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from etp.ep.backends.base import Backend, sum_pairs

__all__ = ["NcclBackend"]


class _Plan:
    """Host split sizes and the two permutations of one handle (built once, lazily)."""

    def __init__(self, handle, ctx):
        layout = handle.layout
        world, local = ctx.world_size, ctx.experts_per_rank
        send_per_expert = layout.send_kept
        self.send_splits = [int(n) for n in send_per_expert.reshape(world, local).sum(1).tolist()]
        self.recv_splits = [int(n) for n in layout.recv_kept.sum(1).tolist()]
        # Send position of pair: its expert's first send slot + its index j among them.
        send_start = send_per_expert.cumsum(0) - send_per_expert
        sent = layout.pair_row >= 0
        expert = handle.topk_idx.reshape(-1).clamp(0, send_start.numel() - 1)
        position = layout.pair_row - layout.send_base[expert] + send_start[expert]
        self.pairs = torch.nonzero(sent).reshape(-1)
        self.send_position = position[self.pairs]
        # Arrival order: source-major, then local expert, then j.
        kept = layout.recv_kept.reshape(-1)
        arrival_start = kept.cumsum(0) - kept
        total = int(kept.sum())
        self.arrival_row = torch.repeat_interleave(layout.recv_base.reshape(-1) - arrival_start, kept) + torch.arange(
            total, device=kept.device)
        self.total = total


class NcclBackend(Backend):
    name = "nccl"

    def __init__(self, ctx):
        super().__init__(ctx)
        max_send = ctx.cfg.max_tokens_per_rank * ctx.cfg.topk
        width = ctx.cfg.hidden_size
        # Static send / arrival buffers (rows, routing weights), sized for the largest step.
        self._send = torch.empty(max_send, width, dtype=ctx.cfg.dtype, device=ctx.device)
        self._arrive = torch.empty(ctx.capacity, width, dtype=ctx.cfg.dtype, device=ctx.device)
        self._send_w = torch.empty(max_send, dtype=ctx.cfg.weight_dtype, device=ctx.device)
        self._arrive_w = torch.empty(ctx.capacity, dtype=ctx.cfg.weight_dtype, device=ctx.device)

    def _plan(self, handle) -> _Plan:
        if handle.backend_state.get("nccl") is None:
            handle.backend_state["nccl"] = _Plan(handle, self.ctx)
        return handle.backend_state["nccl"]

    def _a2a(self, out, inp, out_splits, in_splits):
        with record_function("etp::ep_all_to_all_single"):
            dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                   group=self.ctx.group)

    def _forward(self, per_pair, send, arrive, plan, out):
        """``per_pair``: the value of every sent pair, in ``plan.pairs`` order."""
        nsend = plan.pairs.numel()
        send[:nsend].index_copy_(0, plan.send_position, per_pair)
        self._a2a(arrive[: plan.total], send[:nsend], plan.recv_splits, plan.send_splits)
        out[plan.total:].zero_()
        out.index_copy_(0, plan.arrival_row, arrive[: plan.total].to(out.dtype))

    def dispatch(self, x, w, handle, out_x, out_w):
        plan = self._plan(handle)
        self._forward(x[plan.pairs // handle.topk].to(self._send.dtype), self._send, self._arrive, plan, out_x)
        if w is not None:
            self._forward(w.reshape(-1)[plan.pairs].to(self._send_w.dtype), self._send_w, self._arrive_w, plan, out_w)

    def _backward(self, values, send, arrive, plan, handle):
        nsend = plan.pairs.numel()
        arrive[: plan.total].copy_(values[plan.arrival_row])
        self._a2a(send[:nsend], arrive[: plan.total], plan.send_splits, plan.recv_splits)
        per_pair = torch.zeros((handle.tokens * handle.topk, *values.shape[1:]), dtype=values.dtype,
                               device=values.device)
        per_pair.index_copy_(0, plan.pairs, send[plan.send_position].to(values.dtype))
        return per_pair

    def combine(self, y, handle, out):
        plan = self._plan(handle)
        per_pair = self._backward(y.to(self._send.dtype), self._send, self._arrive, plan, handle)
        sum_pairs(per_pair.reshape(handle.tokens, handle.topk, out.shape[1]), out)

    def combine_pairs(self, v, handle, out):
        plan = self._plan(handle)
        per_pair = self._backward(v.to(self._send_w.dtype), self._send_w, self._arrive_w, plan, handle)
        out.copy_(per_pair.reshape(handle.tokens, handle.topk))
