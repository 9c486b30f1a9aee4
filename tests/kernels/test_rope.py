"""etp.kernels.rope ([Note: fused RoPE]): forward and backward bit for bit against megatron-core's
own unfused RoPE (``rope_utils._apply_rotary_pos_emb_bshd``, an independent implementation)
and a float64 rotation, on strided views like megatron's query / key, with channels passed
through; in the Triton interpreter on CPU and compiled on a GPU."""
import pytest
import torch

from etp.kernels.rope import rope, rope_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
rope_utils = pytest.importorskip("megatron.core.models.common.embeddings.rope_utils")


def _freqs(s, rot):
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    f = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    return torch.cat((f, f), dim=-1)[:, None, None, :].to(DEVICE)  # megatron's [s, 1, 1, rot]


def _qkv_view(s, b, h, d, dtype, seed):
    """A query-like view: every head's d channels inside a fused [s, b, h, 3d] projection."""
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(s, b, h, 3 * d, generator=g).to(DEVICE, dtype).requires_grad_()
    return fused, fused[..., d:2 * d]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d,rot", [(16, 16), (16, 8), (24, 24)])
def test_forward_and_backward_match_megatron_bit_for_bit(dtype, d, rot):
    s, b, h = 9, 2, 3
    freqs = _freqs(s, rot)
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    grad = torch.randn(s, b, h, d, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    fused_a, t_a = _qkv_view(s, b, h, d, dtype, 0)
    fused_b, t_b = _qkv_view(s, b, h, d, dtype, 0)
    assert not t_a.is_contiguous()
    got = rope(t_a, cos, sin, impl="triton")
    want = rope_utils._apply_rotary_pos_emb_bshd(t_b, freqs)
    assert got.is_contiguous() and torch.equal(got, want)
    got.backward(grad)
    want.backward(grad)
    assert torch.equal(fused_a.grad, fused_b.grad)


def test_the_rotation_against_float64():
    s, b, h, d = 5, 1, 2, 8
    freqs = _freqs(s, d)
    t = torch.randn(s, b, h, d, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    x1, x2 = t[..., : d // 2], t[..., d // 2:]
    f = freqs.double().cpu()[..., : d // 2]
    exact = torch.cat((x1 * f.cos() - x2 * f.sin(), x2 * f.cos() + x1 * f.sin()), dim=-1)
    got = rope(t.float().to(DEVICE), freqs.cos(), freqs.sin(), impl="triton")
    assert torch.allclose(got.double().cpu(), exact, atol=1e-5, rtol=0)


def test_reference_is_megatrons_expression():
    freqs = _freqs(4, 8)
    t = torch.randn(4, 2, 2, 12, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.bfloat16)
    got = rope_reference(t, freqs.cos().to(t.dtype), freqs.sin().to(t.dtype))
    assert torch.equal(got, rope_utils._apply_rotary_pos_emb_bshd(t, freqs))


def test_bad_shapes_say_what_is_expected():
    t = torch.zeros(4, 1, 2, 8, device=DEVICE)
    f = _freqs(4, 8)
    with pytest.raises(ValueError, match=r"must both be \(4, 1, 1, 8\)"):
        rope(t, f.cos()[:3], f.sin()[:3])
    with pytest.raises(ValueError, match="in t's dtype"):
        rope(t, f.cos().bfloat16(), f.sin().bfloat16())
    with pytest.raises(ValueError, match=r"expected \[s, b, h, d\]"):
        rope(t[0], f.cos(), f.sin())
