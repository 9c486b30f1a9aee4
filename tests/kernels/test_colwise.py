"""quantize_grouped_colwise (the FP8 weight-gradient operands) against its pure-torch
reference (bit-exact) and an independent float64 dequantization bound; GPU: the FP8
weight-gradient GEMM built on it against a float64 per-expert reference.

The Triton kernel runs compiled on CUDA, else in the interpreter (tests/conftest.py).
"""
from __future__ import annotations

import pytest
import torch

from etp.gemm import GroupedGemm, quantize_activation, row_amax
from etp.kernels import quantize_grouped_colwise
from etp.kernels.reference import quantize_grouped_colwise_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (tokens per expert, columns): uneven segments, empty experts, one token, widths that are
# not multiples of 16 or of the kernel's 64-column tile.
# Many experts (the per-expert kernel's binary search over segment ends) and segments longer
# than its 128-position tile.
CASES = [([5, 0, 17], 7), ([16, 16], 64), ([1], 130), ([0, 0], 3), ([3, 70, 2], 65), ([0], 0),
         ([3, 0, 0, 20, 1, 0, 7, 16, 2], 33), ([130, 1, 60], 20)]


@pytest.mark.parametrize("per_expert", [False, True], ids=["per_column", "per_expert"])
@pytest.mark.parametrize("counts,cols", CASES)
def test_matches_reference_and_float64(counts, cols, per_expert):
    gen = torch.Generator().manual_seed(len(counts) * 100 + cols)
    tokens = sum(counts)
    # Rows of very different magnitudes: a per-token scale would be wrong here, a per-expert
    # (per-column) one is what the GEMM can apply.
    x = (torch.randn(tokens, cols, generator=gen) * 4 * torch.rand(tokens, 1, generator=gen)).to(torch.bfloat16)
    if tokens:
        x[0] = 0  # an all-zero row (a masked token's gradient) must not disturb its expert's scale
    c = torch.tensor(counts)
    # Per expert: the rows' maxima as the rowwise quantization stores them, computed here in
    # float64 (exact for bf16).
    row_amax = x.double().abs().amax(dim=1).float() if per_expert and cols else None
    if per_expert and not cols:
        row_amax = torch.zeros(tokens)
    dev_amax = row_amax.to(DEVICE) if row_amax is not None else None
    q, s_inv, pends = quantize_grouped_colwise(x.to(DEVICE), c.to(DEVICE), row_amax=dev_amax, impl="triton")
    q_ref, s_ref, pends_ref = quantize_grouped_colwise_ref(x, c, row_amax=row_amax)
    q, s_inv, pends = q.cpu(), s_inv.cpu(), pends.cpu()
    assert torch.equal(pends, pends_ref)
    used = int(pends[-1]) if counts else 0
    assert torch.equal(q[:, :used].view(torch.uint8), q_ref[:, :used].view(torch.uint8))
    assert torch.equal(s_inv, s_ref)
    # Independent check: dequantized values within e4m3's half-ulp (2^-4 relative) of x, the
    # padding zeros, every expert's segment starting at a multiple of 16.
    starts = [0] + torch.cumsum(c, 0).tolist()
    pstarts = [0] + pends.tolist()
    for e, n in enumerate(counts):
        assert pstarts[e] % 16 == 0
        seg = q[:, pstarts[e]:pstarts[e] + n].double().t() * s_inv[e].double()
        ref = x[starts[e]:starts[e] + n].double()
        amax = ref.abs().amax(dim=0) if n else torch.zeros(cols, dtype=torch.float64)
        if per_expert:
            amax = amax.amax().expand(cols) if n and cols else amax
            if n and cols:  # one scale for the expert: 448 / its amax (1 for an all-zero expert)
                assert bool((s_inv[e] == s_inv[e, 0]).all())
            if n and cols and amax[0] > 0:
                assert abs(s_inv[e, 0].item() * 448 - amax[0].item()) <= amax[0].item() * 2 ** -22
        assert bool(((seg - ref).abs() <= ref.abs() * 2 ** -4 + amax * 2 ** -9 / 448 * 2 + 1e-30).all())
        pad = q[:, pstarts[e] + n:pstarts[e + 1]]
        assert not pad.view(torch.uint8).any()


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="contiguous"):
        quantize_grouped_colwise(torch.zeros(4, 6).t(), torch.tensor([6]))
    with pytest.raises(ValueError, match="counts must be"):
        quantize_grouped_colwise(torch.zeros(4, 6), torch.tensor([4.0]))
    with pytest.raises(ValueError, match="row_amax must be"):
        quantize_grouped_colwise(torch.zeros(4, 6), torch.tensor([4]), row_amax=torch.zeros(6))


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
                    reason="FP8 GEMMs need an sm90+ GPU")
@pytest.mark.parametrize("scales", ["per_column", "per_expert"])
def test_fp8_wgrad_against_float64(scales):
    """ETPConfig.fp8_wgrad's GEMM: per-expert gy_e^T x_e from FP8 operands, uneven and empty
    experts and all-zero rows included, within FP8's error of the float64 result (bf16's own
    error ~2^-8). per_expert: the operands went through the forward / input-gradient GEMMs'
    rowwise quantization first (``quantize_activation``), so the weight gradient takes one
    scale per expert from the rows' amax it left behind."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.tensor([100, 0, 37, 256, 1], device="cuda")
    tokens = int(counts.sum())
    x = torch.randn(tokens, 192, device="cuda", generator=gen, dtype=torch.bfloat16)
    gy = torch.randn(tokens, 320, device="cuda", generator=gen, dtype=torch.bfloat16) * 1e-4  # gradient-sized
    gy[5:9] = 0  # masked tokens
    if scales == "per_expert":
        quantize_activation(x), quantize_activation(gy)
        assert row_amax(x) is not None and row_amax(gy) is not None
    dw = GroupedGemm.wgrad(gy, x, counts, fp8=True)
    bounds = [0] + torch.cumsum(counts, 0).tolist()
    for e in range(counts.numel()):
        ref = gy[bounds[e]:bounds[e + 1]].double().t() @ x[bounds[e]:bounds[e + 1]].double()
        if ref.abs().max() == 0:
            assert not dw[e].any()
            continue
        rel = ((dw[e].double() - ref).norm() / ref.norm()).item()
        assert rel < 0.05, (e, rel)


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
                    reason="FP8 GEMMs need an sm90+ GPU")
def test_fp8_wgrad_of_a_padded_buffer_reads_only_the_valid_rows():
    """[Note: valid rows]: a captured expert-parallel receive buffer has rows past the counts'
    sum. The rowwise quantization stops at the valid length, the per-expert operands leave the
    tail past their last segment unwritten, and the FP8 weight-gradient GEMM stops at its last
    offset: with NaN in every padded row and NaN bytes forced into the operands' tail, the
    result equals the trimmed buffer's and stays finite."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    counts = torch.tensor([100, 0, 37, 256, 1], device="cuda")
    tokens, capacity = int(counts.sum()), 1024
    x = torch.full((capacity, 192), float("nan"), device="cuda", dtype=torch.bfloat16)
    gy = torch.full((capacity, 320), float("nan"), device="cuda", dtype=torch.bfloat16)
    x[:tokens] = torch.randn(tokens, 192, device="cuda", generator=gen, dtype=torch.bfloat16)
    gy[:tokens] = torch.randn(tokens, 320, device="cuda", generator=gen, dtype=torch.bfloat16) * 1e-4
    x_valid, gy_valid = x[:tokens].clone(), gy[:tokens].clone()
    quantize_activation(x_valid), quantize_activation(gy_valid)  # per-expert scales, as the padded
    trimmed = GroupedGemm.wgrad(gy_valid, x_valid, counts, fp8=True)
    valid = torch.cumsum(counts, 0)[-1:]
    quantize_activation(x, valid_rows=valid), quantize_activation(gy, valid_rows=valid)
    padded = GroupedGemm.wgrad(gy, x, counts, fp8=True)
    assert torch.isfinite(padded).all()
    torch.testing.assert_close(padded, trimmed, rtol=1e-2, atol=1e-7)

    # The GEMM's own contract: nothing past the last offset is read.
    gq, g_inv, offs = quantize_grouped_colwise(gy, counts, row_amax=row_amax(gy))
    xq, x_inv, _ = quantize_grouped_colwise(x, counts, row_amax=row_amax(x))
    end = int(offs[-1])
    for q in (gq, xq):
        q.view(torch.uint8)[:, end:] = 0x7F  # e4m3 NaN
    result = torch._scaled_grouped_mm(gq, xq.t(), g_inv.reshape(-1), x_inv.reshape(-1), offs=offs,
                                      out_dtype=torch.bfloat16, use_fast_accum=True)
    torch.testing.assert_close(result, trimmed, rtol=1e-2, atol=1e-7)
