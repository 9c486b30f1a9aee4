"""GPU (NCCL, 1 GPU): etp-train's megatron-core path without ETP weights (world 1: ``MegatronStep``
with megatron-core's DDP) under ``megatron_fallbacks: fast`` — etp's fused AdamW writing the bf16
weights in the same pass, etp's sync-free step — against ``stock``: torch's AdamW, megatron-core's
own step and its fp32 -> bf16 copy. Same weights, same batches, bf16 with fp32 masters, every step
clipping; what may differ is the order of floating-point sums. And bf16 gradient buffers read in
place by that kernel (one rank, one micro-batch) against megatron's fp32 buffers: bit for bit.

Run with ``ETP_TEST_BACKEND=nccl`` on a machine with a GPU; skipped otherwise.
"""
from pathlib import Path

import pytest
import torch
from harness import backend, run_distributed

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.skipif(backend() != "nccl" or not torch.cuda.is_available(),
                                reason="needs ETP_TEST_BACKEND=nccl and a GPU (megatron-core's optimizer needs CUDA)")
ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=4, seq_length=128,
             max_position_embeddings=128, vocab_size=1024, num_experts=8, moe_ffn_hidden_size=192,
             micro_batch_size=2, global_batch_size=2, train_iters=8, lr_warmup_iters=2, log_interval=1,
             clip_grad=0.05, world_size=1, bf16=True, cuda_graph="none", data="etp/data/tiny_corpus.txt")


def _fast_and_stock(ctx):
    from etp.megatron import fused_adamw
    from etp.recipe import Recipe
    from etp.train import train

    taken = []
    step = fused_adamw.step

    def counted(*args, **kwargs):
        taken.append(1)
        return step(*args, **kwargs)

    fused_adamw.step = counted
    try:
        losses = [train(ctx.rank, ctx.world_size, Recipe.from_yaml(ROOT / "recipes" / "moe_flagship.yaml", **SMALL,
                                                                   megatron_fallbacks=mode))
                  for mode in ("fast", "stock")]
    finally:
        fused_adamw.step = step
    return losses, len(taken)


def test_etp_adamw_steps_a_model_without_etp_weights_like_torchs():
    (fast, stock), steps = run_distributed(_fast_and_stock, 1)[0]
    # Every fast step was etp's kernel, once per link of megatron-core's chain (dense, experts).
    assert steps > 0 and steps % SMALL["train_iters"] == 0
    assert stock[-1] < stock[0]
    for i, (a, b) in enumerate(zip(fast, stock, strict=True)):
        assert abs(a - b) <= 2e-3 * abs(b), f"step {i}: etp AdamW {a:.5f} vs torch's AdamW {b:.5f}"


def _bf16_and_fp32_gradients(ctx):
    from etp.megatron import fused_adamw
    from etp.recipe import Recipe
    from etp.recipe.quantities import RecipeQuantities
    from etp.train import train

    found = []
    read = fused_adamw._bf16_main_grads

    def recorded(link):
        grads = read(link)
        found.append(grads is not None)
        return grads

    fused_adamw._bf16_main_grads = recorded
    own = RecipeQuantities.main_grad_bytes
    try:
        recipe = lambda: Recipe.from_yaml(ROOT / "recipes" / "moe_flagship.yaml", **SMALL, deterministic=True)  # noqa: E731
        bf16 = train(ctx.rank, ctx.world_size, recipe())
        in_place = list(found)
        RecipeQuantities.main_grad_bytes = lambda self, world_size=None: 4  # megatron's fp32 buffers
        found.clear()
        fp32 = train(ctx.rank, ctx.world_size, recipe())
    finally:
        fused_adamw._bf16_main_grads = read
        RecipeQuantities.main_grad_bytes = own
    return bf16, fp32, in_place, list(found)


def test_bf16_gradients_read_in_place_step_exactly_as_fp32_buffers():
    """[Note: bf16 gradients, read in place]: one rank, one micro-batch, every step clipping
    (clip_grad 0.05), deterministic kernels: the bf16 buffers read by the kernel give the losses
    of megatron's fp32 buffers bit for bit, step after step."""
    bf16, fp32, in_place, fp32_in_place = run_distributed(_bf16_and_fp32_gradients, 1)[0]
    assert in_place and all(in_place), "the default run did not read bf16 gradients in place"
    assert fp32_in_place and not any(fp32_in_place)
    assert bf16 == fp32, f"bf16 in place {bf16} vs fp32 buffers {fp32}"
    assert fp32[-1] < fp32[0]
