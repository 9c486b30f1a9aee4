"""Autograd Functions of ETP layers: gather the weight, GEMM, and reduce-scatter its grad.

[Note: ETP autograd contract]
Forward acquires the full weight from the runtime (prefetched or gathered on demand), runs
the GEMM and keeps only the input and the *shard* (the parameter itself, alive anyway): no
full weight survives from forward to backward. Backward acquires the weight again (the
backward chain prefetched it), writes the full weight gradient into a pooled padded buffer
(or, for GEMMs without ``out=``, hands over their result) and gives it to the runtime, which
reduce-scatters it over the ETP group (sum, divided by N for ``reduction="mean"``) on a side
stream while the input gradient's GEMM runs (it comes last for that reason), and later adds
this rank's rows into ``param.main_grad`` (megatron-core's fp32 accumulator) when it exists, else
into ``param.grad``, then fires the grad-ready hooks. The Function itself returns no
gradient for the parameter: its gradient arrives through the runtime, never through
autograd's accumulation (use ``etp.register_grad_ready_hook``, not tensor hooks).
"""
from __future__ import annotations

import torch

from .cache import Role
from .gemm import DenseGemm, GroupedGemm, attach_rowwise_fp8, row_amax
from .param import ETPShardedParam
from .runtime import engine_of

__all__ = ["etp_linear", "etp_grouped_linear"]


class _ETPWeightFunction(torch.autograd.Function):
    """``y = op(x, W)`` where ``W`` is gathered from the ETP shard ``param``."""

    @staticmethod
    def forward(ctx, x, param, op, counts, records_grad):
        # ``records_grad`` comes from the caller: grad mode is always off in here.
        weight = engine_of(param).acquire(param, Role.FWD, x.dtype, records_grad)
        y = op.forward(x, weight, counts)
        ctx.save_for_backward(x, counts)
        # The rows' amax the forward's FP8 quantization found rides on ctx too: a saved tensor
        # that backward rebuilds or recomputes comes back as a new tensor, without it.
        ctx.x_row_amax = row_amax(x)
        # The parameter rides on ctx, not in saved tensors: a non-reentrant checkpoint swaps
        # saved tensors for recomputed plain ones, which would lose the shard's ETP identity.
        ctx.param, ctx.op = param, op
        return y

    @staticmethod
    def backward(ctx, gy):
        x, counts = ctx.saved_tensors
        if ctx.x_row_amax is not None and row_amax(x) is None:
            attach_rowwise_fp8(x, None, None, ctx.x_row_amax)
        param, op = ctx.param, ctx.op
        runtime = engine_of(param)
        gy = gy.contiguous()
        # The weight first: acquiring it issues the next weight's gather, as early as before.
        weight = runtime.acquire(param, Role.BWD, gy.dtype) if ctx.needs_input_grad[0] else None
        # Then the weight gradient, before the input gradient: its reduce-scatter overlaps the
        # input-gradient GEMM as well, so the backward's last reduction does not wait for the
        # backward's last GEMM to finish before it starts.
        if ctx.needs_input_grad[1]:
            cfg = param.etp_config
            # fp8_wgrad means "with FP8 gathers, FP8 weight gradients too": a bf16 gather keeps bf16 wgrads.
            fp8_wgrad = cfg.fp8_wgrad and cfg.gather_format.fp8_gemms
            fp8 = dict(fp8=fp8_wgrad)
            if fp8_wgrad and weight is not None:
                op.quantize_ahead(gy, weight, counts)  # its rows' amax serves the FP8 wgrad, its q the dgrad
            if op.writes_into(x, gy):
                padded = runtime.wgrad_buffer(param)
                op.wgrad(gy, x, counts, out=param.etp_layout.unpad(padded), **fp8)
                runtime.reduce_grad(param, padded)
            else:
                runtime.reduce_grad(param, op.wgrad(gy, x, counts, **fp8))
        grad_x = op.dgrad(gy, weight, counts) if weight is not None else None
        return grad_x, None, None, None, None


def _apply(x, param, op, counts):
    records_grad = torch.is_grad_enabled() and param.requires_grad
    return _ETPWeightFunction.apply(x, param, op, counts, records_grad)


def etp_linear(
    x: torch.Tensor, weight: ETPShardedParam, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``torch.nn.functional.linear`` for an ETP-sharded weight.

    Example::

        y = etp_linear(x, layer.weight, layer.bias)   # layer.weight: ETPShardedParam
    """
    y = _apply(x, weight, DenseGemm, None)
    return y if bias is None else y + bias


def etp_grouped_linear(
    x: torch.Tensor, weight: ETPShardedParam, tokens_per_expert: torch.Tensor
) -> torch.Tensor:
    """Per-expert linear ``y_e = x_e @ W_e.T`` for an ETP-sharded ``[E, out, in]`` weight;
    ``x`` holds the tokens sorted by expert, ``tokens_per_expert[e]`` of them for expert e.

    Example::

        y = etp_grouped_linear(x_sorted, experts.fc1_weight, torch.tensor([5, 0, 9]))
    """
    return _apply(x, weight, GroupedGemm, tokens_per_expert)
