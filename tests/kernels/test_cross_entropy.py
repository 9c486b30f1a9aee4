"""``etp.kernels.cross_entropy`` (the logits cross-entropy's row statistics and in-place
gradient) under the Triton interpreter against float64 torch: ``F.cross_entropy`` and its
autograd gradient, computed independently of the kernels and of their torch references."""
import pytest
import torch
import torch.nn.functional as F

from etp.kernels.cross_entropy import (
    cross_entropy_grad_,
    cross_entropy_grad_reference,
    cross_entropy_stats,
    cross_entropy_stats_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, interpreted on CPU
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-5)}


def _case(rows, vocab, dtype, seed, scale=4.0):
    g = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(rows, vocab, generator=g)).to(dtype).to(DEVICE)
    target = torch.randint(0, vocab, (rows,), generator=g).to(DEVICE)
    grad = torch.rand(rows, generator=g).to(DEVICE)
    return logits, target, grad


def _float64(logits, target, grad):
    x = logits.double().cpu().requires_grad_(True)
    loss = F.cross_entropy(x, target.cpu(), reduction="none")
    (loss * grad.double().cpu()).sum().backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(5, 37), (3, 5000), (1, 1)])  # 5000: more than one column block
def test_loss_and_gradient_against_float64_cross_entropy(impl, dtype, rows, vocab):
    logits, target, grad = _case(rows, vocab, dtype, seed=rows + vocab)
    want_loss, want_grad = _float64(logits, target, grad)
    row_max, row_sum, picked = cross_entropy_stats(logits, target, impl=impl)
    torch.testing.assert_close((row_sum.log() + row_max - picked).double().cpu(), want_loss, rtol=1e-5, atol=1e-5)
    out = cross_entropy_grad_(logits, target, row_max, row_sum, grad, impl=impl)
    assert out.data_ptr() == logits.data_ptr() and out.dtype == dtype  # written over the logits
    torch.testing.assert_close(out.double().cpu(), want_grad, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_match_their_references(dtype):
    """Statistics to float32 rounding; the gradient to one unit of its dtype."""
    logits, target, grad = _case(7, 300, dtype, seed=3)
    target[2] = -1  # that row's target is on another shard
    got = cross_entropy_stats(logits, target, impl="triton")
    want = cross_entropy_stats_reference(logits, target)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    assert got[2][2] == 0
    ulp = dict(rtol=2 ** -7, atol=1e-6) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(cross_entropy_grad_(logits.clone(), target, *want[:2], grad, impl="triton"),
                               cross_entropy_grad_reference(logits.clone(), target, *want[:2], grad), **ulp)


def test_sharded_rows_combine_to_the_unsharded_loss():
    """Two vocabulary halves, each with its own target column or -1, combine (global max,
    rescaled sums, the one target logit) to the loss of the whole row."""
    logits, target, grad = _case(6, 64, torch.float32, seed=11)
    halves = logits[:, :32].contiguous(), logits[:, 32:].contiguous()
    stats = [cross_entropy_stats(h, torch.where((target >= i * 32) & (target < (i + 1) * 32), target - i * 32, -1),
                                 impl="triton") for i, h in enumerate(halves)]
    top = torch.maximum(stats[0][0], stats[1][0])
    total = sum(s * (m - top).exp() for m, s, _ in stats)
    loss = total.log() + top - (stats[0][2] + stats[1][2])
    torch.testing.assert_close(loss.double().cpu(), _float64(logits, target, grad)[0], rtol=1e-5, atol=1e-5)


def test_refuses_bad_operands():
    logits, target, grad = _case(4, 10, torch.float32, seed=1)
    with pytest.raises(ValueError, match="expected int64"):
        cross_entropy_stats(logits, target.int())
    with pytest.raises(ValueError, match=r"\[rows, vocab\]"):
        cross_entropy_stats(logits.t(), target)
    with pytest.raises(ValueError, match="row_sum"):
        cross_entropy_grad_(logits, target, grad, grad[:3], grad)
    with pytest.raises(ValueError, match="impl="):
        cross_entropy_stats(logits, target, impl="cuda")
