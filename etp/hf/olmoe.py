"""OLMoE (``OlmoeForCausalLM``, ``model_type: olmoe``; allenai/OLMoE-1B-7B): QK norm over the
whole query and key (``qk_layernorm_width: full``), the top-k of the full softmax
(``norm_topk_prob`` false) or renormalized."""
from __future__ import annotations

from etp.hf.adapter import HFConfig, MoEAdapter

__all__ = ["OlmoeAdapter"]


class OlmoeAdapter(MoEAdapter):
    """OLMoE ↔ etp: names as ``MoEAdapter``'s; ``self_attn.q_norm`` is ``[heads x head_dim]``
    and ``k_norm`` ``[kv_heads x head_dim]`` (etp.megatron.qk_norm.FullWidthQKNorm).

    Example::

        OlmoeAdapter().recipe_model_keys(HFConfig(config, "config.json"))["qk_layernorm_width"]   # 'full'
    """

    model_type = "olmoe"
    architecture = "OlmoeForCausalLM"

    def recipe_model_keys(self, cfg: HFConfig) -> dict:
        if cfg.get("clip_qkv") is not None:
            cfg.refuse("clip_qkv", cfg.get("clip_qkv"), "etp does not clamp queries, keys and values: convert a "
                       "checkpoint with clip_qkv null")
        heads, hidden = cfg.require("num_attention_heads"), cfg.require("hidden_size")
        if cfg.get("head_dim", hidden // heads) * heads != hidden:
            cfg.refuse("head_dim", cfg.get("head_dim"), f"OLMoE's q_norm is hidden_size={hidden} wide, so its heads "
                       f"are hidden_size / num_attention_heads = {hidden // heads} wide")
        keys = self.common_keys(cfg, cfg.require("num_experts"), cfg.require("intermediate_size"))
        keys.update(qk_layernorm=True, qk_layernorm_width="full",
                    moe_router_pre_softmax=not cfg.get("norm_topk_prob", False))
        return keys

    def config_values(self, m) -> dict:
        return dict(num_experts=m.num_experts, intermediate_size=m.moe_ffn_hidden_size,
                    norm_topk_prob=not m.moe_router_pre_softmax, clip_qkv=None)

    def config_json(self, m, base: dict | None, dtype: str) -> dict:
        out = super().config_json(m, base, dtype)
        out.pop("head_dim")  # OLMoE's heads are hidden_size / num_attention_heads wide; its config has no head_dim
        return out
