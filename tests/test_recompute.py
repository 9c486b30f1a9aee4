"""Activation recompute with ETP weights: the recomputed forward's gathers ride their own
prefetched chain ([Note: ETP recompute chain]). Compared against the same model trained
without recompute (bit for bit) on gloo ranks."""
import sys

import pytest
import torch
from harness import run_distributed
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
from etp.cache import Role

COUNTS = torch.tensor([3, 5])


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.experts = GroupedSwiGLUExperts(2, 8, 4, init_std=0.3)

    def forward(self, h):
        h = torch.tanh(self.proj(h))
        return h + self.experts(h, COUNTS)


class Deep(nn.Module):
    """Four same-shape blocks (more than the two buffers a shape gets per role, so a
    recomputed weight is never still resident from forward) and a head."""

    def __init__(self, mode):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(8, 8)
        self.mode = mode  # None | "reentrant" | "non_reentrant"

    def forward(self, h):
        for block in self.blocks:
            if self.mode is None:
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=self.mode == "reentrant")
        return self.head(h)


def _train(ctx, mode, steps=5, **overrides):
    config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size, debug_checks=True, **overrides)
    torch.manual_seed(0)
    model = Deep(mode)
    groups = build_etp_groups(config)
    wrap_module_params_etp(model, config, groups)
    runtime = runtime_of(model)
    fired = []
    for name, p in model.named_parameters():
        if hasattr(p, "etp_layout"):
            # A hook must see this pass's complete gradient: record it when it fires.
            register_grad_ready_hook(p, lambda q, name=name: fired.append((name, q.grad.clone())))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    on_demand_steady = None
    for step in range(steps):
        if step == 2:
            on_demand_steady = runtime.stats.gathers_on_demand
        opt.zero_grad()
        fired.clear()
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(100 * step + ctx.rank)).requires_grad_(True)
        model(x).square().mean().backward()
        finalize_grads(model, config, groups)
        pending = {n for n, p in model.named_parameters() if hasattr(p, "etp_layout")} - {n for n, _ in fired}
        assert not pending, f"step {step}: grad-ready hooks never fired for {sorted(pending)}"
        assert len(fired) == len({n for n, _ in fired}), "a grad-ready hook fired twice in one pass"
        for name, grad in fired:
            assert torch.equal(grad, dict(model.named_parameters())[name].grad), f"{name}: hook saw a partial grad"
        opt.step()
        prefetch_after_step(model)
    params = [p.detach().clone() for p in model.parameters()]
    return params, runtime.stats.gathers_on_demand - on_demand_steady, runtime.nbytes()["gather_recompute"]


def _compare(ctx, mode):
    reference, _, _ = _train(ctx, None)
    prefetched, on_demand, recompute_bytes = _train(ctx, mode)
    assert all(torch.equal(a, b) for a, b in zip(reference, prefetched)), f"{mode} recompute changed training"
    unprefetched, on_demand_off, _ = _train(ctx, mode, prefetch=False)
    assert all(torch.equal(a, b) for a, b in zip(reference, unprefetched))
    return on_demand, on_demand_off, recompute_bytes


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_recompute_trains_bit_for_bit_and_prefetches(mode):
    for on_demand, on_demand_off, recompute_bytes in run_distributed(_compare, 2, mode):
        # Steady state (steps 2-4, after prefetch_after_step): no gather on demand at all;
        # without prefetching, every forward, backward and recompute consume gathers on demand
        # unless a buffer still holds this pass's gather of the weight.
        assert on_demand == 0
        assert on_demand_off > 3 * 12  # steps 2-4
        assert recompute_bytes > 0


def _roles_of_recompute(ctx):
    config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size)
    torch.manual_seed(0)
    model = Deep("reentrant")
    wrap_module_params_etp(model, config)
    runtime = runtime_of(model)
    # The input requires grad, as megatron's layers' inputs do: else a reentrant checkpoint
    # has nothing to differentiate and never recomputes.
    model(torch.randn(8, 8, requires_grad=True)).sum().backward()
    return [(role.value, len(order.params)) for chain in runtime._chains.values()
            for role, order in chain.orders.items()]


def test_recompute_consumes_form_their_own_order():
    orders = run_distributed(_roles_of_recompute, 2)[0]
    by_role = {}
    for role, n in orders:
        by_role[role] = by_role.get(role, 0) + n
    # 4 blocks x 3 weights recomputed; the head is not checkpointed.
    assert by_role[Role.RECOMPUTE.value] == 12
    assert by_role[Role.FWD.value] == 13
    assert by_role[Role.BWD.value] == 13


def _issue_order(ctx):
    # Every prefetch must allocate its ticket buffer before it records the event the AG
    # stream waits on: an allocation may write on the current stream (deterministic mode's
    # NaN fill), which must land before the gather, not after it.
    import etp.gather_side as gather_side

    calls = []
    original_buffer, original_event = gather_side.GatherSide._buffer, gather_side.current_stream_event

    def buffer(self, st, role):
        calls.append(f"buffer from {sys._getframe(1).f_code.co_name}")  # _issue or _gather_now
        return original_buffer(self, st, role)

    def event(device):
        calls.append("event")
        return original_event(device)

    gather_side.GatherSide._buffer, gather_side.current_stream_event = buffer, event
    try:
        _train(ctx, "reentrant", steps=3)
    finally:
        gather_side.GatherSide._buffer, gather_side.current_stream_event = original_buffer, original_event
    return calls


def test_prefetch_allocates_before_the_side_stream_waits():
    calls = run_distributed(_issue_order, 2)[0]
    assert calls.count("event") > 10  # prefetches happened
    # Each issued gather looks its buffer up, then records the event, nothing in between.
    issued = [i for i, call in enumerate(calls) if call == "buffer from _issue"]
    assert len(issued) == calls.count("event")
    assert all(calls[i + 1] == "event" for i in issued), calls[:12]
