"""The async runtime: prefetch order, buffer keys, bounded cache / pool, deferred
reduce-scatter, grad-ready hooks, tied weights, and every debug-state error."""
import pytest
import torch
from harness import run_distributed
from parity import train_parity
from torch import nn

import etp.transport.nccl as nccl_transport
from etp import (
    ETPConfig,
    ETPShardedParam,
    ETPStateError,
    GroupedSwiGLUExperts,
    build_etp_groups,
    finalize_grads,
    prefetch_after_step,
    register_grad_ready_hook,
    runtime_of,
    wrap_module_params_etp,
)
from etp.cache import Role, WgradPool


class Stack(nn.Module):
    """Three same-shape dense layers around two MoE blocks (so every chain has >= 2 links and
    same-shape neighbours exist)."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.l0 = nn.Linear(8, 8, dtype=dtype)
        self.e0 = GroupedSwiGLUExperts(2, 8, 4, dtype=dtype, init_std=0.3)
        self.l1 = nn.Linear(8, 8, dtype=dtype)
        self.e1 = GroupedSwiGLUExperts(2, 8, 4, dtype=dtype, init_std=0.3)
        self.l2 = nn.Linear(8, 8, dtype=dtype)
        self.swap = False  # flips the order of l1 and l2 (an execution-order change)

    def forward(self, x, counts):
        h = torch.tanh(self.l0(x))
        h = h + self.e0(h, counts)
        first, second = (self.l2, self.l1) if self.swap else (self.l1, self.l2)
        h = torch.tanh(first(h))
        h = h + self.e1(h, counts)
        return second(h)


COUNTS = torch.tensor([3, 5])


def _step(model, config, groups, seed, input_grad=False):
    device = model.l0.bias.device
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(seed)).to(device, model.l0.bias.dtype)
    x.requires_grad_(input_grad)  # with it, l0's weight is consumed in backward too
    model(x, COUNTS).square().mean().backward()
    finalize_grads(model, config, groups)


def _setup(config, device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    model = Stack(dtype).to(device)
    groups = build_etp_groups(config)
    wrap_module_params_etp(model, config, groups)
    return model, groups


# ---------------------------------------------------------------- bit-for-bit
def _async_equals_sync(ctx, overrides=None, dtype=torch.float32, after_step=False):
    """Sync vs async (prefetch + async reduce) training; ``overrides`` pick transports and
    gather dtypes (the GPU tests run the copy-engine and symmetric transports through it),
    ``after_step`` calls etp.prefetch_after_step after each optimizer step in the async run."""
    base = dict(etp_size=ctx.world_size, expert_etp_size=ctx.world_size, **(overrides or {}))
    results = []
    for config in (ETPConfig(prefetch=False, async_reduce=False, **base), ETPConfig(**base)):
        model, groups = _setup(config, ctx.device, dtype)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for step in range(5):
            opt.zero_grad()
            _step(model, config, groups, seed=100 * step + ctx.rank)
            opt.step()
            if after_step and config.prefetch:
                prefetch_after_step(model)
        results.append([p.detach().clone() for p in model.parameters()])
    sync, async_ = results
    assert all(torch.equal(a, b) for a, b in zip(sync, async_)), "async differs from sync"
    return runtime_of(model).stats.gathers_prefetched


def test_async_equals_sync_bit_for_bit():
    prefetched = run_distributed(_async_equals_sync, 2)
    assert all(n > 0 for n in prefetched)  # the async run really prefetched


# ---------------------------------------------------------------- order and buffers
def _order_and_buffers(ctx):
    config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size, debug_checks=True)
    model, groups = _setup(config, ctx.device)
    runtime = runtime_of(model)
    names = {id(p): n for n, p in model.named_parameters()}
    log, pointers = [], {}
    original_gather, original_acquire = nccl_transport.all_gather_rows, runtime.acquire

    def gather(shard, group, out=None, async_op=False):
        log.append(("prefetch" if async_op else "gather", current[0]))
        return original_gather(shard, group, out=out, async_op=async_op)

    current = [None]

    def acquire(param, role, dtype, records_grad=True):
        current[0] = names[id(param)]
        log.append(("consume", role.value, names[id(param)]))
        weight = original_acquire(param, role, dtype, records_grad)
        pointers.setdefault(iteration[0], []).append((role, names[id(param)], weight.data_ptr()))
        return weight

    iteration = [0]
    nccl_transport.all_gather_rows = gather
    runtime.acquire = acquire
    try:
        for it in range(4):
            iteration[0] = it
            if it == 2:
                log.clear()
            _step(model, config, groups, seed=it, input_grad=True)
            if it == 2:
                replay_log = list(log)
    finally:
        nccl_transport.all_gather_rows = original_gather
        runtime.acquire = original_acquire
    return replay_log, pointers, runtime.stats.gathers_reused


def test_gathers_issued_one_consume_ahead_and_buffers_never_shared():
    replay_log, pointers, reused = run_distributed(_order_and_buffers, 2)[0]
    # Chains (see [Note: ETP chains]): dense [l0, l1, l2]; expert fc1 [e0, e1]; fc2 [e0, e1].
    # The prefetch of a weight is issued by its chain predecessor's consume; `current` is the
    # weight being consumed when the gather call happens, so prefetches are logged under it.
    fwd = [
        ("consume", "fwd", "l0.weight"), ("gather", "l0.weight"), ("prefetch", "l0.weight"),
        ("consume", "fwd", "e0.fc1_weight"), ("gather", "e0.fc1_weight"), ("prefetch", "e0.fc1_weight"),
        ("consume", "fwd", "e0.fc2_weight"), ("gather", "e0.fc2_weight"), ("prefetch", "e0.fc2_weight"),
        ("consume", "fwd", "l1.weight"), ("prefetch", "l1.weight"),
        ("consume", "fwd", "e1.fc1_weight"),
        ("consume", "fwd", "e1.fc2_weight"),
        ("consume", "fwd", "l2.weight"),
    ]
    # Backward: the forward buffers still hold this pass's gathers of every weight but l0
    # (l2, two positions later with the same shape, took l0's buffer), so those are re-used
    # without a collective, and only l0 is prefetched, by its backward predecessor l1.
    bwd = [
        ("consume", "bwd", "l2.weight"),
        ("consume", "bwd", "e1.fc2_weight"),
        ("consume", "bwd", "e1.fc1_weight"),
        ("consume", "bwd", "l1.weight"), ("prefetch", "l1.weight"),
        ("consume", "bwd", "e0.fc2_weight"),
        ("consume", "bwd", "e0.fc1_weight"),
        ("consume", "bwd", "l0.weight"),
    ]
    assert replay_log == fwd + bwd
    assert reused == 6 * 4  # six backward consumes served from forward buffers, 4 iterations
    # Stable addresses across iterations, and chain neighbours on different buffers.
    assert pointers[2] == pointers[3]
    by_chain = {}
    for role, name, ptr in pointers[2]:
        kind = "dense" if name.startswith("l") else name.split(".")[1]
        by_chain.setdefault((role, kind), []).append(ptr)
    for ptrs in by_chain.values():
        assert all(a != b for a, b in zip(ptrs, ptrs[1:])), by_chain
    # Same shape, two positions apart (l0 and l2): they may share; that is the bound.
    dense_fwd = by_chain[(Role.FWD, "dense")]
    assert dense_fwd[0] == dense_fwd[2]


# ---------------------------------------------------------------- bounded memory
def _no_growth(ctx):
    config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size)
    model, groups = _setup(config, ctx.device)
    runtime = runtime_of(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    snapshots = {}
    for it in range(1, 51):
        opt.zero_grad()
        _step(model, config, groups, seed=it)
        opt.step()
        if it in (3, 50):
            cache, pool = runtime.gathers.cache, runtime.reductions.pool
            snapshots[it] = (cache.num_buffers, cache.num_tickets, cache.nbytes(), pool.allocations,
                             pool.num_free, pool.in_use)
    assert snapshots[3] == snapshots[50], snapshots
    return snapshots[50]


def test_cache_and_pool_do_not_grow():
    buffers, tickets, nbytes, allocations, free, in_use = run_distributed(_no_growth, 2)[0]
    assert in_use == 0 and buffers > 0 and allocations <= 2 * 3  # 3 wgrad shapes, 2 each
    # 7 forward tickets; backward re-uses them all (every weight consumed in backward is still
    # resident from this pass's forward), so no backward ticket is ever issued.
    assert tickets == 7


def test_wgrad_pool_never_keeps_foreign_buffers():
    pool = WgradPool(max_free_per_key=2)
    mine = [pool.acquire((4, 3), torch.float32, "cpu") for _ in range(3)]
    for _ in range(100):
        pool.release(torch.empty(4, 3))  # foreign
    for buffer in mine:
        pool.release(buffer)
    assert pool.num_free == 2 and pool.in_use == 0 and pool.allocations == 3
    again = pool.acquire((4, 3), torch.float32, "cpu")
    assert any(again is b for b in mine)
    with pytest.raises(ValueError, match="max_free_per_key=0"):
        WgradPool(max_free_per_key=0)


# ---------------------------------------------------------------- hooks
def _hook_after_main_grad(ctx):
    config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size)
    model, groups = _setup(config, ctx.device)
    seen = {}
    for name, p in model.named_parameters():
        if isinstance(p, ETPShardedParam):
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=ctx.device)
            register_grad_ready_hook(p, lambda q, n=name: seen.setdefault(n, []).append(q.main_grad.clone()))
    for it in range(3):
        for p in model.parameters():
            if hasattr(p, "main_grad"):
                p.main_grad.zero_()
        seen.clear()
        _step(model, config, groups, seed=it)
        for name, p in model.named_parameters():
            if isinstance(p, ETPShardedParam):
                # Fired exactly once, and only after the whole gradient was in main_grad.
                assert len(seen[name]) == 1, (it, name, len(seen[name]))
                assert torch.equal(seen[name][0], p.main_grad)
                # (a rank whose shard is all padding has an all-zero gradient)
                assert (p.main_grad[: p.etp_layout.valid_rows].abs().sum() > 0) == (p.etp_layout.valid_rows > 0)
                assert p.grad is None
    return True


def test_grad_ready_hook_fires_after_main_grad_is_complete():
    run_distributed(_hook_after_main_grad, 2)


class TiedModel(nn.Module):
    """A weight used twice per step (like tied embedding / output weights)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16, dtype=torch.float64)
        self.mid = nn.Linear(16, 16, dtype=torch.float64)
        self.b = nn.Linear(16, 16, dtype=torch.float64)
        self.b.weight = self.a.weight
        self.out = nn.Linear(16, 3, dtype=torch.float64)

    def forward(self, x, counts):
        return self.out(torch.tanh(self.b(torch.tanh(self.mid(torch.tanh(self.a(x)))))))


def _train(ctx, model_name, overrides):
    config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size, **overrides)
    make = TiedModel if model_name == "tied" else None
    return train_parity(ctx, config, steps=6, make_model=make)


# The default and everything-off-with-checks run by default; each switch alone is a heavier
# repeat (-m slow).
@pytest.mark.parametrize("overrides", [dict(), pytest.param(dict(prefetch=False), marks=pytest.mark.slow),
                                       pytest.param(dict(async_reduce=False), marks=pytest.mark.slow),
                                       dict(prefetch=False, async_reduce=False, debug_checks=True)])
def test_tied_weights_train_like_the_reference(overrides):
    for result in run_distributed(_train, 2, "tied", overrides):
        assert result["max_param_error"] < 1e-9


def test_prefetch_disabled_trains_for_several_iterations():
    for result in run_distributed(_train, 2, "tiny", {"prefetch": False}):
        assert result["max_param_error"] < 1e-9


# ---------------------------------------------------------------- debug-state errors
def _debug_errors(ctx):
    config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size, debug_checks=True)
    model, groups = _setup(config, ctx.device)
    runtime = runtime_of(model)
    for it in range(2):
        _step(model, config, groups, seed=it)
    errors = {}

    def expect(key, fn, match):
        try:
            fn()
        except ETPStateError as exc:
            assert match in str(exc), str(exc)
            errors[key] = str(exc)
        else:
            raise AssertionError(f"{key}: no ETPStateError")

    gathers, reductions = runtime.gathers, runtime.reductions
    st = gathers.state(model.l1.weight)
    # A second issue while one is in flight.
    gathers._issue(st, Role.FWD)
    expect("double_issue", lambda: gathers._issue(st, Role.FWD), "illegal transition in_flight -> in_flight")
    gathers._take(st, Role.FWD)
    # Finalizing a reduce-scatter that was never issued.
    expect("finalize_idle", lambda: reductions._finalize(reductions.state(model.l1.weight)),
           "finalized with none pending")
    # A consume that finds no gather in flight although the chain prefetched it: the
    # prefetch of l1 (issued by l0's consume) is taken away behind the runtime's back.
    x = torch.randn(8, 8, device=ctx.device)
    original_take = gathers._take

    def steal_after_l0(param, role, dtype, records_grad=True, _acquire=runtime.acquire):
        weight = _acquire(param, role, dtype, records_grad)
        if param is model.l0.weight and role is Role.FWD:
            original_take(gathers.state(model.l1.weight), Role.FWD)
            gathers._holder.clear()  # and forget that the buffer holds it: the gather is lost
        return weight

    runtime.acquire = steal_after_l0
    expect("no_gather_in_flight", lambda: model(x, COUNTS), "found no gather in flight")
    del runtime.acquire
    runtime.drain()
    # The execution order changes after the chain was recorded.
    model.swap = True
    expect("order_changed", lambda: model(x, COUNTS), "differs from the recorded chain")
    model.swap = False
    runtime.drain()
    # A parameter that is not registered.
    stray = ETPShardedParam(torch.zeros(2, 2, device=ctx.device))
    expect("unregistered", lambda: runtime.record(stray), "not registered")
    return sorted(errors)


def test_every_debug_state_error_is_raised():
    assert run_distributed(_debug_errors, 2)[0] == [
        "double_issue", "finalize_idle", "no_gather_in_flight", "order_changed", "unregistered"
    ]


def _order_change_without_debug(ctx):
    config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size)
    model, groups = _setup(config, ctx.device)
    for it in range(2):
        _step(model, config, groups, seed=it)
    model.swap = True
    model(torch.randn(8, 8, device=ctx.device), COUNTS)
    return runtime_of(model).stats.order_misses


def test_order_change_without_debug_stays_correct():
    # Without debug checks a diverging order falls back to on-demand gathers (counted).
    for misses in run_distributed(_order_change_without_debug, 2):
        assert misses > 0
