"""ETP for megatron-core's ColumnParallelLinear / RowParallelLinear.

The plug point is the layer's ``_forward_impl`` (an instance attribute set here): megatron's
``forward`` keeps doing the tensor-parallel work around it (input copy or sequence-parallel
gather, output all-reduce or gather), and ETP replaces only the GEMM with its
gather-GEMM-reduce-scatter Function. TP and ETP compose: ETP cuts the TP-local weight.
"""
from __future__ import annotations

import functools
import sys

import torch

from ..autograd import etp_linear
from ..wrap import register_layer_types

__all__ = ["megatron_linear_types", "install_forward_impl"]


def megatron_linear_types() -> tuple[type, ...]:
    """megatron-core's TP linear classes, or () when megatron-core was never imported (then
    no model can hold them, and importing it would cost seconds for nothing)."""
    layers = sys.modules.get("megatron.core.tensor_parallel.layers")
    if layers is None:
        return ()
    return (layers.ColumnParallelLinear, layers.RowParallelLinear)


def _etp_forward_impl(
    module: torch.nn.Module,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    gradient_accumulation_fusion: bool = False,
    allreduce_dgrad: bool = False,
    sequence_parallel: bool = False,
    grad_output_buffer=None,
    wgrad_deferral_limit=None,
    tp_group=None,
    **_unused,
) -> torch.Tensor:
    # Same signature as megatron's linear_with_grad_accumulation_and_async_allreduce; the
    # TP collectives it would fuse into its Function are applied around ours instead, with
    # megatron's own autograd mappings (same math, no custom CUDA extension needed).
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    if grad_output_buffer is not None:
        raise ValueError(
            "defer_embedding_wgrad_compute is not supported on ETP-sharded layers: set "
            "config.defer_embedding_wgrad_compute=False"
        )
    tp_group = tp_group if tp_group is not None else getattr(module, "tp_group", None)
    if sequence_parallel:
        input = gather_from_sequence_parallel_region(input, group=tp_group)
    elif allreduce_dgrad:
        input = copy_to_tensor_model_parallel_region(input, group=tp_group)
    return etp_linear(input, weight, bias)


def install_forward_impl(module: torch.nn.Module) -> None:
    """Points ``module._forward_impl`` at the ETP GEMM; the original is kept as
    ``module._forward_impl.__wrapped__``."""
    original = module._forward_impl
    impl = functools.partial(_etp_forward_impl, module)
    impl.__wrapped__ = original  # type: ignore[attr-defined]
    module._forward_impl = impl


register_layer_types(megatron_linear_types, ("weight",), install_forward_impl)
