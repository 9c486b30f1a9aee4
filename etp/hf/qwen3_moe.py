"""Qwen3-MoE (``Qwen3MoeForCausalLM``, ``model_type: qwen3_moe``; Qwen/Qwen3-30B-A3B): per-head QK
norm, ``head_dim`` apart from ``hidden_size / heads``, optional dense layers (``mlp_only_layers``,
``decoder_sparse_step``), top-k weights renormalized or not (``norm_topk_prob``)."""
from __future__ import annotations

from etp.hf.adapter import HFConfig, MoEAdapter

__all__ = ["Qwen3MoeAdapter"]


class Qwen3MoeAdapter(MoEAdapter):
    """Qwen3-MoE ↔ etp: names as ``MoEAdapter``'s (``mlp.gate``, ``mlp.experts.{e}.gate_proj`` /
    ``up_proj`` / ``down_proj``, ``self_attn.q_norm`` / ``k_norm`` over one head).

    Example::

        keys = Qwen3MoeAdapter().recipe_model_keys(HFConfig(config, "config.json"))
        keys["norm_epsilon"], keys["rotary_base"]   # 1e-06, 1000000.0 for Qwen3-30B-A3B
    """

    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"

    def recipe_model_keys(self, cfg: HFConfig) -> dict:
        if cfg.get("use_sliding_window", False):
            cfg.refuse("use_sliding_window", True, "etp's attention is causal over the whole sequence: convert a "
                       "checkpoint without a sliding window")
        experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        if not experts:
            cfg.refuse("num_experts", experts, "a Qwen3-MoE checkpoint without experts is a dense Qwen3: etp-convert "
                       "converts MoE models")
        keys = self.common_keys(cfg, experts, cfg.require("moe_intermediate_size"))
        layers, step = keys["num_layers"], cfg.get("decoder_sparse_step", 1)
        dense = set(cfg.get("mlp_only_layers", []))
        pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
        keys.update(qk_layernorm=True, qk_layernorm_width="head",
                    # norm_topk_prob: softmax over all experts, the top-k renormalized, which is
                    # megatron-core's softmax over the chosen experts; without it the top-k of
                    # the full softmax (megatron-core's pre-softmax).
                    moe_router_pre_softmax=not cfg.get("norm_topk_prob", False),
                    moe_layer_freq=1 if all(pattern) else pattern)
        if not all(pattern):
            keys["ffn_hidden_size"] = cfg.require("intermediate_size")
        return keys

    def config_values(self, m) -> dict:
        dense = [i for i, moe in enumerate(m.moe_layers) if not moe]
        return dict(num_experts=m.num_experts, moe_intermediate_size=m.moe_ffn_hidden_size,
                    intermediate_size=m.ffn_hidden_size, norm_topk_prob=not m.moe_router_pre_softmax,
                    decoder_sparse_step=1, mlp_only_layers=dense, use_sliding_window=False, sliding_window=None)
