"""The push reduce-scatter's flag handshake ([Note: push reduce-scatter]) on a model of the
device, on CPU: every rank's streams are queues of the stream memory operations and copies
the real ``CopyEnginePushReduce._push / _receive / _release`` issue (``stream_ops`` patched to
record instead of calling the driver), and a scheduler runs the queues' heads in a random
order, a wait only once its flag holds the value. A CUDA graph is modelled as it behaves: the
operations recorded once (values baked) and run again on every replay, against flags that
persist between replays.

What must hold, for any interleaving: nothing deadlocks; every consumer's sum reads, in every
slot, the rows the producer pushed for that same reduction (never an older or newer one); and
all of it across replays of a captured step and eager reductions between them. The counter
protocol this replaced (flag values = sequence numbers, commit 453a0be) passes the eager cases
and fails every replay case here.

The handshake tests move tags (which reduction, which sender); the data-path tests below move
the real rows: ``reduce_scatter`` and ``_PushHandle.wait`` run as they are, the copies ``_push``
issues carry the slice of the gradient it chose (read when the copy runs, as a copy engine
does), the consumer's sum (``sum_received``) runs in its turn on the stream and reads the
staged rows, and each rank's result is compared with a float64 reduce-scatter of every rank's
gradient.
"""
import random
import types

import pytest
import torch

import etp.transport.push_reduce as push_reduce
import etp.transport.stream_ops as stream_ops
from etp.kernels.sum_received import sum_received_reference

PAD_STRIDE = 1 << 20  # each rank's pad at its own fake address range


class Device:
    """Flags (address -> uint32), staging (owner, slot, index -> reduction tag, or the rows
    copied there) and per-stream operation queues of every rank."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.flags: dict[int, int] = {}
        self.staging: dict[tuple, object] = {}
        self.queues: dict[tuple, list] = {}
        self.recording: tuple | None = None  # (rank, stream) the patched ops append to
        self.reads: list[tuple] = []  # (reader rank, reduction read, reduction expected)

    def enqueue(self, op) -> None:
        self.queues.setdefault(self.recording, []).append(op)

    def runnable(self, op) -> bool:
        if op[0] == "wait":
            _, address, value = op
            return ((self.flags.get(address, 0) - value) & 0xFFFFFFFF) < 0x80000000
        return True

    def execute(self, op) -> None:
        kind = op[0]
        if kind == "write":
            self.flags[op[1]] = op[2] & 0xFFFFFFFF
        elif kind == "copy":  # the source is read now, when the copy runs
            _, key, rows = op
            self.staging[key] = rows.tag if isinstance(rows, _Rows) else rows.clone()
        elif kind == "call":  # work of a kernel on the stream (the consumer's sum)
            op[1]()
        elif kind == "read":
            _, rank, key, expected = op
            self.reads.append((rank, self.staging.get(key), expected))

    def run(self, rng: random.Random, queues: dict[tuple, list]) -> None:
        """Runs ``queues`` (copies of recorded programs) to the end in a random order."""
        heads = {k: list(v) for k, v in queues.items() if v}
        while heads:
            ready = [k for k, ops in heads.items() if self.runnable(ops[0])]
            if not ready:
                stuck = {k: ops[0] for k, ops in heads.items()}
                raise AssertionError(f"deadlock: every stream waits: {stuck}")
            key = rng.choice(ready)
            self.execute(heads[key].pop(0))
            if not heads[key]:
                del heads[key]


class _Staged:
    """Stands in for a staging slot view: ``[index].copy_(rows)`` records a copy of the rows
    (a ``_Rows`` tag or a tensor slice); ``rows()`` is what the slot holds when read."""

    def __init__(self, device: Device, owner: int, slot: int) -> None:
        self.device, self.owner, self.slot = device, owner, slot

    def __getitem__(self, index: int):
        device, key = self.device, (self.owner, self.slot, index)
        return types.SimpleNamespace(copy_=lambda rows: device.enqueue(("copy", key, rows)))

    def rows(self) -> torch.Tensor:
        keys = [(self.owner, self.slot, k) for k in range(self.device.world - 1)]
        missing = [key for key in keys if key not in self.device.staging]
        assert not missing, f"a sum read staging nobody copied into: {missing}"
        return torch.stack([self.device.staging[key] for key in keys])


class _Rows:
    def __init__(self, tag) -> None:
        self.tag = tag

    def __getitem__(self, _rows):
        return self


def _transports(device: Device, monkeypatch) -> list:
    kinds = {stream_ops.WAIT_GEQ: "wait", stream_ops.WRITE: "write"}

    class RecordedOps:  # a batch is its operations in order on the stream (cuStreamBatchMemOp)
        def __init__(self, ops) -> None:
            self.ops = list(ops)

        def enqueue(self, stream=None) -> None:
            for kind, address, value in self.ops:
                device.enqueue((kinds[kind], address, value))

    monkeypatch.setattr(stream_ops, "MemoryOps", RecordedOps)
    # No CUDA here: the transport's stream lookups (etp.streams) hand out stand-ins.
    monkeypatch.setattr(push_reduce, "current_raw_stream", lambda *a, **k: 0)
    monkeypatch.setattr(push_reduce, "current_stream", lambda *a, **k: types.SimpleNamespace(wait_event=lambda e: None))
    transports = []
    for rank in range(device.world):
        t = push_reduce.CopyEnginePushReduce.__new__(push_reduce.CopyEnginePushReduce)
        t.rank, t.world, t._issued = rank, device.world, 0
        t.device, t._staging, t._loaded, t._fences, t._views = torch.device("cpu"), None, set(), {}, {}
        pad = torch.zeros(2 * device.world * t.SLOTS, dtype=torch.int32)
        t.init_flags(pad)
        t._flags = (pad, [r * PAD_STRIDE for r in range(device.world)])
        for i, value in enumerate(pad.tolist()):
            device.flags[rank * PAD_STRIDE + 4 * i] = value
        t._slot_view = lambda owner, seq, full, rows, slots=t.SLOTS: _Staged(device, owner, seq % slots)
        transports.append(t)
    return transports


def _record(device: Device, transports: list, tags: list) -> dict:
    """Every rank's program for reductions ``tags`` (in order): the pushes on its RS stream,
    and each reduction's receive / sum / release on its compute stream (which the scheduler
    may run ahead of or behind the pushes). Returns the recorded queues."""
    device.queues = {}
    for t in transports:
        seqs = []
        for tag in tags:
            seq = t._issued
            t._issued += 1
            seqs.append(seq)
            device.recording = (t.rank, "rs")
            t._push(_Rows((tag, t.rank)), rows=1, seq=seq)
        device.recording = (t.rank, "compute")
        for seq, tag in zip(seqs, tags):
            staged = t._receive(None, 1, seq)
            for k in range(t.world - 1):  # index k holds the rows of the rank k + 1 before
                device.enqueue(("read", t.rank, (t.rank, staged.slot, k), (tag, (t.rank - k - 1) % t.world)))
            t._release(seq)
    device.recording = None
    return device.queues


def _check_reads(device: Device) -> None:
    bad = [r for r in device.reads if r[1] != r[2]]
    assert not bad, f"a sum read another reduction's rows: {bad[:3]}"
    device.reads.clear()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("seed", range(6))
def test_eager_reductions_pair_every_push_with_its_sum(world, seed, monkeypatch):
    device = Device(world)
    transports = _transports(device, monkeypatch)
    rng = random.Random(seed)
    for step in range(3):
        device.run(rng, _record(device, transports, [f"e{step}.{i}" for i in range(5)]))
        _check_reads(device)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("count", [1, 3, 4])  # odd and even numbers of reductions per graph
@pytest.mark.parametrize("seed", range(4))
def test_a_captured_step_replays_with_eager_reductions_between(world, count, seed, monkeypatch):
    device = Device(world)
    transports = _transports(device, monkeypatch)
    rng = random.Random(seed)
    device.run(rng, _record(device, transports, ["warm-up"]))  # eager, before capture
    _check_reads(device)
    graph = _record(device, transports, [f"g{i}" for i in range(count)])  # baked once
    for replay in range(4):
        device.run(rng, graph)
        _check_reads(device)
        if replay % 2:
            device.run(rng, _record(device, transports, [f"eager{replay}"]))
            _check_reads(device)
    # Quiescent: every READY clear and every FREE set again, as at the start.
    for t in transports:
        fresh = torch.zeros(2 * world * t.SLOTS, dtype=torch.int32)
        t.init_flags(fresh)
        now = [device.flags[t.rank * PAD_STRIDE + 4 * i] for i in range(fresh.numel())]
        assert now == fresh.tolist(), (t.rank, now)


# ---------------------------------------------------------------- the rows moved
# (wire dtype, rows per rank, accumulate into an fp32 main_grad, mean): each test issues these
# reductions in order, so slots alternate and shapes / dtypes / targets differ between them.
REDUCTIONS = [(torch.bfloat16, 3, True, True), (torch.float32, 2, False, False), (torch.bfloat16, 1, True, False),
              (torch.float32, 3, False, True), (torch.bfloat16, 2, True, True)]
COLS = 4


def _deferred_sums(device: Device, monkeypatch) -> None:
    """The consumer's sum becomes work on its stream: it runs when the scheduler reaches it and
    reads the staged rows as they are then."""
    def sum_received(own, received, out, divisor=1.0, accumulate=False):
        def run():
            staged = received.rows() if isinstance(received, _Staged) else received
            sum_received_reference(own, staged, out, divisor, accumulate)
        device.enqueue(("call", run))
        return out

    monkeypatch.setattr(push_reduce, "sum_received", sum_received)


def _fill(world: int, gen: torch.Generator, grads: list | None = None, targets: list | None = None):
    """Every rank's full gradient (and main_grad, where the reduction accumulates) of each
    reduction: new tensors, or the given ones refilled in place (a replayed graph's buffers)."""
    grads = grads or [[torch.empty(world * rows, COLS, dtype=wire) for wire, rows, _, _ in REDUCTIONS]
                      for _ in range(world)]
    targets = targets or [[torch.empty(rows, COLS) if accumulate else None for _, rows, accumulate, _ in REDUCTIONS]
                          for _ in range(world)]
    for rank in range(world):
        for full, target in zip(grads[rank], targets[rank]):
            full.copy_(torch.randn(full.shape, generator=gen))
            if target is not None:
                target.copy_(torch.randn(target.shape, generator=gen))
    return grads, targets


def _record_reductions(device: Device, transports: list, grads: list, targets: list):
    """Every rank's program: each reduction's ``reduce_scatter`` (its pushes) on the RS stream,
    then each handle's ``wait`` (receive, sum, release) on the compute stream. Returns the
    queues and each rank's result tensors (filled when the queues run)."""
    device.queues, results = {}, []
    for t in transports:
        handles = []
        for (_, _, _, mean), full, target in zip(REDUCTIONS, grads[t.rank], targets[t.rank]):
            device.recording = (t.rank, "rs")
            handles.append(t.reduce_scatter(full, None, target, mean, async_op=True))
        device.recording = (t.rank, "compute")
        results.append([handle.wait() for handle in handles])
    device.recording = None
    return device.queues, results


def _expected(grads: list, targets: list, world: int) -> list:
    """float64 reduce-scatter: rank r's rows of the sum (or mean) over ranks, plus its main_grad."""
    expected = []
    for rank in range(world):
        mine = []
        for i, (_, rows, _, mean) in enumerate(REDUCTIONS):
            total = sum(grads[r][i].double() for r in range(world))[rank * rows : (rank + 1) * rows]
            total = total / world if mean else total
            target = targets[rank][i]
            mine.append(total if target is None else target.double() + total)
        expected.append(mine)
    return expected


def _check_rows(results: list, expected: list, what: str) -> None:
    for rank, (got, want) in enumerate(zip(results, expected)):
        for i, (g, w) in enumerate(zip(got, want)):
            # fp32 sums of a few terms: ~1e-7 relative; a wrong row is off by ~1.
            if not torch.allclose(g.double(), w, rtol=1e-6, atol=1e-5):
                raise AssertionError(f"{what}: rank {rank}'s reduction {i} (slot {i % push_reduce.CopyEnginePushReduce.SLOTS}) "
                                     f"is not its rows of the sum over ranks: max error {(g.double() - w).abs().max():.3g}")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_each_rank_sums_the_rows_its_peers_pushed(world, seed, monkeypatch):
    device = Device(world)
    transports = _transports(device, monkeypatch)
    _deferred_sums(device, monkeypatch)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    for step in range(2):
        grads, targets = _fill(world, gen)
        expected = _expected(grads, targets, world)  # before the run: targets accumulate
        queues, results = _record_reductions(device, transports, grads, targets)
        device.run(rng, queues)
        _check_rows(results, expected, f"eager step {step}")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("seed", range(2))
def test_a_replayed_step_sums_the_rows_of_each_replay(world, seed, monkeypatch):
    device = Device(world)
    transports = _transports(device, monkeypatch)
    _deferred_sums(device, monkeypatch)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    grads, targets = _fill(world, gen)
    graph, results = _record_reductions(device, transports, grads, targets)  # baked once
    for replay in range(3):
        _fill(world, gen, grads, targets)  # the captured buffers, rewritten before each replay
        expected = _expected(grads, targets, world)
        device.run(rng, graph)
        _check_rows(results, expected, f"replay {replay}")
        eager_grads, eager_targets = _fill(world, gen)  # an eager step between replays
        eager_expected = _expected(eager_grads, eager_targets, world)
        queues, eager_results = _record_reductions(device, transports, eager_grads, eager_targets)
        device.run(rng, queues)
        _check_rows(eager_results, eager_expected, f"eager after replay {replay}")
