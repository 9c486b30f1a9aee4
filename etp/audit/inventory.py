"""The parameters one rank holds for a recipe, without building the model: their local
(TP / EP) shapes and how ETP shards them. See [Note: ETP memory prediction] in
``etp/audit/predict.py``."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ETPConfig
from ..layout import ShardLayout

__all__ = ["WeightSpec", "weight_inventory", "weights_on_rank"]


@dataclass(frozen=True)
class WeightSpec:
    """One parameter on one rank: its local (TP/EP) shape and how ETP treats it.

    ``chain`` is None for replicated parameters, else the ETP chain kind (``dense`` or
    ``expert:<role>``); ``expert`` routes it to the expert ETP group.
    """

    name: str
    shape: tuple[int, ...]
    chain: str | None
    expert: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def weight_inventory(recipe) -> list[WeightSpec]:
    """The parameters of one rank (first pipeline stage) in forward order. See
    [Note: ETP memory prediction].

    Example::

        sharded = [w.name for w in weight_inventory(recipe) if w.chain is not None]
    """
    m, p = recipe.model, recipe.parallel
    tp = p.tensor_model_parallel_size
    h, kv = m.hidden_size, m.kv_channels
    gated = 2 if m.swiglu else 1
    layer_norm = m.normalization == "LayerNorm"
    bias = m.add_bias_linear
    vocab = recipe.padded_vocab_size // tp
    out: list[WeightSpec] = [WeightSpec("embedding.word_embeddings.weight", (vocab, h), None)]
    if m.position_embedding_type == "learned_absolute":
        out.append(WeightSpec("embedding.position_embeddings.weight",
                              (m.max_position_embeddings or m.seq_length, h), None))

    def norm(prefix, width=h):
        out.append(WeightSpec(prefix + ".weight", (width,), None))
        if layer_norm:
            out.append(WeightSpec(prefix + ".bias", (width,), None))

    def linear(name, rows, cols, chain, expert=False, bias_rows=None):
        out.append(WeightSpec(name + ".weight", (rows, cols), chain, expert))
        if bias:
            out.append(WeightSpec(name + ".bias", (bias_rows or rows,), None, expert))

    qkv_out = (m.num_attention_heads + 2 * m.num_query_groups) * kv
    for layer, moe in enumerate(m.moe_layers[: m.num_layers // p.pipeline_model_parallel_size]):
        pre = f"decoder.layers.{layer}."
        norm(pre + "input_layernorm")
        linear(pre + "self_attention.linear_qkv", qkv_out // tp, h, "dense")
        if m.qk_layernorm:  # over one head's width (or every head's: full width), replicated
            norm(pre + "self_attention.q_layernorm", m.qk_layernorm_widths[0])
            norm(pre + "self_attention.k_layernorm", m.qk_layernorm_widths[1])
        linear(pre + "self_attention.linear_proj", h, m.num_attention_heads * kv // tp, "dense",
               bias_rows=h)
        norm(pre + "pre_mlp_layernorm")
        if moe:
            _moe_weights(out, recipe, pre + "mlp.", linear)
        else:
            linear(pre + "mlp.linear_fc1", gated * m.ffn_hidden_size // tp, h, "dense")
            linear(pre + "mlp.linear_fc2", h, m.ffn_hidden_size // tp, "dense", bias_rows=h)
    norm("decoder.final_layernorm")
    if m.untie_embeddings_and_output_weights:
        out.append(WeightSpec("output_layer.weight", (vocab, h), "dense"))
    return out


def _moe_weights(out: list[WeightSpec], recipe, pre: str, linear) -> None:
    """An MoE layer's weights in forward order: the shared experts (megatron-core runs them
    before the router; dense weights, ETP's dense chain), the router, the routed experts."""
    m, p = recipe.model, recipe.parallel
    tp, ep = p.tensor_model_parallel_size, p.expert_model_parallel_size
    etp_tp = p.expert_tensor_parallel_size or tp
    h, gated = m.hidden_size, 2 if m.swiglu else 1
    shared = m.moe_shared_expert_intermediate_size
    if shared is not None:
        linear(pre + "shared_experts.linear_fc1", gated * shared // tp, h, "dense")
        linear(pre + "shared_experts.linear_fc2", h, shared // tp, "dense", bias_rows=h)
        if m.moe_shared_expert_gate:
            out.append(WeightSpec(pre + "shared_experts.gate_weight", (1, h), None))
    out.append(WeightSpec(pre + "router.weight", (m.num_experts, h), None))
    local, ffn = m.num_experts // ep, m.moe_ffn_hidden_size
    if m.moe_grouped_gemm:
        out.append(WeightSpec(pre + "experts.experts.fc1_weight", (local, gated * ffn, h), "expert:fc1_weight", True))
        out.append(WeightSpec(pre + "experts.experts.fc2_weight", (local, h, ffn), "expert:fc2_weight", True))
        return
    for e in range(local):
        base = f"{pre}experts.local_experts.{e}."
        linear(base + "linear_fc1", gated * ffn // etp_tp, h, "expert:linear_fc1", True)
        linear(base + "linear_fc2", h, ffn // etp_tp, "expert:linear_fc2", True, bias_rows=h)


def weights_on_rank(recipe, etp: ETPConfig):
    """Yields ``(weight, layout, elements on this rank)`` for every weight of the recipe:
    ``layout`` is the ETP ``ShardLayout`` of a sharded weight (its shard's elements), None for
    a replicated one (all its elements).

    Example::

        shards = sum(numel for _, layout, numel in weights_on_rank(recipe, recipe.etp) if layout)
    """
    sizes = {False: etp.etp_size, True: etp.expert_etp_size}
    for weight in weight_inventory(recipe):
        size = sizes[weight.expert]
        if weight.chain is not None and size > 1:
            layout = ShardLayout(weight.shape, size, 0, etp.pad_for_alignment)
            yield weight, layout, layout.shard_rows * layout.cols
        else:
            yield weight, None, weight.numel
