"""The architecture keys of a recipe (shared experts, QK norm and its width, head width, RoPE base,
router variants, dense and MoE layers mixed): what megatron-core's ``TransformerConfig`` or its modules would
refuse, or silently ignore, refused here first with the fix. See docs/architectures.md."""
from __future__ import annotations

from etp.recipe.validation import _fail

__all__ = ["check_architecture", "check_architecture_layout", "moe_layer_pattern"]

#: MoE-only keys and their defaults: set on a dense model they would do nothing
_MOE_ONLY = {
    "moe_layer_freq": 1,
    "moe_shared_expert_intermediate_size": None,
    "moe_shared_expert_gate": False,
    "moe_router_score_function": "softmax",
    "moe_router_pre_softmax": False,
    "moe_router_topk_scaling_factor": None,
    "moe_router_enable_expert_bias": False,
    "moe_router_num_groups": None,
    "moe_router_group_topk": None,
    "moe_z_loss_coeff": None,
}


def moe_layer_pattern(m) -> tuple[bool, ...]:
    """Per layer, whether megatron-core builds it as an MoE layer: ``moe_layer_freq`` N makes
    layers 0, N, 2N, ... MoE (megatron-core's rule), a pattern says it layer by layer; all
    False for a dense model.

    Example::

        moe_layer_pattern(Recipe.from_yaml("recipes/deepseek_v3_shaped.yaml").model)[:4]
        # (False, False, False, True)
    """
    if m.num_experts is None:
        return (False,) * m.num_layers
    freq = m.moe_layer_freq
    if isinstance(freq, int):
        return tuple(i % freq == 0 for i in range(m.num_layers))
    return tuple(bool(v) for v in freq)


def check_architecture(m) -> None:
    """The model-only checks of the architecture keys (``ModelSpec`` calls it)."""
    _check_attention(m)
    if m.num_experts is None:
        for key, default in _MOE_ONLY.items():
            if getattr(m, key) != default:
                _fail(key, getattr(m, key), "needs num_experts (the model is dense)")
        return
    _check_layer_freq(m)
    if m.moe_shared_expert_gate and m.moe_shared_expert_intermediate_size is None:
        _fail("moe_shared_expert_gate", True, "gates shared experts: set moe_shared_expert_intermediate_size")
    if m.moe_shared_expert_intermediate_size is not None and m.add_bias_linear:
        _fail("add_bias_linear", True, "must be false with moe_shared_expert_intermediate_size (megatron-core's "
              "SharedExpertMLP has no biases): set add_bias_linear: false")
    _check_scores(m)
    _check_groups(m)


def _check_attention(m) -> None:
    """QK-norm width and the RoPE base: keys that would do nothing (or something etp does not build)."""
    if m.qk_layernorm_width != "head":
        if not m.qk_layernorm:
            _fail("qk_layernorm_width", m.qk_layernorm_width, "needs qk_layernorm: true (it says what the QK norm "
                  "normalizes): set qk_layernorm or remove qk_layernorm_width")
        if m.normalization != "RMSNorm":
            _fail("qk_layernorm_width", m.qk_layernorm_width, f"full is an RMSNorm over the whole query and key "
                  f"(OLMoE's), and normalization is {m.normalization}: set normalization: RMSNorm or "
                  "qk_layernorm_width: head")
    if m.rotary_base != 10000.0 and m.position_embedding_type != "rope":
        _fail("rotary_base", m.rotary_base, f"applies to position_embedding_type: rope, not "
              f"{m.position_embedding_type}: remove rotary_base or use rope")


def _check_layer_freq(m) -> None:
    freq, layers = m.moe_layer_freq, m.num_layers
    if isinstance(freq, int):
        return
    if len(freq) != layers:
        dense = next((i for i, v in enumerate(freq) if v), len(freq))
        hint = f"([0]*{dense}+[1]*{layers - dense})" if 0 < dense < layers else f"([1]*{layers})"
        _fail("moe_layer_freq", list(freq), f"has {len(freq)} entries for num_layers={layers}: one 0 (dense) or "
              f"1 (MoE) per layer, e.g. {hint}")
    if not any(freq):
        _fail("moe_layer_freq", list(freq), "has no MoE layer: unset num_experts for a dense model")


def _check_scores(m) -> None:
    """Score function, expert bias, pre-softmax and the auxiliary loss."""
    sigmoid = m.moe_router_score_function == "sigmoid"
    balancing = m.moe_router_load_balancing_type
    if m.moe_router_enable_expert_bias and not sigmoid:
        _fail("moe_router_enable_expert_bias", True, "needs moe_router_score_function: sigmoid (megatron-core's "
              "aux-loss-free balancing biases sigmoid scores only)")
    if m.moe_router_pre_softmax and sigmoid:
        _fail("moe_router_pre_softmax", True, "applies to softmax scores: remove it with "
              "moe_router_score_function: sigmoid (sigmoid scores are taken before the top-k already)")
    if balancing == "sinkhorn":
        for key, value in (("moe_router_score_function", m.moe_router_score_function),
                           ("moe_router_enable_expert_bias", m.moe_router_enable_expert_bias),
                           ("moe_router_num_groups", m.moe_router_num_groups),
                           ("moe_router_topk_scaling_factor", m.moe_router_topk_scaling_factor)):
            if value != _MOE_ONLY[key]:
                _fail(key, value, "is ignored by moe_router_load_balancing_type: sinkhorn (its own top-k): "
                      f"remove {key} or choose another load balancing")
    elif (m.moe_router_topk == 1 and not sigmoid and not m.moe_router_pre_softmax):
        _fail("moe_router_topk", 1, "with softmax scores needs moe_router_pre_softmax: true (a softmax over "
              "one chosen expert has a zero gradient; megatron-core refuses it)")
    if balancing in ("none", "sinkhorn") and m.moe_aux_loss_coeff > 0:
        _fail("moe_aux_loss_coeff", m.moe_aux_loss_coeff, f"does nothing with moe_router_load_balancing_type: "
              f"{balancing}: set it to 0 or choose aux_loss, seq_aux_loss or global_aux_loss")


def _check_groups(m) -> None:
    """Group-limited routing (DeepSeek's node-limited top-k)."""
    groups, group_topk, topk, experts = (m.moe_router_num_groups, m.moe_router_group_topk,
                                         m.moe_router_topk, m.num_experts)
    if groups is None and group_topk is None:
        return
    if groups is None or group_topk is None:
        missing = "moe_router_num_groups" if groups is None else "moe_router_group_topk"
        key, value = ("moe_router_group_topk", group_topk) if groups is None else ("moe_router_num_groups", groups)
        _fail(key, value, f"needs {missing} too (group-limited routing picks moe_router_group_topk of "
              "moe_router_num_groups expert groups per token)")
    if experts % groups:
        _fail("moe_router_num_groups", groups, f"must divide num_experts={experts} (equal groups)")
    if group_topk > groups:
        _fail("moe_router_group_topk", group_topk, f"must be <= moe_router_num_groups={groups}")
    if topk % group_topk:
        _fail("moe_router_group_topk", group_topk, f"must divide moe_router_topk={topk} (megatron-core scores "
              "each group by its top moe_router_topk / moe_router_group_topk experts)")
    if topk > group_topk * (experts // groups):
        _fail("moe_router_topk", topk, f"is more than the {group_topk} x {experts // groups} experts of the "
              "chosen groups: raise moe_router_group_topk")


def check_architecture_layout(recipe) -> None:
    """The architecture checks that need the parallel sizes or the training keys (``Recipe``
    calls it): the shared experts' width over TP, and which MLPs selective recompute can name."""
    m, p, t = recipe.model, recipe.parallel, recipe.train
    tp = p.tensor_model_parallel_size
    if m.qk_layernorm and m.qk_layernorm_width == "full" and tp > 1:
        _fail("qk_layernorm_width", "full", f"normalizes the whole query across heads, which "
              f"tensor_model_parallel_size={tp} splits over ranks (etp's full-width QK norm is TP 1 only): use "
              "tensor_model_parallel_size: 1 (ETP and EP shard the model instead)")
    shared = m.moe_shared_expert_intermediate_size
    if shared is not None and shared % tp:
        _fail("moe_shared_expert_intermediate_size", shared, f"must be divisible by tensor_model_parallel_size={tp}")
    if t.recompute_granularity != "selective" or t.recompute_modules is None:
        return
    modules, layers = list(t.recompute_modules), m.moe_layers  # named as written: a list
    if "mlp" in modules and all(layers):
        _fail("recompute_modules", modules, f"'mlp' recomputes dense MLPs, and every layer is MoE (num_experts="
              f"{m.num_experts}): use 'moe'")
    if "moe" in modules and not any(layers):
        _fail("recompute_modules", modules, "'moe' recomputes MoE layers, and the model is dense (num_experts "
              "unset): use 'mlp'")
    if "shared_experts" in modules and shared is None:
        _fail("recompute_modules", modules, "'shared_experts' recomputes shared experts, and the model has none "
              "(moe_shared_expert_intermediate_size unset): use 'moe' for the MoE layer")
