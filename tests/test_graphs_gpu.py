"""CUDA-graph capture of ETP training steps (``etp.GraphedStep``) on real GPUs: 10 Adam
steps captured vs eager are bit-identical (losses and parameters), bf16 and FP8 gathers,
NCCL and copy-engine transports; grad-ready hooks fire once per replay; a replay allocates
nothing; and full activation recompute inside the eager step trains bit for bit too, also under
deterministic mode's NaN fill of new memory with a busy current stream.

Run with ``ETP_TEST_BACKEND=nccl`` on a machine with 2 GPUs; skipped otherwise.
"""
import pytest
import torch
from harness import backend, run_distributed
from torch import nn
from torch.utils.checkpoint import checkpoint

from etp import (
    ETPConfig,
    GroupedSwiGLUExperts,
    build_etp_groups,
    finalize_grads,
    prefetch_after_step,
    register_grad_ready_hook,
    runtime_of,
    wrap_module_params_etp,
)
from etp.graphs import GraphedStep

pytestmark = pytest.mark.skipif(
    backend() != "nccl" or torch.cuda.device_count() < 2,
    reason="needs ETP_TEST_BACKEND=nccl and 2 GPUs",
)

HIDDEN, FFN, EXPERTS, TOKENS = 128, 256, 4, 64


class ExpertStack(nn.Module):
    def __init__(self, layers=3, recompute=False):
        super().__init__()
        self.proj = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN, dtype=torch.bfloat16) for _ in range(layers))
        self.experts = nn.ModuleList(GroupedSwiGLUExperts(EXPERTS, HIDDEN, FFN, dtype=torch.bfloat16, init_std=0.05)
                                     for _ in range(layers))
        self.counts = torch.full((EXPERTS,), TOKENS // EXPERTS, dtype=torch.int64)
        self.recompute = recompute

    def block(self, i, h):
        h = torch.tanh(self.proj[i](h))
        return h + self.experts[i](h, self.counts)

    def forward(self, x):
        for i in range(len(self.proj)):
            x = checkpoint(self.block, i, x, use_reentrant=True) if self.recompute else self.block(i, x)
        return x


def _batch(step, rank, device):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return (0.5 * torch.randn(TOKENS, HIDDEN, generator=g)).to(device, torch.bfloat16)


def _build(ctx, overrides, recompute=False):
    config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size, **overrides)
    torch.manual_seed(0)
    model = ExpertStack(recompute=recompute).to(ctx.device)
    model.counts = model.counts.to(ctx.device)
    groups = build_etp_groups(config)
    wrap_module_params_etp(model, config, groups)
    fired = {}
    for name, p in model.named_parameters():
        if hasattr(p, "etp_layout"):
            register_grad_ready_hook(p, lambda q, name=name: fired.__setitem__(name, fired.get(name, 0) + 1))
    return model, config, groups, torch.optim.Adam(model.parameters(), lr=1e-3), fired


def _loss(model, x):
    loss = model(x).float().square().mean()
    loss.backward()
    return loss.detach()


def _train(ctx, overrides, graphed, steps=10, recompute=False):
    model, config, groups, opt, fired = _build(ctx, overrides, recompute)
    losses, allocations, hooks_per_step = [], [], []
    step_fn = None
    if graphed:
        x0 = torch.zeros(TOKENS, HIDDEN, dtype=torch.bfloat16, device=ctx.device).requires_grad_(True)
        step_fn = GraphedStep(model, lambda x: _loss(model, x), x0)
        fired.clear()  # warm-up and capture fire none (checked below: one per replay)
    for step in range(steps):
        x = _batch(step, ctx.rank, ctx.device).requires_grad_(True)
        fired.clear()
        if graphed:
            step_fn.static_inputs[0].detach().copy_(x)
            step_fn.runtime.refresh_fp8()
            torch.cuda.synchronize()
            before = torch.cuda.memory_stats()["allocation.all.allocated"]
            step_fn.replay()
            torch.cuda.synchronize()
            allocations.append(torch.cuda.memory_stats()["allocation.all.allocated"] - before)
            loss = step_fn.outputs
        else:
            opt.zero_grad(set_to_none=True)
            loss = _loss(model, x)
        finalize_grads(model, config, groups)  # eager's first step finalizes its last weight here
        hooks_per_step.append(dict(fired))
        opt.step()
        prefetch_after_step(model)
        losses.append(loss.clone())
    torch.cuda.synchronize()
    return torch.stack(losses).cpu(), [p.detach().cpu().clone() for p in model.parameters()], allocations, \
        hooks_per_step, runtime_of(model).stats


# The push reduce-scatter replays from its set-and-clear flags ([Note: push reduce-scatter]):
# ten replays against ten eager steps, its sums in the same order, bit for bit.
CONFIGS = {
    "bf16_nccl": dict(transport="nccl"),
    "fp8_nccl": dict(transport="nccl", gather_dtype="fp8_tensorwise"),
    "bf16_copy_engine": dict(transport="copy_engine"),
    "fp8_copy_engine": dict(transport="copy_engine", gather_dtype="fp8_tensorwise"),
    # forward gathers kept for backward inside the graph (cuda_graph: step with gather_reuse pass / step)
    "bf16_copy_engine_pass": dict(transport="copy_engine", gather_reuse="pass"),
}


def _captured_equals_eager(ctx):
    report = {}
    for name, overrides in CONFIGS.items():
        eager_losses, eager_params, _, eager_hooks, _ = _train(ctx, overrides, graphed=False)
        losses, params, allocations, hooks, _ = _train(ctx, overrides, graphed=True)
        assert torch.equal(losses, eager_losses), f"{name}: losses differ\n{losses}\n{eager_losses}"
        assert all(torch.equal(a, b) for a, b in zip(params, eager_params)), f"{name}: parameters differ"
        assert all(n == 0 for n in allocations), f"{name}: replays allocated {allocations}"
        etp_names = {n for n, p in ExpertStack().named_parameters() if "weight" in n}
        for label, seen in (("captured", hooks), ("eager", eager_hooks)):
            bad = [(step, h) for step, h in enumerate(seen) if h != dict.fromkeys(etp_names, 1)]
            assert not bad, f"{name} {label}: grad-ready hooks not once per weight and step: {bad[:2]}"
        report[name] = float(losses[-1])
    return report


def test_captured_training_equals_eager_bit_for_bit():
    run_distributed(_captured_equals_eager, 2)


def _recompute_equals_plain(ctx):
    overrides = dict(transport="nccl")
    plain_losses, plain_params, _, _, _ = _train(ctx, overrides, graphed=False)
    losses, params, _, _, stats = _train(ctx, overrides, graphed=False, recompute=True)
    assert torch.equal(losses, plain_losses)
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))
    return stats.gathers_on_demand


def test_recompute_trains_bit_for_bit_on_gpu():
    run_distributed(_recompute_equals_plain, 2)


def _recompute_under_deterministic_fill(ctx):
    # [Note: ETP streams]: a ticket buffer first allocated by a prefetch is NaN-filled on the
    # current stream in deterministic mode; that fill must land before the gather, not after.
    # Each ticket lookup first sleeps on the current stream (a busy one, like a real step's),
    # so a gather that did not wait for the fill would land first and be overwritten.
    import torch.utils.deterministic

    import etp.cache.weight_cache as weight_cache

    original = weight_cache.WeightCache.ticket

    def busy_ticket(self, *args, **kwargs):
        torch.cuda._sleep(2_000_000)
        return original(self, *args, **kwargs)

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    weight_cache.WeightCache.ticket = busy_ticket
    try:
        return _recompute_equals_plain(ctx)
    finally:
        weight_cache.WeightCache.ticket = original
        torch.use_deterministic_algorithms(False)


def test_recompute_prefetches_survive_deterministic_fill():
    run_distributed(_recompute_under_deterministic_fill, 2)
