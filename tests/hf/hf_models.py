"""Tiny random Hugging Face MoE models built with transformers on CPU (nothing downloaded): each
architecture's own norm epsilon and RoPE base, several experts, top-2, grouped-query attention,
at least two layers, and norm weights moved off their initial ones so that a norm mapped to the
wrong tensor shows."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 384
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, max_position_embeddings=256)
#: architecture -> (transformers config class, model class, config values)
ARCHITECTURES = {
    # head_dim 24: 4 x 24 != 64; layer 1 dense (mlp_only_layers); Qwen3's epsilon and RoPE base
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(COMMON, num_hidden_layers=3, head_dim=24, num_experts=4, moe_intermediate_size=32,
                       intermediate_size=96, mlp_only_layers=[1], norm_topk_prob=True, rms_norm_eps=1e-6,
                       rope_theta=1e6)),
    # full-width QK norm; the top-k of the full softmax (norm_topk_prob false)
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(COMMON, num_hidden_layers=2, num_experts=4, intermediate_size=32, rms_norm_eps=1e-5,
                   rope_theta=1e4, norm_topk_prob=False, eos_token_id=2, pad_token_id=1)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(COMMON, num_hidden_layers=2, num_local_experts=4, intermediate_size=32, rms_norm_eps=1e-5,
                     rope_theta=1e6)),
}


def build(name: str, seed: int = 0, **changes):
    """A tiny random ``name`` model (eval mode, fp32)."""
    import transformers

    config_cls, model_cls, values = ARCHITECTURES[name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**values, **changes})).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.add_(0.2 * torch.randn_like(param))
    return model


def save(name: str, directory: Path, seed: int = 0, **changes) -> Path:
    """A tiny random ``name`` model saved with transformers' ``save_pretrained`` into ``directory``."""
    model = build(name, seed, **changes)
    model.save_pretrained(directory)
    return directory


def tokens(seed: int = 0, batch: int = 2, length: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
