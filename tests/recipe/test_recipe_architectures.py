"""The architecture keys of recipes (etp/recipe/architecture.py): every combination
megatron-core's TransformerConfig refuses, or would silently ignore, is refused first as a
RecipeError naming the key, its value and the fix; good values reach TransformerConfig; the
layer pattern's forms. (On CPU they train: tests/train/test_train.py.)"""
import pytest

from etp.recipe import Recipe, RecipeError

BASE = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=256, num_experts=8,
            moe_router_topk=4, moe_ffn_hidden_size=32, swiglu=True, add_bias_linear=False,
            micro_batch_size=1, train_iters=1, lr=1e-3)
SIGMOID = dict(moe_router_score_function="sigmoid", moe_router_load_balancing_type="none")

# (overrides, key at fault, offending value, a phrase of the fix)
BAD = {
    "head width without kv_channels": ({"hidden_size": 66}, "hidden_size", 66, "set kv_channels"),
    "zero kv_channels": ({"kv_channels": 0}, "kv_channels", 0, ">= 1"),
    "shared experts on a dense model": (
        {"num_experts": None, "moe_ffn_hidden_size": None, "moe_shared_expert_intermediate_size": 64},
        "moe_shared_expert_intermediate_size", 64, "needs num_experts"),
    "sigmoid on a dense model": (
        {"num_experts": None, "moe_ffn_hidden_size": None, "moe_router_score_function": "sigmoid"},
        "moe_router_score_function", "sigmoid", "needs num_experts"),
    "shared experts with biases": (
        {"moe_shared_expert_intermediate_size": 64, "add_bias_linear": True}, "add_bias_linear", True,
        "add_bias_linear: false"),
    "gate without shared experts": ({"moe_shared_expert_gate": True}, "moe_shared_expert_gate", True,
                                    "set moe_shared_expert_intermediate_size"),
    "shared width % TP": (
        {"moe_shared_expert_intermediate_size": 33, "tensor_model_parallel_size": 2, "sequence_parallel": True},
        "moe_shared_expert_intermediate_size", 33, "tensor_model_parallel_size=2"),
    "score function choice": ({"moe_router_score_function": "relu"}, "moe_router_score_function", "relu",
                              "allowed values"),
    "expert bias with softmax": ({"moe_router_enable_expert_bias": True}, "moe_router_enable_expert_bias", True,
                                 "moe_router_score_function: sigmoid"),
    "expert bias with sinkhorn": (
        {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
         "moe_router_load_balancing_type": "sinkhorn"}, "moe_router_score_function", "sigmoid", "sinkhorn"),
    "pre-softmax with sigmoid": ({**SIGMOID, "moe_router_pre_softmax": True}, "moe_router_pre_softmax", True,
                                 "applies to softmax scores"),
    "top-1 softmax after the top-k": ({"moe_router_topk": 1}, "moe_router_topk", 1,
                                      "moe_router_pre_softmax: true"),
    "aux coefficient without an aux loss": (
        {**SIGMOID, "moe_aux_loss_coeff": 0.01}, "moe_aux_loss_coeff", 0.01, "set it to 0"),
    "zero bias update rate": ({**SIGMOID, "moe_router_enable_expert_bias": True, "moe_router_bias_update_rate": 0.0},
                              "moe_router_bias_update_rate", 0.0, "> 0.0"),
    "zero scaling factor": ({"moe_router_topk_scaling_factor": 0.0}, "moe_router_topk_scaling_factor", 0.0, "> 0.0"),
    "groups without group top-k": ({"moe_router_num_groups": 4}, "moe_router_num_groups", 4,
                                   "needs moe_router_group_topk"),
    "group top-k without groups": ({"moe_router_group_topk": 2}, "moe_router_group_topk", 2,
                                   "needs moe_router_num_groups"),
    "groups % experts": ({"moe_router_num_groups": 3, "moe_router_group_topk": 1}, "moe_router_num_groups", 3,
                         "divide num_experts=8"),
    "group top-k > groups": ({"moe_router_num_groups": 2, "moe_router_group_topk": 4}, "moe_router_group_topk", 4,
                             "<= moe_router_num_groups=2"),
    "top-k % group top-k": ({"moe_router_num_groups": 4, "moe_router_group_topk": 3}, "moe_router_group_topk", 3,
                            "divide moe_router_topk=4"),
    "top-k beyond the chosen groups": (
        {"moe_router_num_groups": 8, "moe_router_group_topk": 2}, "moe_router_topk", 4, "raise moe_router_group_topk"),
    "layer pattern length": ({"moe_layer_freq": [0, 1, 1]}, "moe_layer_freq", [0, 1, 1], "([0]*1+[1]*3)"),
    "layer pattern of dense layers only": ({"moe_layer_freq": [0, 0, 0, 0]}, "moe_layer_freq", [0, 0, 0, 0],
                                           "unset num_experts"),
    "layer pattern value": ({"moe_layer_freq": [0, 2, 1, 1]}, "moe_layer_freq", [0, 2, 1, 1], "one 0 (dense)"),
    "layer pattern string": ({"moe_layer_freq": "[0]*3+[1]*x"}, "moe_layer_freq", "[0]*3+[1]*x", "([0]*3+[1]*5)"),
    "layer frequency zero": ({"moe_layer_freq": 0}, "moe_layer_freq", 0, ">= 1"),
    "layer frequency on a dense model": (
        {"num_experts": None, "moe_ffn_hidden_size": None, "moe_layer_freq": 2}, "moe_layer_freq", 2,
        "needs num_experts"),
    "QK-norm width without QK norm": ({"qk_layernorm_width": "full"}, "qk_layernorm_width", "full",
                                      "needs qk_layernorm: true"),
    "full-width QK norm as a LayerNorm": ({"qk_layernorm": True, "qk_layernorm_width": "full"}, "qk_layernorm_width",
                                          "full", "set normalization: RMSNorm"),
    "full-width QK norm over TP": (
        {"qk_layernorm": True, "qk_layernorm_width": "full", "normalization": "RMSNorm",
         "tensor_model_parallel_size": 2}, "qk_layernorm_width", "full", "tensor_model_parallel_size: 1"),
    "QK-norm width choice": ({"qk_layernorm": True, "qk_layernorm_width": "all"}, "qk_layernorm_width", "all",
                             "allowed values"),
    "RoPE base without RoPE": ({"rotary_base": 1e6}, "rotary_base", 1e6, "use rope"),
    "zero norm epsilon": ({"norm_epsilon": 0.0}, "norm_epsilon", 0.0, "> 0.0"),
    "recompute mlp without dense layers": (
        {"recompute_granularity": "selective", "recompute_modules": ["mlp"]}, "recompute_modules", ["mlp"],
        "use 'moe'"),
    "recompute shared experts without them": (
        {"recompute_granularity": "selective", "recompute_modules": ["shared_experts"]}, "recompute_modules",
        ["shared_experts"], "moe_shared_expert_intermediate_size unset"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_architecture_is_refused_naming_key_value_and_fix(case):
    overrides, key, value, fix = BAD[case]
    with pytest.raises(RecipeError) as info:
        Recipe.from_dict({**BASE, **overrides})
    error = info.value
    assert (error.key, error.value) == (key, value)
    message = str(error)
    assert key in message and repr(value) in message and fix in message, message
    assert len(message.splitlines()) == 1


GOOD = {
    "mixed layers": dict(moe_layer_freq=[0, 1, 1, 1], recompute_granularity="selective",
                         recompute_modules=["mlp", "moe"]),
    "shared experts, recomputed": dict(moe_shared_expert_intermediate_size=64, moe_shared_expert_gate=True,
                                       recompute_granularity="selective", recompute_modules=["shared_experts"]),
    "deepseek router": dict(**SIGMOID, moe_router_enable_expert_bias=True, moe_router_num_groups=4,
                            moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5),
    "olmoe router": dict(moe_router_pre_softmax=True, moe_z_loss_coeff=1e-3, moe_aux_loss_coeff=0.01),
    "qwen3 attention": dict(hidden_size=48, num_attention_heads=4, num_query_groups=1, kv_channels=32,
                            qk_layernorm=True),
}


def _megatron_config(recipe):
    """megatron-core's TransformerConfig of a recipe as etp-train builds it (its own checks run)."""
    import torch

    from etp.train.model_build import transformer_config

    return transformer_config(recipe, torch.device("cpu"))


@pytest.mark.parametrize("case", list(GOOD), ids=list(GOOD))
def test_good_architecture_reaches_megatron_transformer_config(case):
    pytest.importorskip("megatron.core")
    recipe = Recipe.from_dict({**BASE, **GOOD[case]})
    config = _megatron_config(recipe)
    for key, value in GOOD[case].items():
        if key == "moe_layer_freq":
            assert config.moe_layer_freq == list(value)
        elif key == "recompute_modules":
            assert config.recompute_modules == value
        elif key != "recompute_granularity":
            assert getattr(config, key) == value, key
    assert config.kv_channels == recipe.model.kv_channels


def test_megatron_itself_refuses_what_the_recipe_refuses_first():
    """The recipe's refusals mirror megatron-core's own for the combinations it checks."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=8, moe_router_topk=4,
                use_cpu_initialization=True)
    for bad in (dict(moe_router_enable_expert_bias=True),
                dict(moe_router_group_topk=2),
                dict(moe_router_topk=1)):
        with pytest.raises((ValueError, AssertionError)):
            TransformerConfig(**{**base, **bad})


@pytest.mark.parametrize("written,pattern", [
    ("([0]*3+[1]*5)", (0, 0, 0, 1, 1, 1, 1, 1)),
    ("[0,1]*4", (0, 1) * 4),
    ([1, 1, 0, 1, 1, 1, 0, 1], (1, 1, 0, 1, 1, 1, 0, 1)),
    ("[0, 0, 1, 1, 1, 1, 1, 1]", (0, 0, 1, 1, 1, 1, 1, 1)),
])
def test_layer_pattern_forms(written, pattern):
    recipe = Recipe.from_dict({**BASE, "num_layers": 8, "moe_layer_freq": written})
    assert recipe.model.moe_layer_freq == pattern
    assert recipe.model.moe_layers == tuple(bool(v) for v in pattern)
    every_third = Recipe.from_dict({**BASE, "num_layers": 7, "moe_layer_freq": 3}).model.moe_layers
    assert every_third == (True, False, False, True, False, False, True)  # megatron-core's i % N == 0


def test_layer_pattern_set_from_the_command_line():
    from etp.recipe import parse_overrides

    overrides = parse_overrides(["num_layers=61", "moe_layer_freq=([0]*3+[1]*58)"])
    recipe = Recipe.from_dict({**BASE, **overrides})
    assert recipe.model.moe_layers.count(False) == 3 and len(recipe.model.moe_layers) == 61


def test_router_losses_are_weighed_like_the_language_model_loss():
    """etp-train divides each micro-batch's loss by the micro-batch count: the router's auxiliary
    and z-loss gradients (megatron-core's MoEAuxLossAutoScaler) get the same factor, as in
    megatron-core's own schedules, instead of its default 1."""
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from etp.train.model_build import scale_router_losses

    recipe = Recipe.from_dict({**BASE, "micro_batch_size": 2, "global_batch_size": 16})
    before = MoEAuxLossAutoScaler.main_loss_backward_scale
    try:
        assert scale_router_losses(recipe, 2, torch.device("cpu")) == 0.25  # 16 / (2 x 2 ranks) = 4
        # A step of 4 micro-batches, each with its own auxiliary loss: the accumulated gradient
        # of the auxiliary losses is their mean, as the language-model loss's is.
        grads = torch.zeros(())
        for aux_value in (1.0, 2.0, 3.0, 4.0):
            aux = torch.tensor(aux_value, requires_grad=True)
            out = MoEAuxLossAutoScaler.apply(torch.ones(3, requires_grad=True), aux * 2.0)
            out.sum().backward()
            grads += aux.grad
        assert grads.item() == 2.0  # d(mean of 2 x aux) / d(aux) summed over the 4: 4 x 2 / 4
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = before
