"""``ETPConfig.gather_reuse`` ([Note: gather reuse]): forward gathers kept for backward
("pass") and across the micro-batches of a step ("step"). On gloo ranks, against the same
model trained with today's chain buffers (the bytes gathered are the same, so training must
be bit for bit equal) and against the unsharded model (allclose), with the gathers counted."""
import pytest
import torch
from harness import run_distributed
from test_recompute import Deep

from etp import ETPConfig, build_etp_groups, finalize_grads, prefetch_after_step, runtime_of, wrap_module_params_etp

ETP_WEIGHTS = 13  # Deep: 4 blocks x (proj, fc1, fc2) + head
STEPS, MICRO = 4, 2


def _batch(step, micro, rank):
    return torch.randn(8, 8, generator=torch.Generator().manual_seed(1000 * step + 10 * micro + rank))


def _train(ctx, reuse, mode=None, etp=True, **overrides):
    """Params after STEPS Adam steps of MICRO micro-batches, and the gathers of the last step
    (``overrides``: more ETPConfig fields, e.g. the transports)."""
    torch.manual_seed(0)
    model = Deep(mode)
    config = groups = None
    if etp:
        config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size, debug_checks=True,
                           gather_reuse=reuse, **overrides)
        groups = build_etp_groups(config)
        wrap_module_params_etp(model, config, groups)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gathers = None
    for step in range(STEPS):
        stats = runtime_of(model).stats if etp else None
        before = stats.gathers_prefetched + stats.gathers_on_demand if etp else 0
        opt.zero_grad()
        for micro in range(MICRO):
            x = _batch(step, micro, ctx.rank).requires_grad_(True)
            model(x).square().mean().backward()
        if etp:
            finalize_grads(model, config, groups)
        else:  # the data-parallel mean the ETP reduction computes
            for p in model.parameters():
                torch.distributed.all_reduce(p.grad)
                p.grad /= ctx.world_size
        opt.step()
        if etp:
            prefetch_after_step(model)
            gathers = stats.gathers_prefetched + stats.gathers_on_demand - before
    if etp:
        return list(_unsharded_state(model, ctx).values()), gathers
    return [p.detach().clone() for p in model.parameters()], gathers


def _compare(ctx, mode):
    unsharded, _ = _train(ctx, "chain", mode, etp=False)
    chain, chain_gathers = _train(ctx, "chain", mode)
    results = {}
    for reuse in ("pass", "step"):
        params, gathers = _train(ctx, reuse, mode)
        results[reuse] = (all(torch.equal(a, b) for a, b in zip(params, chain)), gathers)
    close = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(chain, unsharded))
    return results, chain_gathers, close


@pytest.mark.parametrize("mode", [None, "reentrant"], ids=["plain", "recompute"])
def test_reuse_trains_bit_for_bit_with_fewer_gathers(mode):
    for results, chain_gathers, close in run_distributed(_compare, 2, mode):
        assert close, "the chain-buffer ETP model drifted from the unsharded one"
        for reuse, (equal, _) in results.items():
            assert equal, f"gather_reuse={reuse!r} changed training"
        # The last step (after prefetch_after_step): every weight gathered once per
        # micro-batch ("pass") or once per step ("step"); chains gather in backward too.
        assert results["pass"][1] == MICRO * ETP_WEIGHTS
        assert results["step"][1] == ETP_WEIGHTS
        assert chain_gathers > results["pass"][1]


def _stale(ctx):
    """Shards changed between passes of gather_reuse "step": (1) in place without drain() (a
    plain optimizer step, no finalize_grads): the resident gathers recorded the old version;
    (2) through ``.data`` (no version bump, as megatron's optimizers copy into params) and
    then drain(): drain forgets residency. Either way the next forward must see the change."""
    torch.manual_seed(0)
    model = Deep(None)
    config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size, gather_reuse="step",
                       async_reduce=False)
    wrap_module_params_etp(model, config)
    x = _batch(0, 0, ctx.rank)
    ok = []
    for change in ("in_place", "data_then_drain"):
        model(x).sum().backward()
        with torch.no_grad():
            for p in model.parameters():
                if change == "in_place":
                    p.mul_(0.5)
                else:
                    p.data.mul_(0.5)
        if change == "data_then_drain":
            runtime_of(model).drain()
        got = model(x)
        want = Deep(None)
        want.load_state_dict(_unsharded_state(model, ctx))
        ok.append(torch.allclose(got, want(x), rtol=1e-6, atol=1e-6))
        got.sum().backward()
    return ok


def _unsharded_state(model, ctx):
    """The full weights of the wrapped model (its shards all-gathered here, independently)."""
    state = {}
    for name, p in model.named_parameters():
        layout = getattr(p, "etp_layout", None)
        if layout is None:
            state[name] = p.detach().clone()
            continue
        parts = [torch.empty_like(p.detach()) for _ in range(ctx.world_size)]
        torch.distributed.all_gather(parts, p.detach().contiguous())
        state[name] = layout.unpad(torch.cat(parts)).clone()
    return state


def test_step_reuse_never_serves_a_changed_shard():
    for in_place, through_data in run_distributed(_stale, 2):
        assert in_place, "a shard updated in place was served from its old gather"
        assert through_data, "drain() did not end residency"
