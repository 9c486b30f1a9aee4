"""The recipe keys that make the published architectures exact (rotary_base, norm_epsilon,
qk_layernorm_width) reach the model etp-train builds: megatron-core's TransformerConfig, its
rotary table, and the full-width QK norm against the formula in float64. The logits against
transformers' own models: test_hf_parity.py."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from etp.recipe import Recipe  # noqa: E402

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=24, seq_length=16,
            vocab_size=256, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, swiglu=True,
            add_bias_linear=False, normalization="RMSNorm", position_embedding_type="rope", qk_layernorm=True,
            moe_grouped_gemm=True, micro_batch_size=1, train_iters=1, lr=1e-3)


def _model(**keys):
    from etp.hf.megatron_io import single_process
    from etp.train.model_build import gpt_model, transformer_config

    recipe = Recipe.from_dict({**BASE, **keys})
    with single_process():
        config = transformer_config(recipe, torch.device("cpu"))
        return recipe, config, gpt_model(recipe, config)


def test_norm_epsilon_and_rotary_base_reach_the_model():
    recipe, config, model = _model(norm_epsilon=1e-6, rotary_base=1e6)
    assert config.layernorm_epsilon == 1e-6
    norms = [m for n, m in model.named_modules() if n.endswith("layernorm") and hasattr(m, "eps")]
    assert norms and {m.eps for m in norms} == {1e-6}
    dim = recipe.model.kv_channels
    expected = 1.0 / (1e6 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    torch.testing.assert_close(model.rotary_pos_emb.inv_freq.double(), expected, rtol=1e-6, atol=0)
    _, default_config, default = _model()
    assert default_config.layernorm_epsilon == 1e-5  # megatron-core's and Megatron-LM's default, unchanged
    assert not torch.allclose(default.rotary_pos_emb.inv_freq, model.rotary_pos_emb.inv_freq)


def test_full_width_qk_norm_normalizes_every_head_at_once():
    from etp.megatron.qk_norm import FullWidthQKNorm

    recipe, _, model = _model(qk_layernorm_width="full", norm_epsilon=1e-5)
    attention = model.decoder.layers[0].self_attention
    q_norm, k_norm = attention.q_layernorm, attention.k_layernorm
    assert isinstance(q_norm, FullWidthQKNorm) and isinstance(k_norm, FullWidthQKNorm)
    assert q_norm.weight.shape == (4 * 24,) and k_norm.weight.shape == (2 * 24,)
    names = {n for n, _ in model.named_parameters()}
    assert "decoder.layers.1.self_attention.q_layernorm.weight" in names  # megatron-core's name, as per head
    assert sum(p.numel() for p in model.parameters()) == recipe.num_params()
    q_norm = q_norm.double()
    with torch.no_grad():
        q_norm.weight.copy_(torch.randn(96, dtype=torch.float64))
    x = torch.randn(5, 3, 4, 24, dtype=torch.float64)  # [sq, b, heads, kv_channels], as megatron-core hands it
    flat = x.reshape(5, 3, 96)
    expected = flat / torch.sqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-5) * q_norm.weight
    torch.testing.assert_close(q_norm(x), expected.view_as(x), rtol=1e-12, atol=1e-12)
    per_head = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * q_norm.weight.view(4, 24)
    assert not torch.allclose(q_norm(x), per_head)  # a per-head norm is another model
