"""The model a recipe describes.

One model on CPU and GPU: megatron-core's ``GPTModel`` with etp's layer spec (grouped experts,
SDPA attention; ``etp.megatron.model.etp_gpt_decoder_spec``), bf16 through ``Float16Module``
when the recipe says ``bf16: true`` (fp32 for ``use_torch_fsdp2``, whose gathers cast to bf16),
with etp's or megatron's token dispatcher. On CPU ranks (gloo) megatron-core's few CUDA-only
places run on the CPU ([Note: megatron-core on CPU] in ``etp.megatron.patches``): every recipe
key builds the same modules there, so the CPU suite trains the model GPUs train.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["build_model", "gpt_model", "language_model_loss", "scale_router_losses", "transformer_config"]


def build_model(recipe, device):
    """(model, ``loss_fn(module, batch)`` of an ``etp.data.batch.Batch`` (or a [b, s+1] token
    batch), its ``TransformerConfig``): megatron-core's ``GPTModel`` of the recipe on ``device``,
    CPU or GPU.

    ``loss_fn`` returns (the language-model loss to report, the objective to differentiate).

    Example::

        model, loss_fn, config = build_model(recipe, torch.device("cuda"))
    """
    from megatron.core.transformer.module import Float16Module

    from etp.megatron import patches

    m = recipe.model
    cpu = device.type == "cpu"
    # megatron-core's few CUDA-only places, made to run on CPU ranks ([Note: megatron-core on CPU]).
    patches.use_cpu_megatron_core(cpu)
    patches.use_te_free_router()
    if not cpu:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(recipe.train.seed)
    torch.manual_seed(recipe.train.seed)
    # The model's arithmetic, the same bits either way: every system etp-train runs gets it.
    patches.use_fused_rope(recipe.train.megatron_fallbacks == "fast")
    config = transformer_config(recipe, device)
    model = gpt_model(recipe, config).to(device)
    if m.is_moe:
        import torch.distributed as dist

        scale_router_losses(recipe, dist.get_world_size() if dist.is_initialized() else 1, device)
    if m.moe_token_dispatcher_type == "local":
        from etp.megatron.local_dispatcher import install_local_dispatchers

        install_local_dispatchers(model)
    elif m.moe_token_dispatcher_type == "etp":
        from etp.megatron.ep_dispatcher import install_etp_dispatchers

        install_etp_dispatchers(model, max_tokens_per_rank=m.seq_length * recipe.train.micro_batch_size,
                                capturable=recipe.train.cuda_graph == "step")
    if recipe.train.bf16 and not recipe.parallel.use_torch_fsdp2:  # FSDP2 gathers fp32 masters in bf16 itself
        from etp.megatron.model import fp32_router_counts

        model = Float16Module(config, model)
        fp32_router_counts(model)  # the expert bias's token counts, exact
    return model, language_model_loss, config



def language_model_loss(module, batch):
    """(the next-token loss of a batch, the objective to differentiate): the one place
    etp-train calls its model. ``batch`` is an ``etp.data.batch.Batch`` (tokens, labels, loss
    mask, per-document attention mask, positions) or a [b, s+1] token tensor; the loss is
    Megatron-LM's mean over the tokens the loss mask keeps. megatron-core adds the router's
    auxiliary and z-losses to the gradient itself (``scale_router_losses``), so the two are the
    same tensor.

    Example::

        loss, objective = language_model_loss(model, batch)
        objective.backward()
    """
    from etp.data.batch import as_batch
    from etp.megatron.cross_entropy import masked_token_mean

    batch = as_batch(batch)
    per_token = module(batch.tokens, batch.positions(), batch.attention_mask, labels=batch.labels)
    loss = masked_token_mean(per_token, batch.loss_mask)
    return loss, loss


def transformer_config(recipe, device):
    """megatron-core's ``TransformerConfig`` of a recipe (Megatron-LM names pass through;
    CPU initialization on a CPU ``device``).

    Example::

        config = transformer_config(recipe, torch.device("cuda"))
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    from etp.megatron.compat import whole_layer_cuda_graphs

    m, p = recipe.model, recipe.parallel
    # FSDP2 shards fp32 master weights and casts them to bf16 as it gathers them (FSDP2Step).
    dtype = torch.bfloat16 if recipe.train.bf16 and not p.use_torch_fsdp2 else torch.float32
    freq = m.moe_layer_freq if isinstance(m.moe_layer_freq, int) else list(m.moe_layer_freq)
    return TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups, kv_channels=m.kv_channels, qk_layernorm=m.qk_layernorm,
        ffn_hidden_size=m.ffn_hidden_size, num_moe_experts=m.num_experts, moe_layer_freq=freq,
        moe_router_topk=m.moe_router_topk, moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        moe_aux_loss_coeff=m.moe_aux_loss_coeff, moe_router_load_balancing_type=m.moe_router_load_balancing_type,
        moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=m.moe_shared_expert_gate, moe_router_score_function=m.moe_router_score_function,
        moe_router_pre_softmax=m.moe_router_pre_softmax,
        moe_router_topk_scaling_factor=m.moe_router_topk_scaling_factor,
        moe_router_enable_expert_bias=m.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=m.moe_router_bias_update_rate, moe_router_num_groups=m.moe_router_num_groups,
        moe_router_group_topk=m.moe_router_group_topk, moe_z_loss_coeff=m.moe_z_loss_coeff,
        # "local" and "etp" are etp's own: megatron builds its alltoall dispatcher, replaced below.
        moe_token_dispatcher_type=("alltoall" if m.moe_token_dispatcher_type in ("local", "etp")
                                   else m.moe_token_dispatcher_type),
        gated_linear_unit=m.swiglu, activation_func=F.silu if m.swiglu else F.gelu,
        add_bias_linear=m.add_bias_linear, normalization=m.normalization, layernorm_epsilon=m.norm_epsilon,
        init_method_std=m.init_method_std, hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout, bf16=recipe.train.bf16, params_dtype=dtype,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tensor_parallel_size,
        sequence_parallel=p.sequence_parallel, use_cpu_initialization=device.type == "cpu",
        deterministic_mode=recipe.train.deterministic,
        **whole_layer_cuda_graphs(),  # megatron-core's default, without its deprecation warning
        **recipe.recompute_kwargs(),
    )


def gpt_model(recipe, config):
    """megatron-core's ``GPTModel`` of a recipe and its ``TransformerConfig``: etp's decoder spec
    (``etp_gpt_decoder_spec``: grouped experts with ``moe_grouped_gemm``, else megatron-core's
    ``SequentialMLP``; SDPA attention, QK norm per head or over the whole query and key
    (``etp.megatron.qk_norm``), dense and MoE layers), the recipe's RoPE base,
    tied or untied embeddings, and etp's language-model loss (``use_vocab_cross_entropy``).
    Unsharded, on the device ``config`` initializes on.

    Example::

        model = gpt_model(recipe, transformer_config(recipe, torch.device("cpu")))
    """
    from megatron.core.models.gpt import GPTModel

    from etp.megatron.cross_entropy import use_vocab_cross_entropy
    from etp.megatron.model import etp_gpt_decoder_spec

    m = recipe.model
    spec = etp_gpt_decoder_spec(config, normalization=m.normalization, attention_backend=m.attention_backend,
                                grouped_experts=m.moe_grouped_gemm)
    if m.qk_layernorm and m.qk_layernorm_width == "full":
        from etp.megatron.qk_norm import use_full_width_qk_norm

        use_full_width_qk_norm(spec)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=recipe.padded_vocab_size,
                     max_sequence_length=m.max_position_embeddings or m.seq_length,
                     position_embedding_type=m.position_embedding_type, rotary_base=m.rotary_base,
                     share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights)
    use_vocab_cross_entropy(model)  # the 16-bit logits kept for backward, not an fp32 softmax
    return model


def scale_router_losses(recipe, world_size: int, device) -> float:
    """Scales the gradients of the router's auxiliary and z-losses like the language-model loss's:
    by 1 / micro-batches per step. etp-train divides each micro-batch's loss by their count;
    megatron-core's router losses reach backward through ``MoEAuxLossAutoScaler``, whose scale
    megatron-core's own schedules set to the same 1 / count (its default, 1, would weigh the
    router losses count times too much). Returns the scale.

    Example::

        scale_router_losses(recipe, world_size=4, device=torch.device("cuda"))   # 0.25 with 4 micro-batches
    """
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    scale = 1.0 / recipe.num_microbatches(world_size)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale, device=device))
    return scale
