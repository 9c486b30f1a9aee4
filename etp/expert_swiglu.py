"""The routed experts' SwiGLU as one autograd op (``etp.kernels.swiglu`` forward and backward).

With ``quantize=True`` the forward also hands the rowwise FP8 quantization of its output to
fc2's FP8 GEMM, and the backward that of its input gradient to fc1's input-gradient GEMM
(see [Note: FP8 operands handed over] in ``etp.gemm``): one pass over each activation
instead of an activation pass plus a quantization pass.
"""
from __future__ import annotations

import torch

from .gemm import attach_rowwise_fp8
from .kernels import swiglu as swiglu_kernel
from .kernels import swiglu_backward

__all__ = ["expert_swiglu", "expert_swiglu_output"]


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, probs, quantize, valid_rows):
        amax = gate_up.new_empty(gate_up.shape[0], dtype=torch.float32) if quantize else None
        h, q, scale_inv = swiglu_kernel(gate_up, probs, quantize=quantize, amax_out=amax, valid_rows=valid_rows)
        ctx.save_for_backward(gate_up, probs, valid_rows)
        ctx.quantize = quantize
        return attach_rowwise_fp8(h, q, scale_inv, amax) if quantize else h

    @staticmethod
    def backward(ctx, grad_h):
        gate_up, probs, valid_rows = ctx.saved_tensors
        probs_grad = probs is not None and ctx.needs_input_grad[1]
        amax = gate_up.new_empty(gate_up.shape[0], dtype=torch.float32) if ctx.quantize else None
        grad_gate_up, grad_probs, q, scale_inv = swiglu_backward(
            gate_up, grad_h, probs, probs_grad=probs_grad, quantize=ctx.quantize, amax_out=amax,
            valid_rows=valid_rows)
        if q is not None:
            attach_rowwise_fp8(grad_gate_up, q, scale_inv, amax)
        return grad_gate_up, grad_probs, None, None


def expert_swiglu(gate_up: torch.Tensor, probs: torch.Tensor | None = None, quantize: bool = False,
           valid_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` (times ``probs[:, None]``) of ``gate_up [T, 2 * ffn]`` (gate columns
    first), differentiable in ``gate_up`` and ``probs``; one fused kernel each way on CUDA.
    ``quantize``: the next GEMMs run in FP8 (see the module docstring). ``valid_rows``: a
    one-element device tensor; both directions compute only the rows below it (a padded
    buffer: [Note: valid rows] in ``etp.kernels.blockwise``).

    Example::

        h = expert_swiglu(x @ w1.t())           # [T, ffn]
    """
    return _SwiGLUFunction.apply(gate_up.contiguous(), probs, quantize, valid_rows)


def expert_swiglu_output(gate_up: torch.Tensor, probs: torch.Tensor | None = None,
                  valid_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``swiglu``'s output alone, not differentiable: the same kernel and the same bits, what
    backward rebuilds fc2's input with ([Note: rebuilt activations] in ``etp.rebuilt_activations``).

    Example::

        h = expert_swiglu_output(gate_up, probs)   # equal to expert_swiglu(gate_up, probs) bit for bit
    """
    return swiglu_kernel(gate_up.contiguous(), probs, quantize=False, valid_rows=valid_rows)[0]
