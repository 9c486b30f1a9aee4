"""etp.train.flops against a hand count of the tiny CPU recipe, the flagship's figures and
the MFU peak lookup."""
from pathlib import Path

import pytest

from etp.recipe import Recipe
from etp.train.flops import (
    PEAK_TFLOPS,
    achievable_fraction,
    attention_flops_per_token,
    gemm_weights_per_token,
    mfu,
    peak_tflops,
    training_flops,
)

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def test_tiny_recipe_hand_count():
    r = Recipe.from_yaml(RECIPES / "tiny_moe_cpu.yaml")
    # h 64, 4 heads x 16, 2 layers, 4 experts top-2 of width 64 (SwiGLU), vocab 512 (the bundled tokenizer's), untied, RMSNorm.
    qkv, proj, router, norms = 64 * 192, 64 * 64, 4 * 64, 2 * 64
    experts = 2 * (64 * 2 * 64 + 64 * 64)  # two active experts: fc1 [128, 64], fc2 [64, 64]
    layer = qkv + proj + router + experts + norms
    weights = 2 * layer + 64 + 512 * 64  # + final norm + logits GEMM; the input embedding is a lookup
    assert gemm_weights_per_token(r) == weights == 115520
    attention = 12 * 2 * (4 * 16) * 64  # 12 x L x heads x kv_channels x s, the full square
    assert attention_flops_per_token(r) == attention == 98304
    assert attention_flops_per_token(r, causal=True) == attention // 2
    assert training_flops(r, tokens=10) == 10 * (6 * weights + attention)


def test_tied_embeddings_count_the_logits_gemm_once():
    r = Recipe.from_yaml(RECIPES / "tiny_moe_cpu.yaml")
    tied = r.replace(untie_embeddings_and_output_weights=False)
    assert tied.num_params(active=True) == r.num_params(active=True) - 512 * 64
    assert gemm_weights_per_token(tied) == gemm_weights_per_token(r)


def test_flagship_recipe_attention_share():
    r = Recipe.from_yaml(RECIPES / "moe_flagship.yaml")
    assert gemm_weights_per_token(r) == 543_197_184 - 65_536_000
    assert attention_flops_per_token(r) == 12 * 8 * 2048 * 2048  # 402.7 M FLOPs per token


def test_peak_and_mfu():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops(None) is None and peak_tflops("cpu") is None
    assert mfu(494.5, 989.0) == pytest.approx(0.5)
    assert mfu(1.0, None) is None


def test_mfu_divides_by_the_datasheet_peak_not_a_measured_gemm():
    # H200 and H100 SXM share the tensor cores: 989 dense bf16 TFLOP/s on the datasheet. A
    # measured GEMM ceiling (798 on H200) in its place inflates every MFU by 24%.
    assert peak_tflops("NVIDIA H200") == 989.0
    assert all(peak != 798.0 for _, peak in PEAK_TFLOPS)
    assert achievable_fraction(399.0, 798.0) == pytest.approx(0.5)
    assert achievable_fraction(1.0, None) is None
