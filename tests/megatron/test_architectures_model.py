"""Published-architecture features on megatron-core GPTModels built on CPU from recipes
(etp.train.model_build): shared experts, QK norm, a head width other than
hidden / heads, grouped-query attention, sigmoid routing with an expert bias and grouped top-k,
dense and MoE layers mixed, tied embeddings.

What ETP shards (dense group, expert group, replicated), and one training step of the
ETP-sharded model on 2 gloo ranks against the unsharded model on both ranks' tokens: loss,
every gradient (shards, and the replicated QK norms, router, shared-expert gate and tied
embedding that ``finalize_grads`` completes) and the expert bias megatron-core updates from
the token counts of both ranks.

megatron-core's router and rotary embedding run on CPU through
``etp.megatron.patches.use_cpu_megatron_core`` ([Note: megatron-core on CPU]), as etp-train's
CPU runs do; the MoE layers use megatron's allgather dispatcher.
"""
import contextlib

import pytest
import torch
from harness import run_distributed

pytest.importorskip("megatron.core")

#: every feature at once, small; the tests below switch features off from it
ALL = dict(num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=24,
           qk_layernorm=True, seq_length=16, vocab_size=256, num_experts=8, moe_router_topk=4,
           moe_ffn_hidden_size=32, ffn_hidden_size=96, moe_layer_freq=[0, 1, 1],
           moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True,
           moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
           moe_router_load_balancing_type="none", moe_router_num_groups=4, moe_router_group_topk=2,
           moe_router_topk_scaling_factor=2.5, moe_grouped_gemm=True, moe_token_dispatcher_type="allgather",
           swiglu=True, add_bias_linear=False, normalization="RMSNorm", position_embedding_type="rope",
           untie_embeddings_and_output_weights=False, hidden_dropout=0.0, attention_dropout=0.0,
           micro_batch_size=2, train_iters=1, lr=1e-3)


def _megatron_on_cpu():
    from etp.megatron import patches

    patches.use_cpu_megatron_core(True)


def _build(values, dtype=torch.float64):
    from etp.recipe import Recipe
    from etp.train.model_build import gpt_model, transformer_config

    recipe = Recipe.from_dict(values)
    config = transformer_config(recipe, torch.device("cpu"))
    config.params_dtype = dtype
    torch.manual_seed(0)
    return recipe, config, gpt_model(recipe, config).to(dtype)  # megatron's torch norms take no dtype


def _roles(ctx, values):
    """name -> "dense" / "expert" / None (replicated) after apply_etp at ETP = world."""
    from megatron.core import parallel_state as ps

    from etp import ETPConfig, ETPShardedParam
    from etp.megatron.model import apply_etp

    _megatron_on_cpu()
    ps.initialize_model_parallel()
    try:
        _, _, model = _build(values, torch.float32)
        apply_etp(model, ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size, pad_for_alignment=8))
        return {name: (("expert" if getattr(p, "is_expert", False) else "dense")
                       if isinstance(p, ETPShardedParam) else None) for name, p in model.named_parameters()}
    finally:
        ps.destroy_model_parallel()


def test_etp_shards_shared_experts_as_dense_weights_and_keeps_the_small_ones_replicated():
    roles = run_distributed(_roles, 2, ALL)[0]
    dense = [f"decoder.layers.{i}.self_attention.{w}.weight" for i in range(3) for w in ("linear_qkv", "linear_proj")]
    dense += ["decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc2.weight"]
    dense += [f"decoder.layers.{i}.mlp.shared_experts.linear_fc{k}.weight" for i in (1, 2) for k in (1, 2)]
    expert = [f"decoder.layers.{i}.mlp.experts.experts.fc{k}_weight" for i in (1, 2) for k in (1, 2)]
    replicated = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]
    replicated += [f"decoder.layers.{i}.self_attention.{n}_layernorm.weight" for i in range(3) for n in ("q", "k")]
    replicated += [f"decoder.layers.{i}.{n}_layernorm.weight" for i in range(3) for n in ("input", "pre_mlp")]
    replicated += [f"decoder.layers.{i}.mlp.{w}" for i in (1, 2) for w in ("router.weight", "shared_experts.gate_weight")]
    assert {n: roles[n] for n in dense} == dict.fromkeys(dense, "dense")
    assert {n: roles[n] for n in expert} == dict.fromkeys(expert, "expert")
    assert {n: roles[n] for n in replicated} == dict.fromkeys(replicated, None)
    # tied: the output layer holds no weight of its own, the embedding serves both ends
    assert not any(n.startswith("output_layer") for n in roles)
    assert set(roles) == set(dense) | set(expert) | set(replicated)


def _grads(model):
    from etp import ETPShardedParam

    out = {}
    for name, p in model.named_parameters():
        grad = getattr(p, "main_grad", None)
        grad = p.grad if grad is None else grad
        out[name] = grad[: p.etp_layout.valid_rows].clone() if isinstance(p, ETPShardedParam) else grad.clone()
    return out


def _step(ctx, values):
    """(loss, grads) of the unsharded model on every rank's tokens, (loss, grads, expert bias) of
    the ETP model on this rank's tokens after finalize_grads, and the reference shard rows."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias

    from etp import ETPConfig, ETPShardedParam, finalize_grads
    from etp.megatron.groups import build_megatron_etp_groups
    from etp.megatron.model import apply_etp

    _megatron_on_cpu()
    ps.initialize_model_parallel()
    try:
        recipe, config, reference = _build(values)
        model = _build(values)[2]  # the same seed: the same weights
        etp = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size, pad_for_alignment=8)
        groups = build_megatron_etp_groups(etp)
        apply_etp(model, etp, groups)
        gen = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, 256, (2, 17), generator=gen) for _ in range(ctx.world_size)]
        positions = torch.arange(16).expand(2, 16)

        def loss_of(module, batch):
            return module(batch[:, :-1], positions, None, labels=batch[:, 1:]).mean()

        ref_loss = sum(loss_of(reference, b) for b in batches) / ctx.world_size  # "mean" over ETP peers
        ref_loss.backward()
        ref_grads = _grads(reference)
        loss = loss_of(model, batches[ctx.rank])
        loss.backward()
        finalize_grads(model, etp, groups)
        grads = _grads(model)
        for name, p in model.named_parameters():  # this rank's rows of the reference gradient
            if isinstance(p, ETPShardedParam):
                ref_grads[name] = p.etp_layout.shard_of(ref_grads[name])[: p.etp_layout.valid_rows]
        counts = [m.local_tokens_per_expert.clone() for m in model.modules() if getattr(m, "expert_bias", None) is not None]
        if config.moe_router_enable_expert_bias:
            _update_router_expert_bias([model], config)  # megatron-core's, over the data-parallel ranks
        biases = [m.expert_bias.clone() for m in model.modules() if getattr(m, "expert_bias", None) is not None]
        return dict(ref_loss=ref_loss.detach(), loss=loss.detach(), ref_grads=ref_grads, grads=grads,
                    counts=counts, biases=biases, rate=recipe.model.moe_router_bias_update_rate)
    finally:
        ps.destroy_model_parallel()


# The plain variant (untied, MHA, softmax routing) is tests/megatron/test_megatron_model.py's parity
# case with this file's set-up: a heavier repeat, in the slow set.
@pytest.mark.parametrize("variant", ["all", pytest.param("untied_mha_softmax", marks=pytest.mark.slow)])
def test_etp_step_matches_the_unsharded_model(variant):
    values = dict(ALL) if variant == "all" else {
        **ALL, "untie_embeddings_and_output_weights": True, "num_query_groups": None, "kv_channels": None,
        "moe_layer_freq": 1, "moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False,
        "moe_router_topk_scaling_factor": None, "moe_shared_expert_gate": False, "qk_layernorm": False}
    results = run_distributed(_step, 2, values)
    losses = torch.stack([r["loss"] for r in results])
    torch.testing.assert_close(losses.mean(), results[0]["ref_loss"], rtol=1e-12, atol=1e-12)
    for r in results:
        assert r["grads"].keys() == r["ref_grads"].keys()
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, r["ref_grads"][name], rtol=1e-9, atol=1e-12, msg=name)
    if variant != "all":
        assert not results[0]["biases"]
        return
    # The expert bias: the same on both ranks, one step of the sign rule on the summed counts.
    assert len(results[0]["biases"]) == 2  # the two MoE layers
    for layer, (mine, theirs) in enumerate(zip(results[0]["biases"], results[1]["biases"])):
        torch.testing.assert_close(mine, theirs)
        total = results[0]["counts"][layer] + results[1]["counts"][layer]
        assert total.sum() == 2 * 2 * 16 * 4  # ranks x micro-batch x tokens x top-k
        expected = torch.sign(total.mean() - total) * results[0]["rate"]
        torch.testing.assert_close(mine.float(), expected.float())


def _tied_copy_roles(ctx):
    """apply_etp on a module holding a last stage's copy of a tied embedding (megatron-core
    marks it shared_embedding) beside an ordinary output layer."""
    from megatron.core import ModelParallelConfig
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from etp import ETPConfig, ETPShardedParam
    from etp.megatron.model import apply_etp

    ps.initialize_model_parallel()
    try:
        config = ModelParallelConfig(use_cpu_initialization=True)
        model = torch.nn.ModuleDict({
            name: ColumnParallelLinear(16, 64, config=config, init_method=torch.nn.init.normal_, bias=False)
            for name in ("copy", "plain")})
        model["copy"].weight.shared_embedding = True
        apply_etp(model, ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size))
        return {name: isinstance(m.weight, ETPShardedParam) for name, m in model.items()}
    finally:
        ps.destroy_model_parallel()


def test_a_tied_embedding_copy_on_another_stage_stays_replicated():
    assert run_distributed(_tied_copy_roles, 2)[0] == {"copy": False, "plain": True}


def _router_counts(ctx):
    """A recipe model with the expert bias, cast to bf16 by Float16Module: the counts' dtype and
    what 300 tokens add up to, before and after fp32_router_counts."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.module import Float16Module

    from etp.megatron.model import fp32_router_counts

    _megatron_on_cpu()
    ps.initialize_model_parallel()
    try:
        _, config, model = _build({**ALL, "bf16": True}, torch.float32)
        wrapped = Float16Module(config, model)
        routers = [m for m in wrapped.modules() if getattr(m, "local_tokens_per_expert", None) is not None]

        def count_300(router):
            router.local_tokens_per_expert.zero_()
            for _ in range(300):
                router.local_tokens_per_expert += torch.ones(8, dtype=torch.int64)
            return router.local_tokens_per_expert[0].item(), router.local_tokens_per_expert.dtype

        before = count_300(routers[0])
        kept = fp32_router_counts(wrapped)
        after = [count_300(r) for r in routers]
        return before, kept, after, [r.expert_bias.dtype for r in routers]
    finally:
        ps.destroy_model_parallel()


def test_expert_bias_counts_stay_exact_under_bf16():
    before, kept, after, bias_dtypes = run_distributed(_router_counts, 1)[0]
    assert before[1] == torch.bfloat16 and before[0] != 300.0  # bf16 rounds past 256: megatron-core's cast
    assert kept == 2 and after == [(300.0, torch.float32)] * 2
    assert set(bias_dtypes) == {torch.bfloat16}  # megatron-core restores the bias itself at its forward


def _fsdp2_step(ctx):
    """Two micro-batches and one step of FSDP2Step on 2 ranks against the unsharded model and
    torch AdamW over both ranks' tokens: loss, grad norm, updated weights, expert bias."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias
    from torch.distributed.tensor import DTensor

    from etp.train.baselines.fsdp2 import FSDP2Step

    _megatron_on_cpu()
    ps.initialize_model_parallel()
    try:
        values = {**ALL, "clip_grad": 0.05, "weight_decay": 0.1, "lr": 1e-2}
        recipe, config, reference = _build(values, torch.float32)
        model = _build(values, torch.float32)[2]
        gen = torch.Generator().manual_seed(1)
        batches = [[torch.randint(0, 256, (2, 17), generator=gen) for _ in range(ctx.world_size)] for _ in range(2)]
        positions = torch.arange(16).expand(2, 16)

        def loss_of(module, batch):
            return module(batch[:, :-1], positions, None, labels=batch[:, 1:]).mean()

        phase = lambda name: contextlib.nullcontext()  # noqa: E731
        # reference: every rank's tokens, the mean over ranks and micro-batches
        t = recipe.train
        decay = [p for n, p in reference.named_parameters() if not (n.endswith(".bias") or p.ndim == 1)]
        rest = [p for n, p in reference.named_parameters() if n.endswith(".bias") or p.ndim == 1]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                                       {"params": rest, "weight_decay": 0.0}], lr=t.lr,
                                      betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
        ref_loss = sum(loss_of(reference, b) for micro in batches for b in micro) / (2 * ctx.world_size)
        ref_loss.backward()
        _update_router_expert_bias([reference], config)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), t.clip_grad)
        optimizer.step()

        step = FSDP2Step(recipe, model, config)
        loss = torch.zeros(())
        for context, micro in zip(step.microbatches(2), batches):
            with context:
                part = loss_of(step.model, micro[ctx.rank]) / 2
                part.backward()
            loss += part.detach()
        norm = step.step(t.lr, phase)
        params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                  for n, p in step.model.named_parameters()}
        biases = [m.expert_bias.clone() for m in step.model.modules() if getattr(m, "expert_bias", None) is not None]
        ref_biases = [m.expert_bias.clone() for m in reference.modules() if getattr(m, "expert_bias", None) is not None]
        return dict(loss=loss, ref_loss=ref_loss.detach(), norm=norm.detach(), ref_norm=ref_norm.detach(),
                    params=params, ref_params={n: p.detach().clone() for n, p in reference.named_parameters()},
                    biases=biases, ref_biases=ref_biases, sharded=any(isinstance(p, DTensor) for p in model.parameters()))
    finally:
        ps.destroy_model_parallel()


@pytest.mark.slow  # FSDP2's parity runs by default in tests/train/test_fsdp2_train.py; this adds every feature
def test_fsdp2_step_trains_like_the_unsharded_model():
    results = run_distributed(_fsdp2_step, 2)
    torch.testing.assert_close(results[0]["loss"] + results[1]["loss"], 2 * results[0]["ref_loss"], rtol=1e-5, atol=1e-6)
    for r in results:
        assert r["sharded"]
        torch.testing.assert_close(r["norm"], r["ref_norm"], rtol=1e-4, atol=1e-6)
        assert r["norm"] > 0.05  # the clip acted
        assert r["params"].keys() == r["ref_params"].keys()
        for name, value in r["params"].items():
            torch.testing.assert_close(value, r["ref_params"][name], rtol=1e-4, atol=1e-5, msg=name)
        assert len(r["biases"]) == 2
        for mine, ref in zip(r["biases"], r["ref_biases"]):
            torch.testing.assert_close(mine, ref)
