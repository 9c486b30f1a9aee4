"""Autograd Functions of ETP layers: gather the weight, GEMM, and reduce-scatter its grad.

[Note: ETP autograd contract]
Forward gathers the full weight, runs the GEMM and saves only the input and the *shard*
(the parameter itself, which is alive anyway): no full weight survives from forward to
backward. Backward gathers the weight again, computes the input gradient and the full
weight gradient into a padded buffer, reduce-scatters it over the ETP group (sum, divided by
N for ``reduction="mean"``) and delivers this rank's rows:

* into ``param.main_grad`` (added, in its dtype, normally fp32) when the parameter has one,
  the megatron-core convention; ``param.grad_added_to_main_grad`` is set when present and a
  zero placeholder gradient is returned so that DDP's grad-accumulation hook still fires;
* otherwise as the parameter's autograd gradient (accumulated into ``param.grad``).
"""
from __future__ import annotations

import torch

from .collectives import all_gather_rows, reduce_scatter_rows
from .gemm import DenseGemm, GroupedGemm
from .param import ETPShardedParam

__all__ = ["etp_linear", "etp_grouped_linear", "gather_full_weight", "reduce_weight_grad"]


def gather_full_weight(param: ETPShardedParam, compute_dtype: torch.dtype) -> torch.Tensor:
    """All-gathers ``param`` in its gather dtype and returns the logical weight in
    ``compute_dtype`` (a view of the gathered buffer when no cast is needed)."""
    wire_dtype = param.etp_config.gather_torch_dtype or param.dtype
    shard = param.detach()
    if shard.dtype != wire_dtype:
        shard = shard.to(wire_dtype)
    gathered, _ = all_gather_rows(shard, param.etp_group)
    weight = param.etp_layout.unpad(gathered)
    return weight if weight.dtype == compute_dtype else weight.to(compute_dtype)


def _grad_dtype(param: ETPShardedParam) -> torch.dtype:
    main_grad = getattr(param, "main_grad", None)
    return main_grad.dtype if main_grad is not None else param.dtype


def reduce_weight_grad(param: ETPShardedParam, full_wgrad: torch.Tensor) -> torch.Tensor | None:
    """Reduce-scatters a full logical weight gradient and delivers this rank's shard.

    Returns what the autograd Function must return for the parameter. See
    [Note: ETP autograd contract].
    """
    layout = param.etp_layout
    reduce_dtype = _grad_dtype(param)
    padded = torch.empty(layout.padded_shape, dtype=reduce_dtype, device=full_wgrad.device)
    padded[layout.rows :].zero_()  # structural padding: nothing is ever written there
    layout.unpad(padded).copy_(full_wgrad)
    shard_grad, _ = reduce_scatter_rows(padded, param.etp_group)
    if param.etp_config.reduction == "mean":
        shard_grad.div_(param.etp_group.size)
    main_grad = getattr(param, "main_grad", None)
    if main_grad is None:
        return shard_grad.to(param.dtype)
    main_grad.add_(shard_grad)
    if hasattr(param, "grad_added_to_main_grad"):
        param.grad_added_to_main_grad = True
        return torch.zeros_like(param)
    return None


class _ETPWeightFunction(torch.autograd.Function):
    """``y = op(x, W)`` where ``W`` is gathered from the ETP shard ``param``."""

    @staticmethod
    def forward(ctx, x, param, op, counts):
        weight = gather_full_weight(param, x.dtype)
        y = op.forward(x, weight, counts)
        ctx.save_for_backward(x, param, counts)
        ctx.op = op
        return y

    @staticmethod
    def backward(ctx, gy):
        x, param, counts = ctx.saved_tensors
        op = ctx.op
        gy = gy.contiguous()
        grad_x = grad_param = None
        if ctx.needs_input_grad[0]:
            grad_x = op.dgrad(gy, gather_full_weight(param, gy.dtype), counts)
        if ctx.needs_input_grad[1]:
            grad_param = reduce_weight_grad(param, op.wgrad(gy, x, counts))
        return grad_x, grad_param, None, None


def etp_linear(
    x: torch.Tensor, weight: ETPShardedParam, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``torch.nn.functional.linear`` for an ETP-sharded weight.

    Example::

        y = etp_linear(x, layer.weight, layer.bias)   # layer.weight: ETPShardedParam
    """
    y = _ETPWeightFunction.apply(x, weight, DenseGemm, None)
    return y if bias is None else y + bias


def etp_grouped_linear(
    x: torch.Tensor, weight: ETPShardedParam, tokens_per_expert: torch.Tensor
) -> torch.Tensor:
    """Per-expert linear ``y_e = x_e @ W_e.T`` for an ETP-sharded ``[E, out, in]`` weight;
    ``x`` holds the tokens sorted by expert, ``tokens_per_expert[e]`` of them for expert e."""
    return _ETPWeightFunction.apply(x, weight, GroupedGemm, tokens_per_expert)
