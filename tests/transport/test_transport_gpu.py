"""The copy-engine gather and the push reduce-scatter on real GPUs: parity of every wrapped
module type and of 20 training steps with an unsharded reference, async == sync bit for bit
(bf16 and FP8 gathers), gathers and reductions that really run as peer copies fenced by flags,
and aliased gather buffers against plain ones.

Run with ``ETP_TEST_BACKEND=nccl`` on a machine with 2 GPUs (NVLink); skipped otherwise.
"""
import pytest
import torch
from harness import backend, run_distributed
from parity import check_case, standard_cases, train_parity
from test_async import _async_equals_sync, _setup, _step

from etp import ETPConfig, runtime_of

pytestmark = pytest.mark.skipif(
    backend() != "nccl" or torch.cuda.device_count() < 2,
    reason="needs ETP_TEST_BACKEND=nccl and 2 GPUs",
)

CE = dict(transport="copy_engine")


# Each test runs its configurations inside one process group (one spawn): the GPU script
# has a time budget.
MODULE_CONFIGS = [CE, dict(transport="nccl")]


def _cases(ctx):
    done = []
    for overrides in MODULE_CONFIGS:
        config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size, **overrides)
        done.append([check_case(ctx, case, config)["case"] for case in standard_cases()])
    return done


def test_module_parity():
    for result in run_distributed(_cases, 2):
        assert [len(r) for r in result] == [len(standard_cases())] * len(MODULE_CONFIGS)


def _train(ctx):
    results = []
    for reduction in ("mean", "sum"):
        config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size, reduction=reduction, **CE)
        results.append(train_parity(ctx, config))
    return results


def test_training_parity_copy_engine():
    for results in run_distributed(_train, 2):
        assert all(r["last_loss"] < r["first_loss"] for r in results)


def _bit_for_bit(ctx):
    return [_async_equals_sync(ctx, dict(CE, gather_dtype=gather_dtype), torch.bfloat16, after_step)
            for gather_dtype in ("param", "fp8_tensorwise") for after_step in (False, True)]


def test_async_equals_sync_bit_for_bit_bf16_and_fp8():
    for prefetched in run_distributed(_bit_for_bit, 2):
        assert all(n > 0 for n in prefetched)


def _chosen(ctx):
    config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size)  # auto
    model, groups = _setup(config, ctx.device, torch.bfloat16)
    runtime = runtime_of(model)
    # The parameters' storage is the symmetric home: the optimizer writes it directly.
    homes = all(t.gather.home(p) is not None and t.gather.home(p).data_ptr() == p.data_ptr()
                for t in runtime.transports.values() for p in model.parameters() if hasattr(p, "etp_layout"))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _step(model, config, groups, seed=1)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    return ([(t.gather.name, t.reduce.name) for t in runtime.transports.values()], homes,
            sum("nccl" in n.lower() and "allgather" in n.lower().replace("_", "") for n in names),
            sum("memcpy" in n.lower() for n in names),  # "Memcpy PtoP" / "DtoD": copy engines
            sum("barrier" in n.lower() for n in names))  # fenced by flags, not barrier kernels


def test_auto_picks_copy_engine_and_push_and_gathers_without_nccl_kernels():
    for chosen, homes, nccl_gathers, peer_copies, barrier_kernels in run_distributed(_chosen, 2):
        assert chosen == [("copy_engine", "copy_engine_push")]  # both SM-free where symmetric memory is
        assert homes
        assert nccl_gathers == 0
        assert peer_copies > 0
        assert barrier_kernels == 0


def _flag_barrier_orders(ctx):
    from etp.transport.flag_barrier import FlagBarrier
    from etp.transport.symm_pool import rendezvous_offset, symm_mem_module

    group = torch.distributed.group.WORLD
    barrier = FlagBarrier(group, ctx.device)
    barrier.materialize()
    data = symm_mem_module(group).empty(1 << 20, dtype=torch.float32, device=ctx.device)
    data.zero_()
    handle, offset = rendezvous_offset(data, group)
    peer = 1 - ctx.rank
    peer_data = handle.get_buffer(peer, (4 << 20,), torch.uint8, offset).view(torch.float32)
    torch.cuda._sleep(1)  # kernels loaded before any stream parks on a flag
    got = torch.zeros(1 << 20, device=ctx.device)
    got.copy_(peer_data)
    torch.cuda.synchronize()
    torch.distributed.barrier()
    seen = []
    for round_ in range(1, 4):
        if ctx.rank == 0:
            torch.cuda._sleep(30_000_000)  # rank 1 arrives first and must wait for this write
        data.fill_(float(round_ * 10 + ctx.rank))
        barrier(channel=3)  # every peer's fill is visible after this
        got.copy_(peer_data)  # copy engine: a peer read
        barrier(channel=3)  # nobody refills before every peer read
        seen.append(got[:: 1 << 16].unique().tolist())
    torch.cuda.synchronize()
    return seen, [float(r * 10 + peer) for r in range(1, 4)]


def test_flag_barrier_orders_peer_writes_and_reads():
    for seen, expected in run_distributed(_flag_barrier_orders, 2):
        assert seen == [[value] for value in expected]


def _push_uses_no_kernel_beside_the_gemms(ctx):
    config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size, transport="copy_engine")
    model, groups = _setup(config, ctx.device, torch.bfloat16)
    _step(model, config, groups, seed=0)  # warm-up: kernels compiled, staging in use
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _step(model, config, groups, seed=1)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    # (an NCCL all-reduce of the test's loss may run; a reduce-scatter must not)
    return (sum("nccl" in n.lower() and "reducescatter" in n.lower().replace("_", "") for n in names),
            sum("_sum_received_kernel" in n for n in names), sum("memcpy" in n.lower() for n in names),
            sum("barrier" in n.lower() for n in names))


def test_push_reduce_runs_no_nccl_kernel_and_one_sum_per_weight():
    for nccl_reductions, sums, copies, barriers in run_distributed(_push_uses_no_kernel_beside_the_gemms, 2):
        assert nccl_reductions == 0
        assert sums > 0 and copies > 0
        assert barriers == 0  # gathers and reductions fenced by stream flag operations only


class _Wide(torch.nn.Module):
    """Two linears and an expert block whose shards are whole multiples of the 2 MiB mapping
    granularity at ETP 2, in bf16 and in FP8: their gathers can be aliased."""

    def __init__(self):
        from etp import GroupedSwiGLUExperts

        super().__init__()
        self.l0 = torch.nn.Linear(1024, 4096, bias=False, dtype=torch.bfloat16)  # shard 2048 x 1024
        self.e0 = GroupedSwiGLUExperts(2, 4096, 512, dtype=torch.bfloat16, init_std=0.02)  # shard: 1 expert
        self.l1 = torch.nn.Linear(4096, 1024, bias=False, dtype=torch.bfloat16)  # shard 512 x 4096

    def forward(self, x, counts):
        h = torch.tanh(self.l0(x))
        return self.l1(h + self.e0(h, counts))


def _aliased_own_rows(ctx):
    """The same 4 Adam steps with plain and with aliased gather buffers, bf16 and FP8 gathers:
    outputs and parameters bit for bit, and the aliased run's gathers copy no own rows."""
    import etp.transport.vmm as vmm
    from etp import finalize_grads, prefetch_after_step, wrap_module_params_etp
    from etp.groups import build_etp_groups

    counts = torch.tensor([48, 80])
    sharing_status = vmm.handle_sharing_status
    report = {}
    for gather_dtype in ("param", "fp8_tensorwise"):
        runs = []
        for alias in (False, True):
            # Plain buffers: the transport told the ranks cannot share allocations.
            vmm.handle_sharing_status = sharing_status if alias else (lambda group: (False, "plain, for the test"))
            config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size, transport="copy_engine",
                               gather_dtype=gather_dtype)
            torch.manual_seed(0)
            model = _Wide().to(ctx.device)
            reference = [p.detach().clone() for p in model.parameters()]
            groups = build_etp_groups(config)
            wrap_module_params_etp(model, config, groups)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            outputs = []
            for step in range(4):
                x = torch.randn(128, 1024, generator=torch.Generator().manual_seed(step + 10 * ctx.rank))
                opt.zero_grad()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    y = model(x.to(ctx.device, torch.bfloat16), counts)
                    y.float().square().mean().backward()
                    finalize_grads(model, config, groups)
                    torch.cuda.synchronize()
                opt.step()
                prefetch_after_step(model)
                outputs.append(y.detach().clone())
            local_copies = sum("memcpy dtod" in e.name.lower() for e in prof.events())
            gather = next(iter(runtime_of(model).transports.values())).gather
            runs.append(dict(outputs=outputs, params=[p.detach().clone() for p in model.parameters()],
                             local_copies=local_copies, aliases=len(gather._aliases), reference=reference))
        plain, aliased = runs
        report[gather_dtype] = dict(
            same_outputs=all(torch.equal(a, b) for a, b in zip(plain["outputs"], aliased["outputs"])),
            same_params=all(torch.equal(a, b) for a, b in zip(plain["params"], aliased["params"])),
            aliases=(plain["aliases"], aliased["aliases"]),
            local_copies=(plain["local_copies"], aliased["local_copies"]),
            # the first step's output against the unsharded model (bf16 gathers only: exact weights)
            first_output_ok=gather_dtype != "param" or torch.allclose(
                plain["outputs"][0].float(), _unsharded_first_output(plain["reference"], counts, ctx),
                rtol=2e-2, atol=2e-2),
        )
    return report


def _unsharded_first_output(reference, counts, ctx):
    torch.manual_seed(0)
    model = _Wide().to(ctx.device)
    with torch.no_grad():
        for p, r in zip(model.parameters(), reference):
            p.copy_(r)
        x = torch.randn(128, 1024, generator=torch.Generator().manual_seed(10 * ctx.rank))
        return model(x.to(ctx.device, torch.bfloat16), counts).float()


def test_aliased_own_rows_equal_plain_gathers_and_copy_no_own_rows():
    for report in run_distributed(_aliased_own_rows, 2):
        for gather_dtype, r in report.items():
            assert r["same_outputs"] and r["same_params"], gather_dtype
            assert r["aliases"][0] == 0 and r["aliases"][1] > 0, (gather_dtype, r["aliases"])
            # plain gathers copy their own rows device-locally; aliased ones (every weight here) not
            assert r["local_copies"][1] < r["local_copies"][0], (gather_dtype, r["local_copies"])
            assert r["first_output_ok"], gather_dtype
