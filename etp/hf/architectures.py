"""The architectures etp-convert converts, by ``config.json``'s ``model_type``, and the ones it
refuses with the reason."""
from __future__ import annotations

from etp.hf.adapter import ConversionError, MoEAdapter
from etp.hf.mixtral import MixtralAdapter
from etp.hf.olmoe import OlmoeAdapter
from etp.hf.qwen3_moe import Qwen3MoeAdapter

__all__ = ["ADAPTERS", "REFUSED", "adapter_for"]

ADAPTERS: dict[str, type[MoEAdapter]] = {a.model_type: a for a in (Qwen3MoeAdapter, OlmoeAdapter, MixtralAdapter)}

#: model_type -> why etp-convert refuses it
REFUSED = {
    "deepseek_v3": "DeepSeek-V3's multi-latent attention needs megatron-core's MLASelfAttention, which 0.16 builds "
                   "only with TransformerEngine (its core attention takes k_channels / v_channels, which the local "
                   "DotProductAttention does not; docs/architectures.md)",
}
REFUSED["deepseek_v2"] = REFUSED["deepseek_v3"].replace("DeepSeek-V3", "DeepSeek-V2")


def adapter_for(model_type: str, where: str = "config.json") -> MoEAdapter:
    """The adapter of ``model_type``; ``ConversionError`` (one line, with what etp converts) otherwise.

    Example::

        adapter_for("qwen3_moe").architecture   # 'Qwen3MoeForCausalLM'
    """
    if model_type in REFUSED:
        raise ConversionError(f"{where}: model_type {model_type!r} is not supported: {REFUSED[model_type]}")
    if model_type not in ADAPTERS:
        raise ConversionError(f"{where}: model_type {model_type!r} is not one etp-convert converts (it converts "
                              f"{', '.join(sorted(ADAPTERS))})")
    return ADAPTERS[model_type]()
