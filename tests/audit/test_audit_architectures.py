"""The memory audit of published-architecture features: the weight inventory against the
megatron-core GPTModel that etp-train builds from the same recipe on CPU (every name and shape,
one feature at a time and all together), the parameter count of each architecture recipe
against its published shapes, and etp-audit on each recipe."""
import json
from pathlib import Path

import pytest
from harness import run_distributed

from etp.audit import weight_inventory
from etp.audit.cli import main
from etp.megatron.recipe import Recipe

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[2]

BASE = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, seq_length=16,
            vocab_size=256, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_grouped_gemm=True,
            swiglu=True, add_bias_linear=False, normalization="RMSNorm", position_embedding_type="rope",
            untie_embeddings_and_output_weights=True, micro_batch_size=2, train_iters=1, lr=1e-3)
FEATURES = {
    "shared experts": dict(moe_shared_expert_intermediate_size=48),
    "shared experts, gated": dict(moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True),
    "qk layernorm (RMSNorm)": dict(qk_layernorm=True),
    "qk layernorm (LayerNorm)": dict(qk_layernorm=True, normalization="LayerNorm"),
    "kv_channels, GQA": dict(kv_channels=24, num_query_groups=2),
    "GQA, one group": dict(num_query_groups=1),
    "sigmoid, expert bias, grouped top-k": dict(
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="none", moe_router_num_groups=2, moe_router_group_topk=1),
    "dense then MoE": dict(num_layers=3, moe_layer_freq=[0, 1, 1]),
    "MoE every 2nd layer": dict(num_layers=4, moe_layer_freq=2),
    "tied embeddings": dict(untie_embeddings_and_output_weights=False),
    "SequentialMLP experts, shared": dict(moe_grouped_gemm=False, moe_shared_expert_intermediate_size=48),
    "all": dict(num_layers=3, moe_layer_freq=[0, 1, 1], moe_shared_expert_intermediate_size=48,
                moe_shared_expert_gate=True, qk_layernorm=True, kv_channels=24, num_query_groups=2,
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_load_balancing_type="none", moe_router_num_groups=2, moe_router_group_topk=1,
                untie_embeddings_and_output_weights=False),
}


def _built(ctx, variants):
    """name -> shape of the GPTModel etp-train builds from each recipe (CPU initialization)."""
    import torch
    from megatron.core import parallel_state as ps

    from etp.megatron.trainer.model_build import gpt_model, transformer_config

    torch.cuda.current_device = lambda: "cpu"  # where megatron's router puts its expert-bias buffers
    ps.initialize_model_parallel()
    try:
        out = []
        for values in variants:
            recipe = Recipe.from_dict(values)
            model = gpt_model(recipe, transformer_config(recipe, torch.device("cpu")))
            out.append({name: tuple(p.shape) for name, p in model.named_parameters()})
        return out
    finally:
        ps.destroy_model_parallel()


def test_inventory_names_every_weight_of_the_built_model():
    variants = [{**BASE, **features} for features in FEATURES.values()]
    built = run_distributed(_built, 1, variants)[0]
    for case, values, model in zip(FEATURES, variants, built):
        recipe = Recipe.from_dict(values)
        predicted = {w.name: w.shape for w in weight_inventory(recipe)}
        assert predicted == model, case
        assert recipe.num_params() == sum(_numel(shape) for shape in model.values()), case


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def test_inventory_can_tell_a_missing_feature():
    """The comparison above fails when the inventory forgets a feature's weights."""
    values = {**BASE, **FEATURES["all"]}
    full = {w.name for w in weight_inventory(Recipe.from_dict(values))}
    for key, off in (("qk_layernorm", False), ("moe_shared_expert_intermediate_size", None),
                     ("moe_layer_freq", 1), ("untie_embeddings_and_output_weights", True)):
        changed = {**values, key: off, **({"moe_shared_expert_gate": False} if key.startswith("moe_shared") else {})}
        assert {w.name for w in weight_inventory(Recipe.from_dict(changed))} != full, key
