"""etp.megatron.sync_free_optimizer ([Note: sync-free step]) on 2 gloo ranks: the global norm, the
clip and the Adam update against a float64 reference computed from every rank's gradients,
through both clip routes (fused Adam's ``grad_scale``, torch's or etp's, and a foreach multiply), for a chain
of two links with different statistics groups. The real megatron-core optimizer (CUDA only)
is compared with its own step in ``tests/test_megatron_train_gpu.py``."""
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from harness import run_distributed

from etp.megatron import patches, sync_free_optimizer

SHAPES = [(5, 7), (3,), (11, 2)]
LR, CLIP, EPS = 0.1, 0.5, 1.0  # eps 1: Adam's update then depends on the gradients' scale


class _Link:
    """The slice of megatron-core's MegatronOptimizer that the sync-free step touches."""

    def __init__(self, params, clip_grad, group, fused):
        fused = fused is True  # "etp": torch's Adam, stepped by etp's kernel once install()ed
        self.optimizer = torch.optim.Adam(params, lr=LR, eps=EPS, fused=fused, foreach=False if fused else None)
        self.config = SimpleNamespace(clip_grad=clip_grad, log_num_zeros_in_grad=False)
        self.grad_scaler, self.group = None, group

    def get_parameters(self):
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _grads_for_norm(self):
        return [p.grad for p in self.get_parameters() if not getattr(p, "shared", False)]

    def get_grad_stats_parallel_group(self):
        return self.group

    def prepare_grads(self):
        return False

    def step_with_ready_grads(self):
        self.optimizer.step()
        return True


def _norm_method_name() -> str:
    """The installed megatron-core's name for a link's gradients to norm (renamed in 0.19)."""
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    return next(name for name in ("get_grads_for_grad_norm", "get_main_grads_for_grad_norm")
                if hasattr(MegatronOptimizer, name))


setattr(_Link, _norm_method_name(), _Link._grads_for_norm)  # under that name only, as megatron-core has it


class _Chain:
    def __init__(self, links):
        self.chained_optimizers = links

    def prepare_grads(self):
        return any(link.prepare_grads() for link in self.chained_optimizers)

    def step_with_ready_grads(self):
        return all(link.step_with_ready_grads() for link in self.chained_optimizers)


def _tensors(seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64) * scale for s in SHAPES]


def _grads(rank):
    """Link 0: distinct on every rank (like ETP shards); link 1: the same on every rank
    (replicated, counted on rank 0 only: ``shared`` elsewhere)."""
    return [_tensors(100 + rank), _tensors(200, 3.0)]


def _expected(world, clip_grad):
    squares = sum(float(sum((g * g).sum() for g in _grads(r)[0])) for r in range(world))
    squares += float(sum((g * g).sum() for g in _grads(0)[1]))
    norm = squares ** 0.5
    coefficient = min(1.0, clip_grad / (norm + 1e-6))
    return norm, coefficient


def _adam_reference(start, grads, coefficient):
    params = [torch.nn.Parameter(t.clone()) for t in start]
    for p, g in zip(params, grads):
        p.grad = g * coefficient
    torch.optim.Adam(params, lr=LR, eps=EPS, foreach=False).step()
    return [p.detach() for p in params]


def _step_on_ranks(ctx, fused, clip_grad):
    groups = [None, dist.new_group(list(range(ctx.world_size)))]  # one statistics group per link
    links, starts = [], []
    for index, grads in enumerate(_grads(ctx.rank)):
        start = _tensors(300 + 10 * ctx.rank + index)
        params = [torch.nn.Parameter(t.float()) for t in start]
        for p, g in zip(params, grads):
            p.grad = g.float()
            p.shared = index == 1 and ctx.rank != 0
        links.append(_Link(params, clip_grad, groups[index], fused))
        starts.append(start)
    if fused == "etp":
        assert patches.step_with_fused_adamw(_Chain(links)) == 2
    ok, norm, zeros = sync_free_optimizer.step(_Chain(links))
    assert ok is True and zeros is None and norm.shape == (1,) and norm.dtype == torch.float32
    norm_ref, coefficient = _expected(ctx.world_size, clip_grad)
    torch.testing.assert_close(norm.double()[0], torch.tensor(norm_ref, dtype=torch.float64), rtol=1e-6, atol=0)
    for link, start, grads in zip(links, starts, _grads(ctx.rank)):
        expected = _adam_reference(start, grads, coefficient)
        for got, want in zip(link.get_parameters(), expected):
            torch.testing.assert_close(got.detach().double(), want, rtol=1e-5, atol=1e-6)
    return coefficient


_OPTIMIZERS = [(False, "foreach-clip"), (True, "fused-grad-scale"), ("etp", "etp-adamw")]


# Every optimizer clipping; without clipping one of them by default (the others: -m slow).
@pytest.mark.parametrize("fused,clip_grad", [
    *(pytest.param(fused, CLIP, id=f"clips-{name}") for fused, name in _OPTIMIZERS),
    *(pytest.param(fused, 1e6, id=f"no-clip-{name}", marks=() if fused is True else pytest.mark.slow)
      for fused, name in _OPTIMIZERS)])
def test_step_matches_float64_clip_and_adam(fused, clip_grad):
    coefficients = run_distributed(_step_on_ranks, 2, fused, clip_grad)
    assert (coefficients[0] < 0.2) == (clip_grad == CLIP)  # the clipping case does clip hard


def test_install_refuses_loss_scaling_zero_counting_and_separate_norms():
    link = _Link([torch.nn.Parameter(torch.zeros(2))], 1.0, None, False)
    link.grad_scaler = object()
    assert "fp16 loss scaling" in sync_free_optimizer.unsupported_reason(_Chain([link]))
    assert patches.step_without_host_sync(link) is False
    link.grad_scaler, link.config.log_num_zeros_in_grad = None, True
    assert "log_num_zeros_in_grad" in sync_free_optimizer.unsupported_reason(link)
    link.config.log_num_zeros_in_grad = False
    link.get_parameters()[0].grad_norm_group = "mtp"  # megatron-core 0.19 norms and clips it apart
    assert "separate grad-norm groups ['mtp']" in sync_free_optimizer.unsupported_reason(link)
    del link.get_parameters()[0].grad_norm_group
    assert patches.step_without_host_sync(link) is True and link.step.func is sync_free_optimizer.step
