"""GPU (NCCL, 2 GPUs): the etp-train driver's megatron-core path — GPTModel MoE wrapped by
``ETPDistributedDataParallel`` and stepped by megatron-core's Adam — against the same recipe
without ETP (stock megatron-core DDP and optimizer), step by step.

``clip_grad`` is set low enough that every step clips, so a grad norm that counted
replicated params twice or missed shards would change the updates and the losses.
Run with ``ETP_TEST_BACKEND=nccl`` on a machine with 2 GPUs; skipped otherwise.
"""
from pathlib import Path

import pytest
import torch
from harness import backend, run_distributed

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.skipif(
    backend() != "nccl" or torch.cuda.device_count() < 2,
    reason="needs ETP_TEST_BACKEND=nccl and 2 GPUs (megatron-core's DDP and optimizer need CUDA)",
)
ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=4, seq_length=128,
             max_position_embeddings=128, vocab_size=1024, num_experts=8, moe_ffn_hidden_size=192,
             micro_batch_size=2, global_batch_size=8, train_iters=8, lr_warmup_iters=2, log_interval=4,
             clip_grad=0.05, world_size=2, data="etp/data/tiny_corpus.txt")


def _losses(ctx, overrides, etp_sizes):
    from etp.recipe import Recipe
    from etp.train import train

    out, keys = [], dict(overrides)
    etp_keys = keys.pop("etp", {})
    for size in etp_sizes:
        recipe = Recipe.from_yaml(ROOT / "recipes" / "moe_flagship.yaml", **SMALL, **keys,
                                  etp={**etp_keys, "etp_size": size, "expert_etp_size": size})
        out.append(train(ctx.rank, ctx.world_size, recipe))
    return out


@pytest.mark.parametrize("overrides,rtol", [
    (dict(bf16=False), 1e-3),  # fp32: FP32Optimizer, synchronous DDP
    (dict(bf16=True, use_distributed_optimizer=True, overlap_grad_reduce=True), 2e-2),
    (dict(bf16=True, etp={"gather_dtype": "fp8_tensorwise", "reduction": "sum"}), 5e-2),
], ids=["fp32", "bf16-distopt-overlap", "bf16-fp8-gathers"])
def test_etp_training_matches_megatron_without_etp(overrides, rtol):
    etp_losses, plain_losses = run_distributed(_losses, 2, overrides, (2, 1))[0]
    assert len(etp_losses) == len(plain_losses) == SMALL["train_iters"]
    assert plain_losses[-1] < plain_losses[0]  # it learns
    for step, (a, b) in enumerate(zip(etp_losses, plain_losses)):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: ETP {a:.5f} vs megatron {b:.5f}"


def _fast_and_stock(ctx):
    return [_losses(ctx, dict(bf16=False, megatron_fallbacks=mode), (2,))[0] for mode in ("fast", "stock")]


def test_sync_free_step_matches_megatrons_own_step():
    """``megatron_fallbacks: fast`` steps with etp's sync-free step ([Note: sync-free step]:
    the norm and the clip on the device, the clip folded into fused Adam); ``stock`` with
    megatron-core's own (its norm read on the host). fp32, ETP 2, every step clipping."""
    fast, stock = run_distributed(_fast_and_stock, 2)[0]
    for step, (a, b) in enumerate(zip(fast, stock)):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: sync-free {a:.6f} vs megatron's step {b:.6f}"
