"""apply_etp on CPU-built megatron-core GPTModels (SequentialMLP experts and etp's grouped
experts): which parameters are sharded, preserved attributes, shard shapes; and the grouped
experts module against a per-expert float64 reference with router probabilities."""
import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed

pytest.importorskip("megatron.core")


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                use_cpu_initialization=True, gated_linear_unit=True, add_bias_linear=False,
                moe_token_dispatcher_type="allgather", activation_func=F.silu)
    return TransformerConfig(**{**base, **kw})


def _gpt(ctx, grouped: bool):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from etp import ETPConfig, ETPShardedParam
    from etp.megatron.model import apply_etp, etp_gpt_layer_spec

    ps.initialize_model_parallel()
    try:
        torch.manual_seed(0)
        spec = etp_gpt_layer_spec(num_experts=4) if grouped else get_gpt_layer_local_spec(num_experts=4)
        model = GPTModel(config=_config(), transformer_layer_spec=spec, vocab_size=256,
                         max_sequence_length=64, share_embeddings_and_output_weights=False)
        before = {n: (tuple(p.shape), dict(vars(p))) for n, p in model.named_parameters()}
        summary = apply_etp(model, ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size,
                                             pad_for_alignment=8))
        sharded, replicated = {}, []
        for name, p in model.named_parameters():
            shape, attrs = before[name]
            if isinstance(p, ETPShardedParam):
                assert p.logical_shape == shape
                assert p.shape[0] == p.etp_layout.shard_rows and p.shape[1] == shape[-1]
                for key, value in attrs.items():  # megatron's attributes survive
                    assert getattr(p, key) == value, (name, key)
                sharded[name] = bool(getattr(p, "is_expert", False))
            else:
                replicated.append(name)
        return sharded, replicated, summary.bytes_before, summary.bytes_after
    finally:
        ps.destroy_model_parallel()


def _gpt_both(ctx):
    """SequentialMLP and ETPGroupedExperts models in the same ranks (one spawn, not two)."""
    return [_gpt(ctx, grouped) for grouped in (False, True)]


def test_apply_etp_shards_linears_and_experts():
    for grouped, result in zip((False, True), run_distributed(_gpt_both, 2)[0]):
        _check_apply_etp(grouped, *result)


def _check_apply_etp(grouped, sharded, replicated, before, after):
    layer = "decoder.layers.0."
    assert sharded[layer + "self_attention.linear_qkv.weight"] is False
    assert sharded[layer + "self_attention.linear_proj.weight"] is False
    assert sharded["output_layer.weight"] is False
    if grouped:
        assert sharded[layer + "mlp.experts.experts.fc1_weight"] is True
        assert sharded[layer + "mlp.experts.experts.fc2_weight"] is True
    else:
        assert all(sharded[layer + f"mlp.experts.local_experts.{e}.linear_fc{k}.weight"]
                   for e in range(4) for k in (1, 2))
    for name in ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
                 layer + "mlp.router.weight", layer + "input_layernorm.weight",
                 "decoder.final_layernorm.weight"):
        assert name in replicated
    assert after < 0.7 * before


def _grouped_experts_parity(ctx):
    from megatron.core import parallel_state as ps

    from etp import ETPConfig
    from etp.megatron.model import ETPGroupedExperts, apply_etp

    ps.initialize_model_parallel()
    try:
        torch.manual_seed(0)
        experts = ETPGroupedExperts(4, _config(params_dtype=torch.float64, init_method_std=0.3))
        fc1 = experts.experts.fc1_weight.detach().clone()
        fc2 = experts.experts.fc2_weight.detach().clone()
        apply_etp(experts, ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size))
        gen = torch.Generator().manual_seed(ctx.rank)
        counts = torch.tensor([3, 0, 5, 2])
        x = torch.randn(10, 64, generator=gen, dtype=torch.float64)
        probs = torch.rand(10, generator=gen, dtype=torch.float64)
        out, bias = experts(x, counts, probs)
        # Reference: megatron's SwiGLU expert with probabilities applied before fc2.
        ref = []
        for e, (xe, pe) in enumerate(zip(torch.split(x, counts.tolist()), torch.split(probs, counts.tolist()))):
            gate, up = (xe @ fc1[e].t()).chunk(2, dim=-1)
            ref.append((F.silu(gate) * up * pe[:, None]) @ fc2[e].t())
        assert bias is None
        torch.testing.assert_close(out, torch.cat(ref), rtol=1e-12, atol=1e-12)
        return True
    finally:
        ps.destroy_model_parallel()


def test_grouped_experts_match_reference_with_probs():
    assert run_distributed(_grouped_experts_parity, 2) == [True, True]


def test_grouped_experts_reject_unsupported_configs():
    from etp.megatron.model import ETPGroupedExperts

    with pytest.raises(ValueError, match="add_bias_linear=False"):
        ETPGroupedExperts(4, _config(add_bias_linear=True))
    with pytest.raises(ValueError, match="gated_linear_unit=True"):
        ETPGroupedExperts(4, _config(gated_linear_unit=False))
