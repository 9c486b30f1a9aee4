"""Mixtral (``MixtralForCausalLM``, ``model_type: mixtral``; mistralai/Mixtral-8x7B): no QK norm,
the router's softmax over all experts with the top-k renormalized, experts named ``w1`` (gate),
``w3`` (up), ``w2`` (down) under ``block_sparse_moe``."""
from __future__ import annotations

from etp.hf.adapter import HFConfig, MoEAdapter

__all__ = ["MixtralAdapter"]


class MixtralAdapter(MoEAdapter):
    """Mixtral ↔ etp.

    Example::

        MixtralAdapter().expert(0, 3)
        # ('model.layers.0.block_sparse_moe.experts.3.w1.weight', '...w3.weight', '...w2.weight')
    """

    model_type = "mixtral"
    architecture = "MixtralForCausalLM"

    def router(self, i: int) -> str:
        return self.layer(i) + "block_sparse_moe.gate.weight"

    def expert(self, i: int, e: int) -> tuple[str, str, str]:
        base = self.layer(i) + f"block_sparse_moe.experts.{e}."
        return base + "w1.weight", base + "w3.weight", base + "w2.weight"

    def recipe_model_keys(self, cfg: HFConfig) -> dict:
        if cfg.get("sliding_window") is not None:
            cfg.refuse("sliding_window", cfg.get("sliding_window"), "etp's attention is causal over the whole "
                       "sequence: convert a checkpoint with sliding_window null")
        if cfg.get("router_jitter_noise", 0.0):
            cfg.refuse("router_jitter_noise", cfg.get("router_jitter_noise"), "etp's router adds no noise to its "
                       "input: set it to 0")
        keys = self.common_keys(cfg, cfg.require("num_local_experts"), cfg.require("intermediate_size"))
        # softmax over all experts, the top-k renormalized: megatron-core's softmax over the chosen ones
        keys.update(qk_layernorm=False, moe_router_pre_softmax=False)
        return keys

    def config_values(self, m) -> dict:
        return dict(num_local_experts=m.num_experts, intermediate_size=m.moe_ffn_hidden_size, sliding_window=None,
                    router_jitter_noise=0.0)
