"""etp-train's language-model loss (``etp.megatron.cross_entropy``) against float64
``F.cross_entropy`` and its autograd gradient: unsharded, split over 2 gloo ranks as
megatron-core's tensor parallelism splits the vocabulary, and as ``GPTModel``'s
``compute_language_model_loss`` ([b, s] labels, [s, b, V] logits)."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed

from etp.megatron.cross_entropy import use_vocab_cross_entropy, vocab_cross_entropy

S, B, V = 5, 3, 96


def _inputs(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(7)
    logits = (3 * torch.randn(S, B, V, generator=g)).to(dtype)
    labels = torch.randint(0, V, (S, B), generator=g)
    weights = torch.rand(S, B, generator=g)  # a per-token upstream gradient, as a loss mask gives
    return logits, labels, weights


def _float64(logits, labels, weights):
    x = logits.detach().double().clone().requires_grad_(True)
    loss = F.cross_entropy(x.reshape(-1, V), labels.reshape(-1), reduction="none").view(S, B)
    (loss * weights.double()).sum().backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_loss_and_logits_gradient_against_float64(dtype):
    logits, labels, weights = _inputs(dtype)
    want_loss, want_grad = _float64(logits, labels, weights)
    x = logits.clone().requires_grad_(True)
    loss = vocab_cross_entropy(x * 1, labels)  # through a product: the gradient flows on to x
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-6, atol=1e-6)
    (loss * weights.to(loss.dtype)).sum().backward()
    tol = dict(rtol=1.6e-2, atol=1e-5) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(x.grad.double(), want_grad, **tol)


def test_a_second_backward_is_refused():
    logits, labels, _ = _inputs()
    loss = vocab_cross_entropy((logits.clone().requires_grad_(True)) * 1, labels).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


def test_gpt_model_hook_takes_batch_major_labels():
    """``compute_language_model_loss(labels [b, s], logits [s, b, V]) -> [b, s]``, megatron-core's contract."""
    logits, labels, _ = _inputs(torch.float32)
    model = SimpleNamespace(config=SimpleNamespace(cross_entropy_loss_fusion=False))
    use_vocab_cross_entropy(model)
    got = model.compute_language_model_loss(labels.t().contiguous(), logits)
    torch.testing.assert_close(got.double(), _float64(logits, labels, torch.ones(S, B))[0].t())
    with pytest.raises(ValueError, match="cross_entropy_loss_fusion=True"):
        use_vocab_cross_entropy(SimpleNamespace(config=SimpleNamespace(cross_entropy_loss_fusion=True)))


def _split_vocabulary(ctx):
    import torch.distributed as dist

    logits, labels, weights = _inputs()
    half = V // ctx.world_size
    mine = logits[..., ctx.rank * half:(ctx.rank + 1) * half].clone().requires_grad_(True)
    loss = vocab_cross_entropy(mine * 1, labels, dist.group.WORLD)
    (loss * weights).sum().backward()
    return loss, mine.grad


def test_vocabulary_split_over_two_ranks_against_the_whole_row():
    logits, labels, weights = _inputs()
    want_loss, want_grad = _float64(logits, labels, weights)
    results = run_distributed(_split_vocabulary, 2)
    for rank, (loss, grad) in enumerate(results):
        torch.testing.assert_close(loss.double(), want_loss, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad.double(), want_grad[..., rank * V // 2:(rank + 1) * V // 2], rtol=1.6e-2, atol=1e-5)
