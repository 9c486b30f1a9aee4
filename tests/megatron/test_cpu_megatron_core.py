"""etp.megatron.patches.use_cpu_megatron_core ([Note: megatron-core on CPU]): the bindings are
idempotent and go back to megatron-core's own; with them megatron-core's own rotary embedding
and router run on CPU (against float64 formulas); and the megatron-core paths a recipe key picks
on CPU — the alltoall dispatcher over two expert-parallel ranks, local attention, full
recompute — train the same model as the paths that never needed CUDA (the allgather dispatcher,
SDPA attention, no recompute): same loss, same gradients."""
from pathlib import Path

import pytest
import torch
from harness import run_distributed

pytest.importorskip("megatron.core")
from megatron.core.fusions import fused_softmax  # noqa: E402
from megatron.core.tensor_parallel import random as megatron_random  # noqa: E402
from megatron.core.transformer.moe import router, token_dispatcher  # noqa: E402

from etp.megatron import patches  # noqa: E402

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny_moe_cpu.yaml"


def _bound():
    """What the patch rebinds, as found now."""
    return [router.Router.__dict__["gating"], router.TopKRouter.__dict__["__init__"],
            fused_softmax.get_default_causal_mask, megatron_random._get_cuda_rng_state,
            megatron_random.CudaRNGStatesTracker.__dict__["fork"],
            token_dispatcher.MoEAlltoAllTokenDispatcher.__dict__["_maybe_dtoh_and_synchronize"],
            token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream]


def test_bindings_are_idempotent_and_go_back():
    was_on = bool(patches._CPU_ORIGINALS)
    try:
        patches.use_cpu_megatron_core(False)
        megatrons = _bound()
        assert patches.use_cpu_megatron_core(True) is True
        ours = _bound()
        assert all(a is not b for a, b in zip(ours, megatrons))
        assert router.Router.gating.__wrapped__ is megatrons[0]  # megatron-core's own code, run on CPU
        assert patches.use_cpu_megatron_core(True) is False and _bound() == ours  # idempotent
        assert patches.use_cpu_megatron_core(False) is True
        assert all(a is b for a, b in zip(_bound(), megatrons))
        assert patches.use_cpu_megatron_core(False) is False
    finally:
        patches.use_cpu_megatron_core(was_on)


@pytest.mark.parametrize("base", [10000, 500000])
def test_megatron_rotary_embedding_runs_on_cpu(base):
    """megatron-core's RotaryEmbedding (its own rotary base, not a fixed 10000) against the
    float64 formula: angle(position p, pair i) = p / base^(2i / d), both halves."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    patches.use_cpu_megatron_core(True)
    rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=base, use_cpu_initialization=True)
    emb = rope.get_emb(12)
    inv = 1.0 / base ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    angles = torch.outer(torch.arange(12, dtype=torch.float64), inv)
    assert emb.device.type == "cpu" and emb.shape == (12, 1, 1, 16)
    torch.testing.assert_close(emb[:, 0, 0].double(), torch.cat((angles, angles), dim=-1), rtol=1e-6, atol=0)


def _recipe(**overrides):
    from etp.recipe import Recipe

    base = dict(world_size=2, micro_batch_size=2, global_batch_size=4, expert_model_parallel_size=2,
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                etp={"etp_size": 1, "expert_etp_size": 1})
    return Recipe.from_yaml(TINY, **{**base, **overrides})


def _loss_and_grads(recipe, batch):
    from etp.train.model_build import build_model

    model, loss_fn, _ = build_model(recipe, torch.device("cpu"))
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    loss, objective = loss_fn(model, batch)
    objective.backward()
    routers = [m for m in model.modules() if getattr(m, "expert_bias", None) is not None]
    return dict(loss=loss.detach(), weights=weights, grads={n: p.grad.clone() for n, p in model.named_parameters()},
                counts=[r.local_tokens_per_expert.clone() for r in routers], router_weight=routers[0].weight.device.type)


def _variants(ctx):
    """Expert parallelism 2 over both ranks: the model through the paths that never needed CUDA,
    then through each path the patch makes run on CPU."""
    from megatron.core import parallel_state as ps

    from etp.train.batches import Batches

    ps.initialize_model_parallel(expert_model_parallel_size=2)
    try:
        batch = Batches(_recipe(), ps.get_data_parallel_rank(), torch.device("cpu"), 1).get(0, 0)
        found = {"reference": _loss_and_grads(_recipe(), batch)}
        for name, overrides in (("alltoall", {"moe_token_dispatcher_type": "alltoall"}),
                                ("local_attention", {"attention_backend": "local"}),
                                ("full_recompute", {"recompute_granularity": "full", "recompute_method": "uniform",
                                                    "recompute_num_layers": 1})):
            found[name] = _loss_and_grads(_recipe(**overrides), batch)
        return found
    finally:
        ps.destroy_model_parallel()


def test_cpu_paths_train_the_same_model():
    for rank in run_distributed(_variants, 2):
        reference = rank.pop("reference")
        assert reference["router_weight"] == "cpu" and sum(c.sum() for c in reference["counts"]) > 0
        for name, found in rank.items():
            assert found["weights"].keys() == reference["weights"].keys()
            for key, weight in found["weights"].items():  # the same model: the same initial weights
                assert torch.equal(weight, reference["weights"][key]), (name, key)
            torch.testing.assert_close(found["loss"], reference["loss"], rtol=1e-6, atol=0, msg=name)
            for key, grad in found["grads"].items():
                torch.testing.assert_close(grad, reference["grads"][key], rtol=1e-4, atol=1e-7, msg=f"{name}: {key}")
            for mine, theirs in zip(found["counts"], reference["counts"]):
                assert torch.equal(mine, theirs), name
