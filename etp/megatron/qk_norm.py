"""Full-width QK norm: an RMSNorm over the whole query and the whole key of a layer (OLMoE's),
as megatron-core ``SelfAttention``'s ``q_layernorm`` / ``k_layernorm`` submodules.

megatron-core (0.16.1 and 0.19.2 alike) builds its QK norms over one head (``hidden_size`` =
``kv_channels``, applied to ``[sq, b, heads, kv_channels]``): Qwen3's, and ``TransformerConfig``
has no other width. OLMoE normalizes the ``heads * kv_channels`` wide query (and the ``query_groups *
kv_channels`` wide key) as one vector, with one weight per channel of every head. This module
takes megatron-core's place in the layer spec, reads the same ``[sq, b, heads, kv_channels]``
tensor, normalizes it over its last two dimensions together, and holds its weight under the
same state-dict name (``q_layernorm.weight``), replicated like every norm. Tensor parallelism
would split the heads over ranks (the variance would need an all-reduce): recipes refuse it
(``qk_layernorm_width: full`` needs TP 1).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["FullWidthQKNorm", "use_full_width_qk_norm"]


class FullWidthQKNorm(torch.nn.Module):
    """RMSNorm over every head of the query (``heads="query"``) or of the key (``"key"``).

    Built by megatron-core's ``SelfAttention`` like its own QK norm: ``hidden_size`` is one
    head's width (``kv_channels``), which this module multiplies by the heads it covers.

    Example::

        spec.submodules.self_attention.submodules.q_layernorm = ModuleSpec(
            module=FullWidthQKNorm, params={"heads": "query"})
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, heads: str = "query", **_megatron_kwargs):
        super().__init__()
        if heads not in ("query", "key"):
            raise ValueError(f"FullWidthQKNorm heads={heads!r}: expected 'query' or 'key'")
        count = config.num_attention_heads if heads == "query" else config.num_query_groups
        self.head_width, self.eps = hidden_size, eps
        self.width = count * hidden_size
        self.weight = torch.nn.Parameter(torch.ones(self.width, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-2] * x.shape[-1] != self.width:
            raise ValueError(f"FullWidthQKNorm of width {self.width} got a [.., {x.shape[-2]}, {x.shape[-1]}] "
                             "input: tensor parallelism splits the heads (full-width QK norm needs TP 1)")
        flat = x.reshape(*x.shape[:-2], self.width)
        return F.rms_norm(flat, (self.width,), self.weight, self.eps).view_as(x)

    def extra_repr(self) -> str:
        return f"{self.width}, eps={self.eps}"


def use_full_width_qk_norm(spec):
    """Puts ``FullWidthQKNorm`` in place of megatron-core's QK norms in a GPT layer spec (one
    ``ModuleSpec``) or a decoder spec (``TransformerBlockSubmodules``); returns ``spec``.

    Example::

        spec = use_full_width_qk_norm(etp_gpt_decoder_spec(config, normalization="RMSNorm"))
    """
    from megatron.core.transformer.spec_utils import ModuleSpec

    layers = getattr(spec, "layer_specs", None) or [spec]
    for layer in {id(s): s for s in layers}.values():  # dense and MoE specs may be shared objects
        attention = layer.submodules.self_attention.submodules
        attention.q_layernorm = ModuleSpec(module=FullWidthQKNorm, params={"heads": "query"})
        attention.k_layernorm = ModuleSpec(module=FullWidthQKNorm, params={"heads": "key"})
    return spec
