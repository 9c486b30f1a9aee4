"""The transport seam (etp.transport) on CPU / gloo: config validation, the choice at wrap
time (auto picks nccl here and says so once), refusals naming the fix, removed settings
naming what replaced them, every gather and reduction going through the chosen transport,
and prefetch_after_step."""
import logging

import pytest
import torch
from harness import run_distributed
from test_async import _async_equals_sync, _setup, _step

import etp
from etp import ETPConfig, runtime_of
from etp.groups import ShardGroup
from etp.transport import GatherTransport, ReduceTransport, choose_transports

CPU_GROUP = ShardGroup(None, None, (0, 1), 0)


# ---------------------------------------------------------------- config
@pytest.mark.parametrize("value", ["cuda_ipc", "copy_engine_push", 1])
def test_bad_transport_raises_value_error(value):
    with pytest.raises(ValueError, match="ETPConfig.transport="):
        ETPConfig(transport=value)


@pytest.mark.parametrize("key", ["reduce_transport", "reduce_ctas", "gemm_sm_carveout", "alias_own_rows",
                                 "fp8_fast_accum", "fp8_weight_scaling", "prefetch_recompute"])
def test_removed_settings_name_what_replaced_them(key):
    with pytest.raises(ValueError, match=f"ETP setting '{key}' was removed: .+"):
        ETPConfig.from_dict({key: "nccl", "transport": "nccl"})


def test_copy_engine_on_cpu_raises_naming_the_fix():
    with pytest.raises(ValueError, match=r"transport='copy_engine'.*(auto|nccl)"):
        choose_transports(ETPConfig(transport="copy_engine"), CPU_GROUP, torch.device("cpu"))


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
