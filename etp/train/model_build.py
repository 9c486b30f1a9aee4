"""The model a recipe describes, and its learning-rate schedule.

On CPU: etp's ``TinyMoELM`` (megatron-core TP linears, etp grouped experts). On GPUs:
megatron-core's ``GPTModel`` with etp's grouped experts and attention (bf16 through
``Float16Module`` when the recipe says ``bf16: true``, fp32 for ``use_torch_fsdp2``, whose
gathers cast to bf16), with etp's or megatron's token dispatcher.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["build_model", "cpu_model_gaps", "gpt_model", "learning_rate", "scale_router_losses", "transformer_config"]

#: architecture keys and the value the CPU driver's TinyMoELM models (None: hidden / heads)
_TINY_MODELS = {"kv_channels": None, "qk_layernorm": False, "moe_layer_freq": 1,
                "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False,
                "moe_router_score_function": "softmax", "moe_router_pre_softmax": False,
                "moe_router_topk_scaling_factor": None, "moe_router_enable_expert_bias": False,
                "moe_router_num_groups": None, "moe_router_group_topk": None, "moe_z_loss_coeff": None}


def cpu_model_gaps(recipe) -> list[str]:
    """The recipe's architecture keys (``key=value``) that the CPU driver's ``TinyMoELM`` does
    not model (megatron-core's router and dispatchers need CUDA, so without GPUs etp-train trains
    that model): ``build_model`` refuses such a recipe on CPU rather than train another model.

    Example::

        cpu_model_gaps(Recipe.from_yaml("recipes/qwen3_30b_a3b.yaml"))   # ['kv_channels=128', ...]
    """
    m = recipe.model
    found = []
    for key, value in _TINY_MODELS.items():
        got = getattr(m, key)
        if key == "kv_channels":
            value = m.hidden_size // m.num_attention_heads if m.hidden_size % m.num_attention_heads == 0 else None
        if got != value:
            found.append(f"{key}={list(got) if isinstance(got, tuple) else got}")
    return found


def learning_rate(recipe, iteration: int) -> float:
    """The recipe's learning rate at ``iteration`` (linear warm-up, then its decay style)."""
    t = recipe.train
    if t.lr_warmup_iters and iteration < t.lr_warmup_iters:
        return t.lr * (iteration + 1) / t.lr_warmup_iters
    span = max(1, (t.lr_decay_iters or t.train_iters) - t.lr_warmup_iters)
    progress = min(1.0, (iteration - t.lr_warmup_iters) / span)
    if t.lr_decay_style == "constant":
        return t.lr
    if t.lr_decay_style == "cosine":
        return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))
    return t.lr - (t.lr - t.min_lr) * progress  # linear (and the rest, approximately)


def build_model(recipe, device):
    """(model, ``loss_fn(module, batch)`` of an ``etp.data.batch.Batch`` (or a [b, s+1] token
    batch), megatron config or None).

    ``loss_fn`` returns (the language-model loss to report, the objective to differentiate).

    Example::

        model, loss_fn, config = build_model(recipe, torch.device("cuda"))
    """
    from etp.data.batch import as_batch
    from etp.megatron.cross_entropy import masked_token_mean

    m = recipe.model
    if device.type == "cpu":
        from etp.megatron.tiny_lm import TinyMoELM

        gaps = cpu_model_gaps(recipe)
        if gaps:
            raise ValueError(f"the CPU driver trains etp's TinyMoELM, which does not model {', '.join(gaps)}: run "
                             "this recipe on GPUs under torchrun (or remove those keys for a CPU run)")
        torch.manual_seed(recipe.train.seed)
        model = TinyMoELM(recipe)

        def loss_fn(module, batch):
            batch = as_batch(batch)  # etp.data.batch.Batch: tokens, labels, loss / attention masks, positions
            logits = module(batch.tokens, batch.attention_mask, batch.position_ids)
            flat = logits.float().reshape(-1, logits.shape[-1]), batch.labels.reshape(-1)
            loss = (F.cross_entropy(*flat) if batch.loss_mask is None else
                    masked_token_mean(F.cross_entropy(*flat, reduction="none"), batch.loss_mask))
            return loss, loss + m.moe_aux_loss_coeff * module.aux_loss()

        return model, loss_fn, None
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    from etp.megatron import patches

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

    def loss_fn(module, batch):
        batch = as_batch(batch)  # etp.data.batch.Batch: tokens, labels, loss / attention masks, positions
        per_token = module(batch.tokens, batch.positions(), batch.attention_mask, labels=batch.labels)
        loss = masked_token_mean(per_token, batch.loss_mask)
        return loss, loss  # megatron adds the router's aux loss to the gradient itself

    return model, loss_fn, config


def transformer_config(recipe, device):
    """megatron-core's ``TransformerConfig`` of a recipe (Megatron-LM names pass through;
    CPU initialization on a CPU ``device``).

    Example::

        config = transformer_config(recipe, torch.device("cuda"))
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

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
        add_bias_linear=m.add_bias_linear, normalization=m.normalization,
        init_method_std=m.init_method_std, hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout, bf16=recipe.train.bf16, params_dtype=dtype,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        sequence_parallel=p.sequence_parallel, use_cpu_initialization=device.type == "cpu",
        deterministic_mode=recipe.train.deterministic, **recipe.recompute_kwargs(),
    )


def gpt_model(recipe, config):
    """megatron-core's ``GPTModel`` of a recipe and its ``TransformerConfig``: etp's decoder spec
    (``etp_gpt_decoder_spec``: grouped experts with ``moe_grouped_gemm``, else megatron-core's
    ``SequentialMLP``; SDPA attention, QK norm, dense and MoE layers),
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
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=recipe.padded_vocab_size,
                     max_sequence_length=m.max_position_embeddings or m.seq_length,
                     position_embedding_type=m.position_embedding_type,
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
