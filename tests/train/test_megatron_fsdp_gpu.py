"""GPU (NCCL, 2 or 4 GPUs): etp-train's Megatron-FSDP peer (``use_megatron_fsdp``,
``MegatronFSDPStep``) against the same recipe under plain megatron-core DDP (ETP off,
``MegatronStep``), step by step, on a small MoE GPTModel with QK norm, etp's grouped experts and
local dispatcher.

Both start from the same weights and read the same batches; two micro-batches per step exercise
Megatron-FSDP's per-micro-batch reduce-scatter into the gradient shards, and ``clip_grad`` is low
enough that every step clips, so a grad norm that missed shards or counted them twice would change
the updates and the losses. What may differ is the order of floating-point sums (reduce-scatter
against all-reduce, the norm over shards): within 1e-3 in fp32, within bf16's rounding of the
weights after each step in bf16. ``megatron_fallbacks: stock`` runs megatron-core's own step and
helpers; ``fast`` etp's sync-free step and fused torch Adam over Megatron-FSDP's DTensor shards.

Run with ``ETP_TEST_BACKEND=nccl`` on a machine with 2 or more GPUs (4 are used when present, the
einops package installed); skipped otherwise.
"""
import json
from pathlib import Path

import pytest
import torch
from harness import backend, run_distributed

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.skipif(
    backend() != "nccl" or torch.cuda.device_count() < 2,
    reason="needs ETP_TEST_BACKEND=nccl and 2 GPUs (Megatron-FSDP needs CUDA)",
)
ROOT = Path(__file__).resolve().parents[2]
WORLD = 4 if torch.cuda.device_count() >= 4 else 2
SMALL = dict(num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=4, qk_layernorm=True,
             seq_length=128, max_position_embeddings=128, vocab_size=1024, num_experts=8, moe_ffn_hidden_size=192,
             micro_batch_size=2, global_batch_size=2 * 2 * WORLD, train_iters=8, lr_warmup_iters=2, log_interval=1,
             clip_grad=0.05, world_size=WORLD, cuda_graph="none", data="etp/data/tiny_corpus.txt",
             etp={"etp_size": 1, "expert_etp_size": 1})


def _runs(ctx, overrides, reports):
    """Trains the plain-DDP recipe, then the Megatron-FSDP one (JSON reports to ``reports``);
    returns both runs' losses and, for a freshly set-up Megatron-FSDP model, (elements of this
    rank's fp32 shards, elements of the model)."""
    from megatron.core import parallel_state as ps

    from etp.recipe import Recipe
    from etp.train import RunOptions, train
    from etp.train.setup import set_up

    recipes = [Recipe.from_yaml(ROOT / "recipes" / "moe_flagship.yaml", **SMALL, **overrides, **fsdp)
               for fsdp in ({}, {"use_megatron_fsdp": True})]
    losses = [train(ctx.rank, ctx.world_size, recipe, RunOptions(json_path=report))
              for recipe, report in zip(recipes, reports)]
    run = set_up(recipes[1], ctx.rank, ctx.world_size)
    shards = sum(w.to_local().numel() for w in run.stepper.master_weights())
    whole = sum(w.numel() for w in run.stepper.master_weights())
    ps.destroy_model_parallel()
    return losses, (shards, whole)


@pytest.mark.parametrize("overrides,rtol", [
    (dict(bf16=False), 1e-3),
    (dict(bf16=True), 2e-2),
    (dict(bf16=True, megatron_fallbacks="stock"), 2e-2),
], ids=["fp32", "bf16", "bf16-stock"])
def test_megatron_fsdp_trains_like_megatron_ddp(tmp_path, overrides, rtol):
    reports = [str(tmp_path / "ddp.json"), str(tmp_path / "megatron_fsdp.json")]
    results = run_distributed(_runs, WORLD, overrides, reports)
    (ddp_losses, fsdp_losses), _ = results[0]
    assert len(ddp_losses) == len(fsdp_losses) == SMALL["train_iters"]
    assert ddp_losses[-1] < ddp_losses[0] and fsdp_losses[-1] < fsdp_losses[0]  # both learn
    for step, (a, b) in enumerate(zip(fsdp_losses, ddp_losses)):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: Megatron-FSDP {a:.5f} vs DDP {b:.5f}"
    ddp, fsdp = (json.loads(Path(report).read_text()) for report in reports)
    assert (ddp["stepper"], fsdp["stepper"]) == ("MegatronStep", "MegatronFSDPStep")
    assert fsdp["predicted_peak_gib"] is None and isinstance(fsdp["param_bits_sum"], int)
    for step, (a, b) in enumerate(zip(*([r["grad_norm"] for r in report["log"]] for report in (fsdp, ddp)))):
        assert abs(a - b) <= 2 * rtol * abs(b), f"step {step}: grad norm Megatron-FSDP {a:.5f} vs DDP {b:.5f}"
    # The ranks' fp32 shards hold every weight once, each rank a share near 1 / WORLD (shards split
    # each bucket at row boundaries, so small buckets fall unevenly).
    shards = [result[1] for result in results]
    whole = shards[0][1]
    assert sum(mine for mine, _ in shards) == whole, shards
    assert all(mine <= 1.5 * whole / WORLD for mine, _ in shards), shards
