"""``SDPAttention``: megatron-core's ``core_attention`` on ``torch.nn.functional.scaled_dot_product_attention``.

megatron-core's local ``DotProductAttention`` materializes the full ``[b, heads, s, s]``
score matrix (``baddbmm`` + a torch softmax when neither apex nor TransformerEngine is
installed) and keeps it for backward: O(s^2) memory and three memory-bound passes over it.
``SDPAttention`` hands the same computation to torch's fused kernels (flash / cuDNN /
memory-efficient attention on GPUs, the math kernel on CPU), which never store the scores.

It is a drop-in ``core_attention`` submodule: same constructor and ``forward`` signature as
``DotProductAttention``, megatron's ``[s, b, heads, head_dim]`` layout in and
``[s, b, heads x head_dim]`` out, grouped-query attention from ``num_query_groups``,
megatron's boolean attention mask (True = masked out) or, with ``attn_mask_type`` causal
and no mask, torch's ``is_causal``. It holds no parameters and no buffers, like
``DotProductAttention`` with the vanilla softmax, so state dicts and checkpoints are
interchangeable between the two.

Determinism: when ``torch.are_deterministic_algorithms_enabled()`` the forward runs inside
``sdpa_kernel([FLASH_ATTENTION, EFFICIENT_ATTENTION, MATH])``: torch's flash and
memory-efficient backwards take their deterministic paths in strict deterministic mode,
cuDNN attention has none (torch excludes it in that mode; we name the allowed ones so the
choice does not depend on torch's priority list).

Example::

    spec = etp_gpt_layer_spec(num_experts=64, attention_backend="sdpa")
    # spec.submodules.self_attention.submodules.core_attention.module is SDPAttention
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch.autograd.profiler import record_function

__all__ = ["ATTENTION_BACKENDS", "SDPAttention", "sdpa_core_attention"]

#: ``attention_backend`` recipe values: ``sdpa`` (this module) or megatron-core's ``local``.
ATTENTION_BACKENDS = ("sdpa", "local")


def _megatron_module():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


def _deterministic_backends():
    """The SDPA kernels allowed in deterministic mode (a context manager)."""
    if not torch.are_deterministic_algorithms_enabled():
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def sdpa_core_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, causal: bool, scale: float,
                        dropout_p: float = 0.0) -> torch.Tensor:
    """Attention of megatron-layout tensors through ``F.scaled_dot_product_attention``.

    ``softmax(scale * Q K^T + mask) V`` per head; query heads ``g * (heads / groups) .. ``
    share key / value head ``g`` (megatron's ``repeat_interleave`` convention).

    Args:
        query: ``[sq, b, heads, d]``; key, value: ``[sk, b, groups, d]``.
        attention_mask: megatron's boolean mask broadcastable to ``[b, heads, sq, sk]``,
            True where a score is masked out (a floating mask is added to the scores); integer
            ``[b, s]`` document ids: per-document causal attention ([Note: document attention]);
            None for no mask, or the causal one when ``causal``.
        causal: apply the causal (lower-triangular) mask when ``attention_mask`` is None.
        scale: multiplies ``Q K^T`` (``1 / sqrt(d)`` by default in the module).

    Returns:
        ``[sq, b, heads * d]``.
    """
    sq, b, heads, d = query.shape
    groups = key.shape[2]
    if heads % groups:
        raise ValueError(f"query heads {heads} must be a multiple of key/value groups {groups}")
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads or groups, s, d]
    gqa = {"enable_gqa": True} if groups != heads else {}
    if attention_mask is not None and not attention_mask.is_floating_point() and attention_mask.dtype != torch.bool:
        from .document_attention import document_attention  # [Note: document attention]

        with _deterministic_backends():
            out = document_attention(q, k, v, attention_mask, scale=scale, dropout_p=dropout_p, sdpa_kwargs=gqa)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * d)
    mask = None
    if attention_mask is not None:
        mask = attention_mask.logical_not() if attention_mask.dtype == torch.bool else attention_mask.to(q.dtype)
    with _deterministic_backends():
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p,
            is_causal=causal and mask is None and sq > 1, scale=scale, **gqa)
    return out.permute(2, 0, 1, 3).reshape(sq, b, heads * d)


class SDPAttention(_megatron_module()):
    """megatron-core ``core_attention`` on torch's fused SDPA kernels. See the module docstring.

    Unsupported (ValueError at construction or call, with the setting to change): context
    parallelism, ``softmax_type`` other than vanilla, sliding windows, packed sequences,
    attention bias.

    Example::

        from megatron.core.transformer.spec_utils import ModuleSpec
        spec.submodules.self_attention.submodules.core_attention = ModuleSpec(module=SDPAttention)
    """

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None) -> None:
        super().__init__(config=config)
        if (config.context_parallel_size or 1) != 1:
            raise ValueError(f"context_parallel_size={config.context_parallel_size}: SDPAttention "
                             "has no context parallelism; use attention_backend=local or CP 1")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"softmax_type={config.softmax_type!r}: SDPAttention computes the vanilla "
                             "softmax only; use attention_backend=local")
        if getattr(config, "window_size", None) is not None:
            raise ValueError(f"window_size={config.window_size}: sliding-window attention is not in "
                             "SDPAttention; use attention_backend=local")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
        # DotProductAttention divides by layer_number when apply_query_key_layer_scaling and
        # multiplies it back inside the softmax: the net scale is the same, so it is ignored.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        from megatron.core.transformer.enums import AttnMaskType

        if packed_seq_params is not None:
            raise ValueError("packed sequences (packed_seq_params) are not supported by SDPAttention")
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by SDPAttention")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        dropout = self.dropout_p if self.training else 0.0
        if dropout > 0.0 and torch.cuda.is_available() and not self.config.sequence_parallel:
            from megatron.core import tensor_parallel

            rng = tensor_parallel.get_cuda_rng_tracker().fork()  # as DotProductAttention does
        else:
            rng = contextlib.nullcontext()
        with record_function("etp::attention"), rng:
            return sdpa_core_attention(query, key, value, attention_mask,
                                       causal=mask_type == AttnMaskType.causal,
                                       scale=self.softmax_scale, dropout_p=dropout)
