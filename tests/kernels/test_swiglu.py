"""Fused SwiGLU (etp.kernels.swiglu, etp.expert_swiglu.swiglu) against float64 and the eager
composition it replaces, and the FP8 operands it hands to the next GEMM.

The Triton kernels run compiled on CUDA when a GPU is present, else in the Triton interpreter
(tests/conftest.py). Shapes cover ffn widths that are not powers of two or multiples of 16,
one row, zero rows (no token routed to a rank) and zero width.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import etp
from etp import gemm
from etp.expert_swiglu import expert_swiglu
from etp.kernels import quantize_rowwise, swiglu_backward
from etp.kernels import swiglu as swiglu_kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(0, 8), (1, 1), (3, 5), (7, 16), (5, 130), (2, 1536), (4, 0)]
# Relative tolerance per output dtype: one bf16 unit in the last place (float32 math rounded
# once to bf16); for float32 outputs the float32 math itself (exp, the derivative's
# cancellation) is the error, a few units of 2^-23.
ULP = {torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -18}


def _float64_forward(gate_up, probs):
    g, u = gate_up.double().chunk(2, dim=-1)
    h = F.silu(g) * u
    return h if probs is None else h * probs.double()[:, None]


def _close(actual, expected, dtype):
    # Each element within one ulp of the output dtype of the float64 value (the kernels
    # compute in float32 and round once), plus a floor for values near zero.
    err = (actual.double() - expected).abs()
    floor = ULP[dtype] * 1e-3 * (expected.abs().max().item() if expected.numel() else 0.0)
    bound = 2 * ULP[dtype] * expected.abs() + floor
    assert bool((err <= bound).all()), f"max error {err.max().item():.3e}"


def _row_amax64(t: torch.Tensor) -> torch.Tensor:
    t = t.double()
    return t.abs().amax(dim=1) if t.shape[1] else t.new_zeros(t.shape[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("with_probs", [False, True], ids=["plain", "probs"])
@pytest.mark.parametrize("rows,ffn", SHAPES)
def test_kernels_against_float64(rows, ffn, with_probs, dtype):
    gen = torch.Generator().manual_seed(rows * 1000 + ffn)
    gate_up = (3 * torch.randn(rows, 2 * ffn, generator=gen)).to(dtype).to(DEVICE)
    probs = torch.rand(rows, generator=gen).to(DEVICE) if with_probs else None
    grad_h = torch.randn(rows, ffn, generator=gen).to(dtype).to(DEVICE)

    amax = torch.empty(rows, device=DEVICE)
    h, q, s_inv = swiglu_kernel(gate_up, probs, quantize=True, amax_out=amax, impl="triton")
    _close(h, _float64_forward(gate_up, probs), dtype)
    assert torch.equal(amax.double(), _row_amax64(h))  # each row's amax, from the same pass
    # The FP8 output is exactly quantize_rowwise of the kernel's own output.
    q_ref, scale_ref = quantize_rowwise(h, impl="torch")
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s_inv, torch.reciprocal(scale_ref))

    # Backward against float64 autograd of the same function.
    gu64 = gate_up.double().requires_grad_(True)
    p64 = probs.double().requires_grad_(True) if with_probs else None
    _float64_forward(gu64, p64).backward(grad_h.double())
    dgu, dp, q, s_inv = swiglu_backward(gate_up, grad_h, probs, probs_grad=with_probs, quantize=True,
                                        amax_out=amax, impl="triton")
    _close(dgu, gu64.grad, dtype)
    assert torch.equal(amax.double(), _row_amax64(dgu))
    if with_probs:
        torch.testing.assert_close(dp.double(), p64.grad, rtol=1e-5, atol=1e-5)
    q_ref, scale_ref = quantize_rowwise(dgu, impl="torch")
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s_inv, torch.reciprocal(scale_ref))


@pytest.mark.parametrize("valid", [0, 5, 12], ids=["none", "some", "all"])
def test_valid_rows_bound_every_row_local_kernel(valid):
    """[Note: valid rows]: with a device count of valid rows, the SwiGLU both ways and the
    rowwise quantization compute the rows below it exactly as unbounded and never touch the
    others (their amax entries keep a sentinel; the padded rows hold NaN, which would reach
    the valid rows' outputs through nothing but a row-mixing bug)."""
    rows, ffn = 12, 130
    gen = torch.Generator().manual_seed(valid)
    gate_up = (3 * torch.randn(rows, 2 * ffn, generator=gen)).to(torch.bfloat16)
    gate_up[valid:] = float("nan")
    gate_up = gate_up.to(DEVICE)
    probs = torch.rand(rows, generator=gen).to(DEVICE)
    grad_h = torch.randn(rows, ffn, generator=gen).to(torch.bfloat16).to(DEVICE)
    bound = torch.tensor([valid], dtype=torch.int32, device=DEVICE)
    sentinel = -7.0

    def amax_buffer():
        return torch.full((rows,), sentinel, device=DEVICE)

    full_amax, amax = torch.empty(rows, device=DEVICE), amax_buffer()
    h_full, q_full, s_full = swiglu_kernel(gate_up, probs, quantize=True, amax_out=full_amax, impl="triton")
    h, q, s_inv = swiglu_kernel(gate_up, probs, quantize=True, amax_out=amax, valid_rows=bound, impl="triton")
    assert torch.equal(h[:valid], h_full[:valid]) and torch.equal(s_inv[:valid], s_full[:valid])
    assert torch.equal(q[:valid].view(torch.uint8), q_full[:valid].view(torch.uint8))
    assert torch.equal(amax[:valid], full_amax[:valid]) and bool((amax[valid:] == sentinel).all())

    full_amax, amax = torch.empty(rows, device=DEVICE), amax_buffer()
    d_full, p_full, _, _ = swiglu_backward(gate_up, grad_h, probs, probs_grad=True, quantize=True,
                                           amax_out=full_amax, impl="triton")
    d, dp, _, _ = swiglu_backward(gate_up, grad_h, probs, probs_grad=True, quantize=True, amax_out=amax,
                                  valid_rows=bound.long(), impl="triton")
    assert torch.equal(d[:valid], d_full[:valid]) and torch.equal(dp[:valid], p_full[:valid])
    assert torch.equal(amax[:valid], full_amax[:valid]) and bool((amax[valid:] == sentinel).all())

    x = h_full.nan_to_num()
    x[valid:] = float("nan")
    full_amax, amax = torch.empty(rows, device=DEVICE), amax_buffer()
    q_full, s_full = quantize_rowwise(x, amax_out=full_amax, inverse=True, impl="triton")
    q, s_inv = quantize_rowwise(x, amax_out=amax, inverse=True, valid_rows=bound, impl="triton")
    assert torch.equal(q[:valid].view(torch.uint8), q_full[:valid].view(torch.uint8))
    assert torch.equal(s_inv[:valid], s_full[:valid])
    assert torch.equal(amax[:valid], full_amax[:valid]) and bool((amax[valid:] == sentinel).all())


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match="2 \\* ffn"):
        swiglu_kernel(torch.zeros(3, 5))
    with pytest.raises(ValueError, match="probs must be"):
        swiglu_kernel(torch.zeros(3, 4), torch.zeros(2))
    with pytest.raises(ValueError, match="probs_grad=True needs probs"):
        swiglu_backward(torch.zeros(3, 4), torch.zeros(3, 2), probs_grad=True)
    with pytest.raises(ValueError, match="pass quantize=True"):
        swiglu_kernel(torch.zeros(3, 4), amax_out=torch.zeros(3))
    with pytest.raises(ValueError, match="amax_out must be a contiguous float32 \\[3\\]"):
        swiglu_backward(torch.zeros(3, 4), torch.zeros(3, 2), quantize=True, amax_out=torch.zeros(4))
    with pytest.raises(ValueError, match="amax_out must be a contiguous float32 \\[3\\]"):
        quantize_rowwise(torch.zeros(3, 4), amax_out=torch.zeros(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="valid_rows must be a one-element int32 / int64 tensor"):
        swiglu_kernel(torch.zeros(3, 4), valid_rows=torch.tensor([1.0]))
    with pytest.raises(ValueError, match="valid_rows must be a one-element"):
        quantize_rowwise(torch.zeros(3, 4), valid_rows=torch.tensor([1, 2]))


def test_experts_module_matches_eager_float64():
    """GroupedSwiGLUExperts (fused SwiGLU inside) against a float64 per-expert loop."""
    torch.manual_seed(0)
    experts = etp.GroupedSwiGLUExperts(3, 16, 24, dtype=torch.float32)
    counts = torch.tensor([4, 0, 5])
    x = torch.randn(9, 16, requires_grad=True)
    probs = torch.rand(9, requires_grad=True)
    y = experts(x, counts, probs)
    y.backward(torch.ones_like(y))

    w1 = experts.fc1_weight.detach().double().requires_grad_(True)
    w2 = experts.fc2_weight.detach().double().requires_grad_(True)
    x64 = x.detach().double().requires_grad_(True)
    p64 = probs.detach().double().requires_grad_(True)
    outs = []
    for e, (xe, pe) in enumerate(zip(x64.split(counts.tolist()), p64.split(counts.tolist()))):
        gate, up = (xe @ w1[e].t()).chunk(2, dim=-1)
        outs.append((F.silu(gate) * up * pe[:, None]) @ w2[e].t())
    ref = torch.cat(outs)
    ref.backward(torch.ones_like(ref))
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(probs.grad.double(), p64.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(experts.fc1_weight.grad.double(), w1.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the valid-row bound applies to CUDA tensors")
def test_experts_on_a_padded_buffer_match_the_trimmed_rows():
    """[Note: valid rows]: the experts fed a padded receive buffer (rows past the counts' sum
    full of NaN, as captured expert parallelism hands them over) give the trimmed buffer's
    outputs and gradients on the valid rows and finite weight gradients."""
    torch.manual_seed(0)
    experts = etp.GroupedSwiGLUExperts(3, 64, 96, dtype=torch.bfloat16, device="cuda")
    counts = torch.tensor([40, 0, 25], device="cuda")
    tokens, capacity = int(counts.sum()), 256

    def run(rows):
        experts.zero_grad(set_to_none=True)
        x = torch.full((rows, 64), float("nan"), device="cuda", dtype=torch.bfloat16)
        x[:tokens] = data
        probs = torch.zeros(rows, device="cuda")
        probs[:tokens] = weights
        x.requires_grad_(True), probs.requires_grad_(True)
        y = experts(x, counts, probs)
        y[:tokens].backward(grad)
        return (y[:tokens].detach(), x.grad[:tokens], probs.grad[:tokens], experts.fc1_weight.grad.clone(),
                experts.fc2_weight.grad.clone())

    data = torch.randn(tokens, 64, device="cuda", dtype=torch.bfloat16)
    weights, grad = torch.rand(tokens, device="cuda"), torch.randn(tokens, 64, device="cuda", dtype=torch.bfloat16)
    for trimmed, padded in zip(run(tokens), run(capacity)):
        assert torch.isfinite(padded).all()
        torch.testing.assert_close(padded, trimmed, rtol=1e-2, atol=1e-3)


class _Consumer(torch.autograd.Function):
    """Stands for fc2: takes the SwiGLU output, asks for its FP8 operand."""

    seen: dict = {}

    @staticmethod
    def forward(ctx, h):
        _Consumer.seen["forward"] = gemm.quantize_activation(h)
        return h * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class _Producer(torch.autograd.Function):
    """Stands for fc1: receives the SwiGLU's input gradient, asks for its FP8 operand."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _Consumer.seen["backward"] = (g, gemm.quantize_activation(g.contiguous()))
        return g


def test_fp8_operands_are_handed_over(monkeypatch):
    """With quantize=True the next GEMMs get the SwiGLU kernels' own FP8 operands (no second
    quantization pass) — forward and backward — equal to quantizing the activation."""
    calls = []
    real = gemm.quantize_rowwise
    monkeypatch.setattr(gemm, "quantize_rowwise", lambda x, **kw: calls.append(x.shape) or real(x, **kw))
    gate_up = torch.randn(6, 32, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    y = _Consumer.apply(expert_swiglu(_Producer.apply(gate_up), None, quantize=True))
    y.float().sum().backward()
    assert calls == [], "the handed-over quantization was not used"
    h = expert_swiglu(gate_up.detach(), None)
    q_fwd, s_fwd = _Consumer.seen["forward"]
    q_ref, scale_ref = quantize_rowwise(h)
    assert torch.equal(q_fwd.view(torch.uint8), q_ref.view(torch.uint8))
    torch.testing.assert_close(s_fwd, torch.reciprocal(scale_ref))
    g, (q_bwd, _) = _Consumer.seen["backward"]
    assert torch.equal(q_bwd.view(torch.uint8), quantize_rowwise(g)[0].view(torch.uint8))

    # An in-place change invalidates the attachment: quantized afresh.
    h = expert_swiglu(gate_up.detach(), None, quantize=True)
    h.mul_(2)
    gemm.quantize_activation(h)
    assert calls == [h.shape]


def test_handed_copy_is_consumed_once_and_row_amax_stays(monkeypatch):
    """The FP8 copy handed over with h is freed by its one consumer (not kept alive with h,
    which backward saves); each row's amax stays with the tensor for the FP8 weight-gradient
    GEMM (``row_amax``), also when ``quantize_activation`` quantized the tensor itself."""
    calls = []
    real = gemm.quantize_rowwise
    monkeypatch.setattr(gemm, "quantize_rowwise", lambda x, **kw: calls.append(x.shape) or real(x, **kw))
    gate_up = torch.randn(6, 32, dtype=torch.bfloat16, device=DEVICE)
    h = expert_swiglu(gate_up, None, quantize=True)
    gemm.quantize_activation(h)
    assert calls == [] and torch.equal(gemm.row_amax(h).double(), _row_amax64(h))
    gemm.quantize_activation(h)  # the copy went with its first consumer: quantized afresh
    assert calls == [h.shape] and torch.equal(gemm.row_amax(h).double(), _row_amax64(h))
    x = torch.randn(5, 48, dtype=torch.bfloat16, device=DEVICE)
    assert gemm.row_amax(x) is None
    gemm.quantize_activation(x)
    assert torch.equal(gemm.row_amax(x).double(), _row_amax64(x))
    x.add_(1)  # changed since: no stale amax
    assert gemm.row_amax(x) is None


@pytest.mark.parametrize("rows,ffn", [(3, 5), (5, 130), (2, 1536)])
def test_the_rebuilt_output_has_the_forward_bits(rows, ffn):
    # Backward rebuilds fc2's input with swiglu_output ([Note: rebuilt activations]); the
    # forward made it with quantize=True on the FP8 path: the values must be the same bits.
    from etp.expert_swiglu import expert_swiglu_output

    gen = torch.Generator().manual_seed(rows + ffn)
    gate_up = (3 * torch.randn(rows, 2 * ffn, generator=gen)).to(torch.bfloat16).to(DEVICE)
    probs = torch.rand(rows, generator=gen).to(DEVICE)
    for quantize in (True, False):
        h = swiglu_kernel(gate_up, probs, quantize=quantize, impl="triton")[0]
        assert torch.equal(expert_swiglu_output(gate_up, probs).view(torch.int16), h.view(torch.int16))
