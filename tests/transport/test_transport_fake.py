"""The copy-engine transports' runtime plumbing on CPU / gloo, with symmetric memory
emulated: each barrier snapshots the peers' pools with a gloo all-gather (a one-sided peer
read cannot cross CPU processes), and the push reduce-scatter's received rows come from such
a snapshot. Everything else is the real code: homes in the pool (the parameter's storage IS
its slot), FP8 shards quantized into their homes, shards staged when their storage moved, the
local fp32 sum into main_grad. The real symmetric memory and copy engines run in
test_transport_gpu.py."""
import logging

import pytest
import torch
import torch.distributed as dist
from harness import run_distributed
from parity import train_parity
from test_async import _async_equals_sync, _setup, _step

import etp.transport as transport
import etp.transport.copy_engine as copy_engine
import etp.transport.push_reduce as push_reduce
from etp import ETPConfig, ETPShardedParam, runtime_of
from etp.transport.symm_pool import SymmetricPool

CE = dict(transport="copy_engine")


class _FakePool(SymmetricPool):
    def materialize(self):
        if self.buffer is None and self._slots:
            self.buffer = torch.zeros(self._size, dtype=torch.uint8, device=self.device)
            self.snapshot = None

    def barrier(self, channel):
        peers = [torch.empty_like(self.buffer) for _ in range(dist.get_world_size(self.process_group))]
        dist.all_gather(peers, self.buffer, group=self.process_group)
        self.snapshot = peers

    def peer(self, key, rank):
        offset, shape, dtype = self._slots[key]
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        source = self.buffer if rank is None else self.snapshot[rank]
        return source[offset : offset + nbytes].view(dtype).view(shape)


def _fake_push_materialize(self):
    self._flags, self._shard_bytes = ("emulated", None), self._reserved


def _fake_receive(self, full, rows, seq):
    # What the peers pushed for this sequence: their rows of this rank, by distance (the
    # staging's order); a gloo all-gather at the consumer's wait stands in for the pushes.
    everyone = [torch.empty_like(full) for _ in range(self.world)]
    dist.all_gather(everyone, full.contiguous(), group=self.process_group)
    _fake_receive.calls.append(seq)
    return torch.stack([everyone[(self.rank - k - 1) % self.world][self.rank * rows : (self.rank + 1) * rows]
                        for k in range(self.world - 1)])


def _install_fakes():
    transport.symmetric_memory_status = lambda group, device: (True, "emulated on gloo")
    copy_engine.SymmetricPool = _FakePool
    copy_engine.CopyEngineGather._channel = lambda self: (0, 0)
    push_reduce.CopyEnginePushReduce.materialize = _fake_push_materialize
    push_reduce.CopyEnginePushReduce._push = lambda self, full, rows, seq: None
    push_reduce.CopyEnginePushReduce._receive = _fake_receive
    push_reduce.CopyEnginePushReduce._release = lambda self, seq: None
    _fake_receive.calls = []


def _train(ctx, overrides):
    _install_fakes()
    config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size, **overrides)
    return train_parity(ctx, config)


def _train_each(ctx, all_overrides):
    """Every configuration in the same two ranks (one spawn instead of one per configuration)."""
    return [_train(ctx, overrides) for overrides in all_overrides]


def test_training_parity_through_emulated_symmetric_transports():
    configs = (CE, dict(CE, reduction="sum"))
    for per_rank in run_distributed(_train_each, 2, configs):
        for overrides, result in zip(configs, per_rank):
            assert result["last_loss"] < result["first_loss"], overrides


def _bit_for_bit(ctx, overrides, dtype):
    _install_fakes()
    return _async_equals_sync(ctx, overrides, dtype, True)


@pytest.mark.slow  # ran on 2 GPUs with the real transports: tests/test_transport_gpu.py
def test_async_equals_sync_bf16_and_fp8_through_emulated_transports():
    for overrides, dtype in ((CE, torch.bfloat16), (dict(CE, gather_dtype="fp8_tensorwise"), torch.float32),
                             (dict(CE, gather_dtype="fp8_blockwise", pad_for_alignment=128), torch.float32)):
        assert all(n > 0 for n in run_distributed(_bit_for_bit, 2, overrides, dtype))


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _homes(ctx, fp8):
    _install_fakes()
    overrides = dict(CE, gather_dtype="fp8_tensorwise") if fp8 else CE
    config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size, **overrides)
    model, groups = _setup(config, ctx.device)
    runtime = runtime_of(model)
    (chosen,) = runtime.transports.values()
    shards = [p for p in model.parameters() if isinstance(p, ETPShardedParam)]
    homes = [chosen.gather.home(p) for p in shards]
    in_place = [h.data_ptr() == p.data_ptr() for h, p in zip(homes, shards)]
    _step(model, config, groups, seed=0)
    fp8_in_home = [runtime.fp8_shard(p).data.data_ptr() == h.data_ptr() for h, p in zip(homes, shards)] if fp8 else []
    # A storage move (what megatron DDP's param buffer does): staged into the home, warned once.
    records = _Records()
    logging.getLogger("etp.runtime").addHandler(records)
    before = [p.detach().clone() for p in shards]
    for p in shards:
        p.data = p.data.clone()
    for seed in (1, 2):
        _step(model, config, groups, seed)
    logging.getLogger("etp.runtime").removeHandler(records)
    staged = fp8 or all(torch.equal(chosen.gather.home(p), b) for p, b in zip(shards, before))
    return in_place, fp8_in_home, records.messages, staged, (chosen.gather.name, chosen.reduce.name)


def test_shards_live_in_their_symmetric_home_and_are_staged_when_moved():
    for in_place, _, warnings, staged, names in run_distributed(_homes, 2, False):
        assert names == ("copy_engine", "copy_engine_push")
        assert in_place and all(in_place)  # no copy per step: the optimizer writes the home
        assert len(warnings) == 1 and "staging" in warnings[0]
        assert staged


def test_fp8_shards_are_quantized_into_their_home():
    for in_place, fp8_in_home, *_ in run_distributed(_homes, 2, True):
        assert not any(in_place)  # the bf16/fp32 parameter stays put; the FP8 shard travels
        assert fp8_in_home and all(fp8_in_home)


def _push_reduce(ctx):
    from types import SimpleNamespace

    _install_fakes()
    reduce = push_reduce.CopyEnginePushReduce(dist.group.WORLD, ctx.device)
    group = SimpleNamespace(rank=ctx.rank, size=ctx.world_size)
    full = torch.empty((6 * ctx.world_size, 5), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(ctx.rank)
    full.copy_(torch.randn(full.shape, generator=g).to(torch.bfloat16))
    main_grad = torch.randn(6, 5, generator=torch.Generator().manual_seed(7 + ctx.rank))
    start = main_grad.clone()
    pending = reduce.reduce_scatter(full, group, main_grad, True, async_op=True)
    pending.wait()
    plain = reduce.reduce_scatter(full, group, None, False, async_op=False).wait()  # no main_grad: wire dtype
    everyone = [torch.empty_like(full) for _ in range(ctx.world_size)]
    dist.all_gather(everyone, full)
    rows = slice(6 * ctx.rank, 6 * (ctx.rank + 1))
    exact = sum(t[rows].double() for t in everyone)
    return ((main_grad.double() - start.double() - exact / ctx.world_size).abs().max().item(), plain.dtype,
            (plain.double() - exact).abs().max().item(), exact.abs().max().item(), list(_fake_receive.calls))


@pytest.mark.parametrize("world", [2, 3])
def test_push_reduce_sums_in_fp32_against_float64(world):
    for mean_error, plain_dtype, plain_error, scale, sequences in run_distributed(_push_reduce, world):
        assert mean_error < 1e-6 * scale  # fp32 accumulation into main_grad
        assert plain_dtype == torch.bfloat16 and plain_error <= 2 ** -8 * scale  # one rounding to bf16
        assert sequences == [0, 1]  # one sequence number per reduction, in issue order



def _auto_choice(ctx):
    _install_fakes()
    config = ETPConfig(etp_size=ctx.world_size, expert_etp_size=ctx.world_size)
    model, groups = _setup(config, ctx.device)
    (chosen,) = runtime_of(model).transports.values()
    _step(model, config, groups, seed=0)  # trains on what was chosen
    return chosen.gather.name, chosen.reduce.name


def test_auto_picks_the_copy_engine_gather_and_the_push_reduce():
    for names in run_distributed(_auto_choice, 2):
        assert names == ("copy_engine", "copy_engine_push")  # symmetric memory (emulated) here


def _push_with_micro_batches(ctx):
    from test_gather_reuse import _train as train_micro

    _install_fakes()
    unsharded, _ = train_micro(ctx, "chain", etp=False)
    results = {}
    for reuse in ("chain", "step"):
        params, _ = train_micro(ctx, reuse, transport="copy_engine")
        results[reuse] = max((a - b).abs().max().item() for a, b in zip(params, unsharded))
    return results


def test_push_reduce_over_micro_batches_and_step_reuse():
    # Two micro-batches per step, the push reduction's sequence numbers and staging slots
    # across them, with chain buffers and with gathers kept for the whole step.
    for result in run_distributed(_push_with_micro_batches, 2):
        assert all(diff < 1e-5 for diff in result.values()), result


def _fake_allocate_backing(self, param, shape, dtype, device):
    # A full-size backing (CPU memory cannot be mapped twice): every weight of a ticket then
    # shares *all* its rows, a stricter sharing than the real backing's peers' rows.
    backing = torch.empty(tuple(shape), dtype=dtype, device=device)
    self._backings[backing.data_ptr()] = backing
    return backing


def _fake_alias(self, param, backing):
    key = (id(param), backing.data_ptr())
    if key not in self._aliases:  # another tensor object on the backing's memory, as an alias is
        self._aliases[key] = (backing.view(backing.shape), None)
    return self._aliases[key][0]


def _aliased(ctx, overrides):
    from test_async import COUNTS

    from etp import finalize_grads

    _install_fakes()
    copy_engine.CopyEngineGather.allocate_backing = _fake_allocate_backing
    copy_engine.CopyEngineGather.alias = _fake_alias
    base = dict(etp_size=ctx.world_size, expert_etp_size=ctx.world_size, **overrides)
    runs = []
    for config in (ETPConfig(prefetch=False, async_reduce=False, **base), ETPConfig(**base)):
        model, groups = _setup(config, ctx.device)
        got = []
        for step in range(3):
            model.zero_grad()
            x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step + 10 * ctx.rank)).requires_grad_()
            model(x, COUNTS).square().mean().backward()  # l0's weight is consumed in backward too
            finalize_grads(model, config, groups)
            got += [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
        runs.append(got)
    aliases = len(next(iter(runtime_of(model).transports.values())).gather._aliases)
    return all(torch.equal(a, b) for a, b in zip(*runs)), aliases


def test_aliased_buffers_hold_a_gather_per_backing_not_per_alias():
    """Weights of one ticket key gather into distinct alias tensors on one backing: which gather
    a buffer holds must be tracked per backing ([Note: aliased own rows]). The Stack's l0 and
    l2 share one, and backward needs l0 after forward gathered l2 there: a stale alias would
    give the input gradient l2's rows. Against the same steps without prefetching (no reuse)."""
    for same, aliases in run_distributed(_aliased, 2, dict(transport="copy_engine")):
        assert aliases > 0
        assert same
