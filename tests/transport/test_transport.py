"""The transport seam (etp.transport) on CPU / gloo: config validation, the choice at wrap
time (auto picks nccl here and says so once), refusals naming the fix, every gather and
reduction going through the chosen transport, prefetch_after_step, and the Triton
symmetric reduce-scatter kernel against its pure-torch reference and a float64 reference."""
import logging

import pytest
import torch
from harness import run_distributed
from test_async import _async_equals_sync, _setup, _step

import etp
from etp import ETPConfig, runtime_of
from etp.groups import ShardGroup
from etp.kernels.symm_reduce import pointer_table, sum_received, symm_reduce_scatter, symm_reduce_scatter_reference
from etp.transport import GatherTransport, ReduceTransport, choose_transports

CPU_GROUP = ShardGroup(None, None, (0, 1), 0)
# The kernel tests run compiled on a GPU, in the Triton interpreter on CPU (conftest).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------- config
@pytest.mark.parametrize("key,value", [("transport", "cuda_ipc"), ("reduce_transport", "ring"),
                                       ("reduce_ctas", 0), ("reduce_ctas", True)])
def test_bad_transport_settings_raise_value_error(key, value):
    with pytest.raises(ValueError, match=f"ETPConfig.{key}="):
        ETPConfig(**{key: value})


def test_recipe_section_takes_the_new_fields():
    config = ETPConfig.from_dict({"transport": "nccl", "reduce_transport": "nccl_capped", "reduce_ctas": 4})
    assert (config.transport, config.reduce_transport, config.reduce_ctas) == ("nccl", "nccl_capped", 4)


@pytest.mark.parametrize("key,value", [("transport", "copy_engine"), ("reduce_transport", "symm_triton"),
                                       ("reduce_transport", "nccl_capped"), ("reduce_transport", "copy_engine_push")])
def test_symmetric_transports_on_cpu_raise_naming_the_fix(key, value):
    with pytest.raises(ValueError, match=rf"{key}='{value}'.*(auto|nccl)"):
        choose_transports(ETPConfig(**{key: value}), CPU_GROUP, torch.device("cpu"))


def test_auto_picks_nccl_on_cpu():
    chosen = choose_transports(ETPConfig(), CPU_GROUP, torch.device("cpu"))
    assert (chosen.gather.name, chosen.reduce.name) == ("nccl", "nccl")
    assert "cpu" in chosen.reason


# ---------------------------------------------------------------- wrap time, seam
class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _logged_once(ctx):
    records = _Records()
    logger = logging.getLogger("etp.transport")
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size)
    model, groups = _setup(config, ctx.device)
    for seed in range(3):
        _step(model, config, groups, seed)
    logger.removeHandler(records)
    return records.messages


def test_transport_choice_is_logged_once_per_group():
    for messages in run_distributed(_logged_once, 2):
        assert len(messages) == 1, messages
        assert "gather=nccl reduce=nccl" in messages[0]


class _CountingGather(GatherTransport):
    def __init__(self, inner):
        self.inner, self.name, self.calls = inner, "counting", []

    def gather(self, source, group, out, async_op):
        self.calls.append(async_op)
        return self.inner.gather(source, group, out, async_op)


class _CountingReduce(ReduceTransport):
    def __init__(self, inner):
        self.inner, self.name, self.calls = inner, "counting", 0

    def reduce_scatter(self, full, group, target, mean, async_op):
        self.calls += 1
        return self.inner.reduce_scatter(full, group, target, mean, async_op)


def _through_the_seam(ctx):
    config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size)
    model, groups = _setup(config, ctx.device)
    runtime = runtime_of(model)
    (chosen,) = runtime.transports.values()
    chosen.gather, chosen.reduce = _CountingGather(chosen.gather), _CountingReduce(chosen.reduce)
    for seed in range(2):
        _step(model, config, groups, seed)
    stats = runtime.stats
    return (len(chosen.gather.calls), stats.gathers_on_demand + stats.gathers_prefetched,
            chosen.reduce.calls, stats.reduce_scatters)


def test_every_gather_and_reduction_goes_through_the_transport():
    for gathers, counted, reductions, reduce_scatters in run_distributed(_through_the_seam, 2):
        assert gathers == counted > 0
        assert reductions == reduce_scatters > 0


# ---------------------------------------------------------------- no cold chain heads
def _after_step(ctx):
    # debug_checks: any consume that finds its prefetched head missing raises.
    config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size, debug_checks=True)
    model, groups = _setup(config, ctx.device)
    runtime = runtime_of(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    issued, on_demand = [], []
    for step in range(4):
        opt.zero_grad()
        _step(model, config, groups, seed=step + 10 * ctx.rank)
        opt.step()
        issued.append(etp.prefetch_after_step(model))
        on_demand.append(runtime.stats.gathers_on_demand)
    return issued, on_demand


def test_prefetch_after_step_leaves_no_cold_chain_head():
    for issued, on_demand in run_distributed(_after_step, 2):
        # Chains: dense, expert:fc1_weight, expert:fc2_weight -> 3 heads once recorded.
        assert issued == [3, 3, 3, 3]
        # The first pass gathered its heads on demand; every later pass none.
        assert on_demand[0] > 0 and on_demand[1:] == [on_demand[0]] * 3


def test_prefetch_after_step_keeps_async_equal_to_sync_bit_for_bit():
    assert all(n > 0 for n in run_distributed(_async_equals_sync, 2, None, torch.float32, True))


def test_prefetch_after_step_without_etp_is_a_noop():
    assert etp.prefetch_after_step(torch.nn.Linear(2, 2)) == 0


# ---------------------------------------------------------------- the Triton kernel
@pytest.mark.parametrize("rows,cols", [(5, 7), (123, 3), (16, 1000)])
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_symm_reduce_kernel_matches_reference_and_float64(rows, cols, world, dtype):
    gen = torch.Generator().manual_seed(rows * world)
    peers = [torch.randn(rows * world, cols, generator=gen).to(DEVICE, dtype) for _ in range(world)]
    main_grad = torch.randn(rows, cols, generator=gen).to(DEVICE)
    rank = world - 1
    want = symm_reduce_scatter_reference(peers, rank, main_grad.clone(), world, accumulate=True)
    got = symm_reduce_scatter(pointer_table(peers, DEVICE), peers[rank], rank, main_grad.clone(), world,
                              accumulate=True, num_ctas=3, impl="triton")
    assert torch.equal(got, want)  # same fp32 operations in the same order: exact
    mine = slice(rank * rows, (rank + 1) * rows)
    exact = main_grad.double() + sum(p[mine].double() for p in peers) / world
    # Within fp32 rounding of the float64 truth (a few ulps of the largest operand) ...
    bound = 4 * torch.finfo(torch.float32).eps * (main_grad.double().abs() + exact.abs() + 1)
    assert ((got.double() - exact).abs() <= bound).all()
    # ... and at least as accurate as the NCCL path (fp32 reduce-scatter, divide, add).
    today = main_grad + torch.stack([p[mine].float() for p in peers]).sum(0) / world
    got, exact, today = got.cpu(), exact.cpu(), today.cpu()
    assert (got.double() - exact).abs().max() <= (today.double() - exact).abs().max() + 1e-12


def test_symm_reduce_kernel_writes_without_accumulating():
    peers = [torch.full((4, 3), float(r + 1), dtype=torch.bfloat16) for r in range(2)]
    out = torch.full((2, 3), 7.0)
    symm_reduce_scatter(pointer_table(peers, "cpu"), peers[0], 1, out, impl="triton")
    assert torch.equal(out, torch.full((2, 3), 3.0))


def test_symm_reduce_rejects_shape_mismatch():
    peers = [torch.zeros(6, 3, dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(ValueError, match="is not 2 x out"):
        symm_reduce_scatter(pointer_table(peers, "cpu"), peers[0], 0, torch.zeros(2, 3), impl="triton")




# ---------------------------------------------------------------- the push reduce's local sum
@pytest.mark.parametrize("rows,cols", [(5, 7), (16, 1000), (0, 4)])
@pytest.mark.parametrize("peers", [0, 1, 3])
@pytest.mark.parametrize("accumulate", [True, False])
def test_sum_received_kernel_matches_reference_and_float64(rows, cols, peers, accumulate):
    gen = torch.Generator().manual_seed(rows + 10 * peers)
    own = torch.randn(rows, cols, generator=gen).to(DEVICE, torch.bfloat16)
    received = torch.randn(peers, rows, cols, generator=gen).to(DEVICE, torch.bfloat16)
    main_grad = torch.randn(rows, cols, generator=gen).to(DEVICE)
    world = peers + 1
    want = sum_received(own, received, main_grad.clone(), world, accumulate, impl="torch")
    got = sum_received(own, received, main_grad.clone(), world, accumulate, impl="triton")
    assert torch.equal(got, want)  # same fp32 operations in the same order: exact
    exact = (own.double() + received.double().sum(0)) / world + (main_grad.double() if accumulate else 0)
    bound = 4 * torch.finfo(torch.float32).eps * (main_grad.double().abs() + exact.abs() + 1)
    assert ((got.double() - exact).abs() <= bound).all()


def test_sum_received_rounds_once_into_a_16_bit_out():
    own = torch.full((3, 2), 1.0, dtype=torch.bfloat16)
    received = torch.full((1, 3, 2), 2.0 ** -9, dtype=torch.bfloat16)  # below bf16's ulp at 1: kept in fp32
    out = torch.empty(3, 2, dtype=torch.bfloat16)
    # 1 + 4 * 2^-9 = 1 + 2^-7 exactly; added one at a time in bf16 every term would vanish.
    sum_received(own, torch.cat([received] * 4), out, impl="triton")
    assert torch.equal(out, torch.full((3, 2), 1.0 + 2.0 ** -7, dtype=torch.bfloat16))


def test_sum_received_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="must be"):
        sum_received(torch.zeros(2, 3), torch.zeros(1, 3, 3), torch.zeros(2, 3), impl="torch")
