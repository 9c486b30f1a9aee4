"""ETP for megatron-core models: grouped experts for ``MoELayer`` and ``apply_etp``.

``ETPGroupedExperts`` is a megatron-core experts module (the ``experts`` submodule of
``MoELayer``) computed with ``torch._grouped_mm`` through ``etp.GroupedSwiGLUExperts``: no
``grouped_gemm`` or TransformerEngine package needed. ``apply_etp`` shards a built model's
attention and MLP linears (``ColumnParallelLinear`` / ``RowParallelLinear``, composed with
TP), ``SequentialMLP`` experts and ``ETPGroupedExperts``; norms, biases, routers and
embeddings stay replicated.
"""
from __future__ import annotations

import torch

from ..config import ETPConfig
from ..groups import ETPGroups
from ..modules import GroupedSwiGLUExperts
from ..streams import to_device_async
from ..wrap import WrapSummary, wrap_module_params_etp
from .compat import spec_submodules
from .groups import build_megatron_etp_groups
from .local_dispatcher import regathered_rows
from .patches import use_te_free_router

__all__ = ["ETPGroupedExperts", "apply_etp", "etp_gpt_decoder_spec", "etp_gpt_layer_spec", "fp32_router_counts"]


def _megatron_module():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class ETPGroupedExperts(_megatron_module()):
    """megatron-core ``MoELayer`` experts as one stacked SwiGLU weight pair.

    Same constructor and forward contract as megatron-core's ``GroupedMLP``:
    ``forward(permuted_hidden [T, hidden], tokens_per_expert [E], permuted_probs [T])`` returns
    ``(output [T, hidden], None)``. Needs ``gated_linear_unit=True`` with SiLU, no linear
    biases, and expert tensor parallelism 1 (ETP shards the experts instead).

    Example::

        spec = etp_gpt_layer_spec(num_experts=64)
        model = GPTModel(config=config, transformer_layer_spec=spec, ...)
    """

    def __init__(self, num_local_experts: int, config, pg_collection=None, submodules=None, name=None):
        super().__init__(config=config)
        if not config.gated_linear_unit or config.activation_func is not torch.nn.functional.silu:
            raise ValueError(
                "ETPGroupedExperts computes SwiGLU experts: set gated_linear_unit=True and "
                "activation_func=torch.nn.functional.silu in the TransformerConfig"
            )
        if config.add_bias_linear:
            raise ValueError("ETPGroupedExperts has no biases: set add_bias_linear=False")
        if (config.expert_tensor_parallel_size or 1) != 1:
            raise ValueError(
                f"expert_tensor_parallel_size={config.expert_tensor_parallel_size}: ETPGroupedExperts "
                "needs 1 (shard experts with expert_etp_size instead)"
            )
        ffn = config.moe_ffn_hidden_size or config.ffn_hidden_size
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        self.num_local_experts = num_local_experts
        # megatron-core's MoELayer gives expert-parallel rank r the experts from r * local on.
        from megatron.core.utils import get_pg_rank

        ep_rank = get_pg_rank(pg_collection.ep if pg_collection is not None else None)
        self.experts = GroupedSwiGLUExperts(
            num_local_experts, config.hidden_size, ffn, dtype=config.params_dtype,
            device=device, init_std=config.init_method_std, first_expert=ep_rank * num_local_experts,
        )

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        counts = tokens_per_expert.to(torch.int64)
        device = permuted_local_hidden_states.device
        if counts.device != device:
            # megatron's dispatchers hand the counts over on the host. The grouped GEMMs need
            # them on the device (their offsets): one copy from pinned memory here, which does
            # not wait for the GPU, instead of a blocking copy in each of the six GEMMs.
            counts = to_device_async(counts, device)
        # With etp's local dispatcher the permuted input is kept as the layer's input and row
        # indices, not as K copies ([Note: local dispatcher]).
        with regathered_rows(permuted_local_hidden_states):
            out = self.experts(permuted_local_hidden_states, counts, permuted_probs)
        return out, None


def etp_gpt_layer_spec(num_experts: int | None = None, attention_backend: str = "sdpa",
                       grouped_experts: bool = True, **kwargs):
    """megatron-core's local GPT layer spec with ``ETPGroupedExperts`` as the MoE experts
    (``grouped_experts=False`` keeps megatron-core's ``SequentialMLP``: one linear pair per
    expert, what a recipe's ``moe_grouped_gemm: false`` asks for) and,
    with ``attention_backend="sdpa"`` (the default), ``etp.megatron.attention.SDPAttention`` as
    the core attention (torch's fused SDPA kernels; ``"local"`` keeps megatron-core's
    ``DotProductAttention``, which materializes the score matrix). Both hold no parameters:
    the state-dict keys are the same either way.

    Example::

        spec = etp_gpt_layer_spec(num_experts=8, normalization="RMSNorm", attention_backend="sdpa")
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    from .attention import ATTENTION_BACKENDS, SDPAttention

    if attention_backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={attention_backend!r}: expected one of {ATTENTION_BACKENDS}")
    spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False, **kwargs)
    if attention_backend == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = ModuleSpec(module=SDPAttention)
    if num_experts and grouped_experts:
        spec_submodules(spec.submodules.mlp).experts = ModuleSpec(module=ETPGroupedExperts)
    return spec


def etp_gpt_decoder_spec(config, normalization: str | None = None, attention_backend: str = "sdpa",
                         grouped_experts: bool = True):
    """The decoder of a ``TransformerConfig``: ``etp_gpt_layer_spec`` for every layer (QK norm
    from ``config.qk_layernorm``) when all layers are alike, else megatron-core's
    ``TransformerBlockSubmodules`` of dense and MoE layer specs following
    ``config.moe_layer_freq`` (megatron-core's ``get_gpt_decoder_block_spec`` rule), sliced to
    this pipeline stage. Either is ``GPTModel``'s ``transformer_layer_spec``.

    Example::

        config = TransformerConfig(..., num_moe_experts=8, moe_layer_freq=[0, 1, 1, 1])
        model = GPTModel(config=config, transformer_layer_spec=etp_gpt_decoder_spec(config, "RMSNorm"), ...)
    """
    from megatron.core.transformer.transformer_block import (
        LayerNormImpl,
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    def layer(experts):
        return etp_gpt_layer_spec(num_experts=experts, normalization=normalization, attention_backend=attention_backend,
                                  grouped_experts=grouped_experts, qk_layernorm=config.qk_layernorm)

    experts, freq = config.num_moe_experts, config.moe_layer_freq
    if not experts or freq == 1:
        return layer(experts)
    pattern = [int(i % freq == 0) for i in range(config.num_layers)] if isinstance(freq, int) else list(freq)
    if len(pattern) != config.num_layers or set(pattern) - {0, 1}:
        raise ValueError(f"moe_layer_freq={freq!r}: expected an integer or one 0 / 1 per layer "
                         f"({config.num_layers} layers)")
    dense, moe = layer(None), layer(experts)
    offset = get_transformer_layer_offset(config)
    stage = pattern[offset: offset + get_num_layers_to_build(config)]
    return TransformerBlockSubmodules(layer_specs=[moe if p else dense for p in stage], layer_norm=LayerNormImpl)


def fp32_router_counts(model: torch.nn.Module) -> int:
    """Keeps the token counts behind megatron-core's expert bias (``moe_router_enable_expert_bias``)
    in float32 after ``Float16Module`` cast every buffer to bf16 / fp16; returns how many.

    megatron-core 0.16 keeps the bias itself in float32 but not ``local_tokens_per_expert``: in
    bf16 a count above 256 is rounded to a multiple of 2 or more (above 2048, of 16), and the bias
    step is the sign of (mean count - count), so experts near the mean would step the wrong way.
    Call it once after the cast, before any capture (the buffer keeps its address afterwards).

    Example::

        model = Float16Module(config, gpt_model)
        fp32_router_counts(model)
    """
    kept = 0
    for module in model.modules():
        counts = getattr(module, "local_tokens_per_expert", None)
        if isinstance(counts, torch.Tensor) and counts.dtype != torch.float32:
            module.local_tokens_per_expert = counts.float()  # a registered buffer: replaced in place
            kept += 1
    return kept


def apply_etp(model: torch.nn.Module, config: ETPConfig, groups: ETPGroups | None = None) -> WrapSummary:
    """Shards a built megatron-core model in place (every rank calls it, after
    ``parallel_state.initialize_model_parallel``, before DDP wrapping).

    Routed-expert weights (``SequentialMLP`` and ``ETPGroupedExperts``) shard over the
    expert ETP group; everything else over the dense one, shared experts included (megatron-core's
    ``SharedExpertMLP`` is a dense MLP every token passes).

    Tied embedding / output weights stay replicated ([Note: tied embeddings under ETP]).

    Example::

        model = GPTModel(...)
        summary = apply_etp(model, ETPConfig(etp_size=8, expert_etp_size=8))
    """
    from megatron.core.transformer.moe.experts import SequentialMLP

    use_te_free_router()
    if groups is None:
        groups = build_megatron_etp_groups(config)
    for module in model.modules():
        if isinstance(module, (SequentialMLP, ETPGroupedExperts)):
            # With EP = 1 megatron-core leaves expert weights marked allreduce=True, like dense
            # ones; ETP still needs to know they are experts to pick the expert group.
            for param in module.parameters():
                param.is_expert = True
    return wrap_module_params_etp(model, config, groups, filter_fn=_not_a_tied_copy)


def _not_a_tied_copy(name: str, module: torch.nn.Module) -> bool:
    """False for a layer whose weight is a tied embedding's copy on another pipeline stage
    (megatron-core marks it ``shared_embedding``).

    [Note: tied embeddings under ETP]
    With ``share_embeddings_and_output_weights`` on one pipeline stage megatron-core's output
    layer allocates no weight: ``GPTModel`` passes the embedding's own table to it at every call,
    and ETP, which wraps layers holding weights, leaves it alone; the table is replicated like
    every embedding, read twice per step (lookup and logits), its gradient the sum of both uses,
    completed over the ETP group by ``finalize_grads`` like any replicated parameter. Across
    pipeline stages the last stage keeps a copy (``shared_embedding``) whose gradient
    megatron-core all-reduces with the first stage's embedding: both must stay full, so that
    layer is not sharded either. Sharding the tied table instead would need one gather used by
    two consumers per step (DESIGN.md hazard 7) for a weight that tied models keep small.
    """
    weight = getattr(module, "weight", None)
    return not (weight is not None and getattr(weight, "shared_embedding", False))
