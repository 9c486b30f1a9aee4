"""etp's fused RoPE (``etp.kernels.rope``) in megatron-core's attention, where megatron-core
without TransformerEngine runs its unfused RoPE.

[Note: RoPE in megatron-core]
``megatron.core.transformer.attention`` applies ``apply_rotary_pos_emb`` to the query and the
key of every layer; without TE (``apply_rope_fusion`` needs it) that is
``_apply_rotary_pos_emb_bshd``: about ten kernels a call, each a pass over the activations,
forward and backward. ``etp.megatron.patches.use_fused_rope(True)`` binds ``apply_rotary_pos_emb`` in that module to
``fused_apply_rotary_pos_emb``, which takes the cases ``etp.kernels.rope`` covers (activations
in ``[s, b, h, d]``, no packed sequences, halves not interleaved, no latent
attention) and hands every other call to megatron-core's own function unchanged. The result is
the same bits ([Note: fused RoPE]): it is the model's arithmetic, not a choice of sharding, so
etp-train installs it for every system it runs, peers included (``megatron_fallbacks: fast``;
``stock`` leaves megatron-core's).

Example::

    from etp.megatron import patches
    patches.use_fused_rope(True)   # before the model's first forward
"""
from __future__ import annotations

import torch

from ..kernels.rope import rope
from ..version_cache import per_version

__all__ = ["fused_apply_rotary_pos_emb"]

def _megatrons():
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    return apply_rotary_pos_emb


def _covered(t, freqs, config, cu_seqlens) -> bool:
    return (cu_seqlens is None and t.dim() == 4 and freqs.dim() == 4
            and t.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and tuple(freqs.shape[1:3]) == (1, 1) and freqs.shape[0] == t.shape[0]
            and not getattr(config, "apply_rope_fusion", False)
            and not getattr(config, "rotary_interleaved", False)
            and not getattr(config, "multi_latent_attention", False))


def fused_apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale: float = 1.0, cp_group=None):
    """megatron-core's ``apply_rotary_pos_emb`` (same arguments, same result), one fused pass
    each way where ``etp.kernels.rope`` covers the call ([Note: RoPE in megatron-core])."""
    if not _covered(t, freqs, config, cu_seqlens):
        return _megatrons()(t, freqs, config=config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
    # megatron-core's rounding of the tables: cos / sin in float32, scaled, then the activations'
    # dtype. megatron's rotary embedding is lru-cached, so one freqs tensor serves the query and
    # key of every layer, every step: the tables are made once on it, not twice per layer.
    cos, sin = per_version(freqs, ("rope_tables", t.dtype, mscale), lambda: (
        (torch.cos(freqs) * mscale).to(t.dtype), (torch.sin(freqs) * mscale).to(t.dtype)))
    return rope(t, cos, sin)
