"""Autograd functions: dispatch's backward is a combine, combine's backward a dispatch."""
from __future__ import annotations

import torch

__all__ = ["DispatchFunction", "CombineFunction"]


class DispatchFunction(torch.autograd.Function):
    """(x [T, H], w [T, K]) -> (recv_x [capacity, H], recv_w [capacity])."""

    @staticmethod
    def forward(ctx, x, w, dispatcher, handle):
        ctx.dispatcher, ctx.handle = dispatcher, handle
        ctx.x_dtype, ctx.w_dtype = x.dtype, w.dtype
        return dispatcher._move_dispatch(x, w, handle, backward=False)

    @staticmethod
    def backward(ctx, grad_recv_x, grad_recv_w):
        grad_x, grad_w = ctx.dispatcher.dispatch_backward(grad_recv_x, grad_recv_w, ctx.handle)
        return grad_x.to(ctx.x_dtype), grad_w.to(ctx.w_dtype), None, None


class CombineFunction(torch.autograd.Function):
    """expert_out [capacity, H] -> out [T, H], each token the sum of its pairs' rows."""

    @staticmethod
    def forward(ctx, expert_out, dispatcher, handle):
        ctx.dispatcher, ctx.handle = dispatcher, handle
        return dispatcher._move_combine(expert_out, handle, backward=False)

    @staticmethod
    def backward(ctx, grad_out):
        grad_expert_out = ctx.dispatcher.combine_backward(grad_out, ctx.handle)
        return grad_expert_out, None, None
