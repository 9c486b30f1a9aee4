"""The symmetric-memory move kernels of ``etp.kernels.ep_move``, W ranks simulated in one
process (pointer tables of local tensors stand in for symmetric memory; the Triton
interpreter runs them on CPU), bit for bit against ``etp.kernels.ep_reference`` and
against the receive layout of ``etp.ep.routing_layout``."""
from __future__ import annotations

import os

import pytest
import torch
from ep_cases import make_case

from etp.ep.backends.base import sum_pairs
from etp.ep.routing_layout import count_pairs, pair_rows
from etp.kernels import ep_move as km
from etp.kernels import ep_reference as ref


def _simulate(case, world, capacity, expert_capacity=None, num_experts=8, topk=3, hidden=5, t_max=7):
    ranks, _, _ = make_case(case, world, num_experts, topk, hidden, t_max, seed=5)
    idx = [r[0] for r in ranks]
    meta = torch.stack([count_pairs(i, num_experts) for i in idx])
    layouts = [pair_rows(i, meta, r, capacity, expert_capacity) for r, i in enumerate(idx)]
    layouts = [type(lay)(*(t.to(DEVICE) for t in lay)) for lay in layouts]
    xs = [r[2].float().to(DEVICE) for r in ranks]
    ws = [r[1].float().to(DEVICE) for r in ranks]
    return idx, layouts, xs, ws


# Compiled on one GPU when there is one (the tables then hold local device addresses).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _bufs(world, *shape, dtype=torch.float32, fill=0.0):
    return [torch.full(shape, fill, dtype=dtype, device=DEVICE) for _ in range(world)]


def _check_all_moves(case, world, capacity, expert_capacity=None, *, topk=3, hidden=5, t_max=7, launch=None):
    """Every kernel against its reference on one routing; ``launch``: the tile parameters
    (num_ctas / rows / num_warps / stages) of every launch (default: a few programs, the
    automatic tiles)."""
    idx, layouts, xs, ws = _simulate(case, world, capacity, expert_capacity, topk=topk, hidden=hidden, t_max=t_max)
    launch = launch or {}
    ctas = lambda n: {"num_ctas": n, **launch}  # noqa: E731 - launch's num_ctas wins
    tab = lambda bufs: km.table_of(bufs, DEVICE)  # noqa: E731
    # 1. direct push of rows and weights.
    recv_x, recv_w = _bufs(world, capacity, hidden), _bufs(world, capacity)
    want_x, want_w = _bufs(world, capacity, hidden), _bufs(world, capacity)
    for r, lay in enumerate(layouts):
        km.push_rows(xs[r], ws[r], lay.pair_row, lay.pair_rank, tab(recv_x), tab(recv_w), mode=km.X_ROWS,
                     **ctas(3))
        ref.push_rows_ref(xs[r], ws[r], lay.pair_row, lay.pair_rank, want_x, want_w, mode=1)
    for d in range(world):
        assert torch.equal(recv_x[d], want_x[d]) and torch.equal(recv_w[d], want_w[d]), d
        total = int(layouts[d].tokens_per_expert.sum())
        assert total <= capacity and bool((recv_x[d][total:] == 0).all())
    # 2. rank de-duplicated push + metadata, then the local expansion gives the same rows;
    # also with this rank's own tokens written by the push straight into their rows ([Note: own
    # rows]), which the expansion then keeps (or, as symm_allgather's does, reads from x).
    tok, want_tok = _bufs(world, world * t_max, hidden), _bufs(world, world * t_max, hidden)
    tok_remote, want_tok_remote = _bufs(world, world * t_max, hidden), _bufs(world, world * t_max, hidden)
    own_rows, want_own = _bufs(world, capacity, hidden, fill=9.0), _bufs(world, capacity, hidden, fill=9.0)
    maps, want_maps = _bufs(world, capacity, dtype=torch.int64), _bufs(world, capacity, dtype=torch.int64)
    red = _bufs(world, world * t_max, topk, dtype=torch.int64, fill=7)
    want_red = [r.clone() for r in red]
    for r, lay in enumerate(layouts):
        km.push_rows(xs[r], None, lay.pair_row, lay.pair_rank, tab(tok), None, mode=km.X_DEDUP, me=r, t_max=t_max,
                     **ctas(2))
        ref.push_rows_ref(xs[r], None, lay.pair_row, lay.pair_rank, want_tok, None, mode=2, me=r, t_max=t_max)
        km.push_rows(xs[r], ws[r], lay.pair_row, lay.pair_rank, tab(tok_remote), tab(recv_w), mode=km.X_DEDUP, me=r,
                     t_max=t_max, own=own_rows[r], **ctas(3))
        ref.push_rows_ref(xs[r], ws[r], lay.pair_row, lay.pair_rank, want_tok_remote, want_w, mode=2, me=r,
                          t_max=t_max, own=want_own[r])
        km.push_meta(lay.pair_row, lay.pair_rank, tab(maps), tab(red), world, r, t_max, topk, **ctas(2))
        ref.push_meta_ref(lay.pair_row, lay.pair_rank, want_maps, want_red, r, t_max, topk)
    for d in range(world):
        assert torch.equal(tok[d], want_tok[d]) and torch.equal(maps[d], want_maps[d])
        assert torch.equal(tok_remote[d], want_tok_remote[d]) and torch.equal(recv_w[d], want_w[d])
        assert not tok_remote[d][d * t_max: (d + 1) * t_max].any(), "own= also wrote this rank's own slot"
        assert torch.equal(own_rows[d], want_own[d]), f"rank {d}: the push's own rows differ from the reference"
        n_valid = [x.shape[0] for x in xs]
        for s in range(world):  # slots past a rank's tokens keep stale values
            assert torch.equal(red[d][s * t_max: s * t_max + n_valid[s]], want_red[d][s * t_max: s * t_max + n_valid[s]])
        out = torch.full((capacity, hidden), 9.0, device=DEVICE)
        totals = torch.tensor([capacity, -5], dtype=torch.int64, device=DEVICE)
        km.select_rows(tok[d], maps[d], out, layouts[d].tokens_per_expert, totals, **ctas(3))
        assert torch.equal(out, recv_x[d]), f"expanded rows of rank {d} differ from the direct push"
        total = int(layouts[d].tokens_per_expert.sum())
        assert totals.tolist() == [total, total]  # the kernel carried the new total on device
        out[total:] = 9.0  # rows past the recorded total are not the kernel's to clear
        km.zero_tail(out, torch.zeros_like(layouts[d].tokens_per_expert), totals, **ctas(2))
        assert bool((out[:total] == 0).all()) and bool((out[total:] == 9.0).all()) and totals[0] == 0
        want_out, want_totals = out.clone(), totals.clone()
        holes = maps[d].clone()
        holes[::3] = -1  # rows nothing arrived for: zeroed
        km.select_rows(tok[d], holes, out, layouts[d].tokens_per_expert, totals, **ctas(3))
        ref.select_rows_ref(tok[d], holes, want_out, layouts[d].tokens_per_expert, want_totals)
        assert torch.equal(out, want_out) and totals[0] == want_totals[0]
        out.fill_(9.0)
        totals = torch.tensor([capacity, 0], dtype=torch.int64, device=DEVICE)
        km.select_rows(tok_remote[d], maps[d], out, layouts[d].tokens_per_expert, totals, local=xs[d],
                       local_first=d * t_max, **ctas(2))
        assert torch.equal(out, recv_x[d]), f"rank {d}: expansion with own rows from x differs from the direct push"
        totals = torch.tensor([capacity, 0], dtype=torch.int64, device=DEVICE)
        km.select_rows(tok_remote[d], maps[d], own_rows[d], layouts[d].tokens_per_expert, totals,
                       local_first=d * t_max, kept_rows=t_max, **ctas(2))
        assert torch.equal(own_rows[d], recv_x[d]), f"rank {d}: own rows pushed + peers' rows expanded differ"
    # 3. all-gather of the token rows (all, and all but one rank's).
    staged = [torch.cat([x, torch.full((t_max - x.shape[0], hidden), 3.0, device=DEVICE)]) for x in xs]
    tokens = layouts[0].tokens
    for skip in (-1, world - 1):
        got, want = _bufs(1, world * t_max, hidden, fill=-1.0)[0], _bufs(1, world * t_max, hidden, fill=-1.0)[0]
        km.gather_tokens(tab(staged), tokens, got, t_max, skip=skip, **ctas(4))
        ref.gather_tokens_ref(staged, tokens, want, t_max, skip=skip)
        assert torch.equal(got, want)
    # 4. combine: pull-reduce, and local reduce pushed + de-duplicated slot reduce; per-pair scalars.
    gen = torch.Generator().manual_seed(0)
    ys = [torch.randn(capacity, hidden, generator=gen).to(DEVICE) for _ in range(world)]
    # Rank d writes source s's partial sums into s's slot d*t_max + t; slots without a row
    # from d must keep what they held: start from 5, not 0.
    pushed, want_pushed = _bufs(world, world * t_max, hidden, fill=5.0), _bufs(world, world * t_max, hidden, fill=5.0)
    for d in range(world):
        km.local_reduce(ys[d], red[d], tokens, tab(pushed), t_max, me=d, **ctas(3))
        ref.local_reduce_ref(ys[d], red[d], tokens, want_pushed, t_max, me=d)
    for s in range(world):
        assert torch.equal(pushed[s], want_pushed[s]), f"pushed partial sums of source {s}"
    for r, lay in enumerate(layouts):
        T = xs[r].shape[0]
        out, want = torch.empty(T, hidden, device=DEVICE), torch.empty(T, hidden, device=DEVICE)
        km.pull_reduce(tab(ys), lay.pair_row, lay.pair_rank, out, **ctas(2))
        ref.pull_reduce_ref(ys, lay.pair_row, lay.pair_rank, want)
        assert torch.equal(out, want)
        if T:
            per_pair = torch.stack([ys[d][row] if row >= 0 else torch.zeros(hidden, device=DEVICE)
                                    for row, d in zip(lay.pair_row.tolist(), lay.pair_rank.tolist())])
            summed = torch.empty_like(out)
            sum_pairs(per_pair.view(T, topk, hidden), summed)
            assert torch.equal(out, summed), "pull_reduce is not the k-order fp32 sum every backend reproduces"
        # The source's reduction of the partial sums pushed to it: the same sum, another order.
        out2, want2 = torch.empty(T, hidden, device=DEVICE), torch.empty(T, hidden, device=DEVICE)
        blocks = list(pushed[r].view(world, t_max, hidden))
        km.pull_reduce(km.slot_table(pushed[r], world), lay.pair_row, lay.pair_rank, out2, dedup=True, **ctas(2))
        ref.pull_reduce_ref(blocks, lay.pair_row, lay.pair_rank, want2, dedup=True)
        assert torch.equal(out2, want2), "de-duplicated slot reduce differs from the reference"
        torch.testing.assert_close(out2, out, rtol=1e-6, atol=1e-6)  # same sum, other order
        pairs, want_pairs = torch.empty(T * topk, device=DEVICE), torch.empty(T * topk, device=DEVICE)
        km.pull_pairs(tab(recv_w), lay.pair_row, lay.pair_rank, pairs, **ctas(2))
        ref.pull_pairs_ref(recv_w, lay.pair_row, lay.pair_rank, want_pairs)
        assert torch.equal(pairs, want_pairs)
        sent = lay.pair_row >= 0
        assert torch.equal(pairs[sent], ws[r].reshape(-1)[sent])  # weights went out and came back


@pytest.mark.parametrize("case", ["uniform", "zero_tokens", "one_rank"])
def test_move_kernels_match_reference(case):
    _check_all_moves(case, 2, capacity=2 * 7 * 3)


def test_move_kernels_with_dropping_and_overflow():
    _check_all_moves("skewed", 4, capacity=9, expert_capacity=4)  # dropping: 2 local experts x 4 rows
    _check_all_moves("skewed", 2, capacity=11)  # overflow: rows past the capacity are not sent


# Multi-row tiles with ragged tails: T (7, 6, 0 tokens) and the capacity not multiples of
# ROWS, more tiles than programs, H past one column block (4136 = 4096 + a masked 40), K = 1,
# pipelining on and off. rows counts copy rows: the K = 3 reductions take rows // 3 (8 -> 2,
# 16 -> 4). Every case must equal the references bit for bit.
@pytest.mark.parametrize("case, world, topk, hidden, launch", [
    ("uniform", 2, 3, 5, dict(rows=8, num_ctas=3, stages=2)),
    ("zero_tokens", 2, 3, 5, dict(rows=16, num_ctas=2, stages=1)),
    ("one_rank", 2, 1, 5, dict(rows=4, num_ctas=2)),
    ("uniform", 4, 1, 24, dict(rows=1, num_ctas=5, stages=3)),
    ("zero_tokens", 2, 2, 4136, dict(rows=4, num_ctas=3)),
    pytest.param("uniform", 2, 3, 4136, dict(num_ctas=2), marks=pytest.mark.slow),  # two-col-blocks, auto launch
], ids=["rows8", "rows16-zero-tokens", "rows4-k1", "rows1-4ranks", "two-col-blocks", "two-col-blocks-auto"])
def test_move_kernels_tiles_with_ragged_tails(case, world, topk, hidden, launch):
    _check_all_moves(case, world, capacity=world * 7 * topk - 3, topk=topk, hidden=hidden, launch=launch)


@pytest.mark.parametrize("hidden, rows", [(5, 4), (4136, None)], ids=["narrow-rows4", "two-col-blocks"])
def test_copy_rows_matches_reference(hidden, rows):
    """Gather, scatter, scatter bounded by device counts, scatter into peers' buffers."""
    from etp.kernels.ep_pack import copy_rows

    gen = torch.Generator().manual_seed(4)
    src = torch.randn(11, hidden, generator=gen).to(DEVICE)
    idx = torch.randperm(14, generator=gen)[:11].to(DEVICE)
    idx[[2, 7]] = -1  # skipped rows
    launch = dict(num_ctas=3, rows=rows)
    for scatter, counts in ((False, None), (True, None), (True, torch.tensor([3, 5], device=DEVICE))):
        n_dst = 11 if not scatter else 14
        got, want = torch.full((n_dst, hidden), 7.0, device=DEVICE), torch.full((n_dst, hidden), 7.0, device=DEVICE)
        gather_src = torch.randn(14, hidden, generator=gen).to(DEVICE) if not scatter else src
        copy_rows(gather_src, idx, got, 1, 10, scatter=scatter, tokens_per_expert=counts, **launch)
        ref.copy_rows_ref(gather_src, idx, want, 1, 10, scatter=scatter, tokens_per_expert=counts)
        assert torch.equal(got, want), (scatter, counts)
    peers = _bufs(2, 7, hidden, fill=7.0)
    want_peers = [p.clone() for p in peers]
    copy_rows(src, idx, km.table_of(peers, DEVICE), 0, 11, scatter=True, slot_rows=7, **launch)
    ref.copy_rows_ref(src, idx, want_peers, 0, 11, scatter=True, slot_rows=7)
    assert all(torch.equal(a, b) for a, b in zip(peers, want_peers))


def test_tile_shapes():
    from etp.kernels import ep_tiles as tiles

    assert tiles.row_block(5) == 16 and tiles.row_block(4096) == 4096 and tiles.row_block(4136) == 4096
    assert tiles.row_block(7168) == 1024  # a divisor: no masked-off tail
    assert tiles.tile_rows(None, 4096) == 4 and tiles.tile_rows(None, 4096, 8) == 1 and tiles.tile_rows(2, 4096) == 2
    assert tiles.tile_rows(None, 7168) == 16 and tiles.tile_rows(None, 7168, 8) == 2  # 1024-wide blocks
    assert tiles.tile_rows(16, 4096, 3) == 4 and tiles.tile_rows(2, 4096, 3) == 1  # a reduction: rows // K
    with pytest.raises(ValueError, match="power of two"):
        tiles.tile_rows(3, 4096)


@pytest.mark.parametrize("h, rows, want", [(7168, None, 2), (4096, None, 1), (4096, 16, 2)])
def test_a_push_tiles_rows_over_its_k_pairs(monkeypatch, h, rows, want):
    # A push writes each token to its K pairs: its tile holds rows // K tokens (tall tiles ran
    # several times slower on wide rows), which the results alone would never show.
    seen = {}
    monkeypatch.setattr(km, "launch", lambda kernel, grid, *args, **meta: seen.update(meta))
    tokens, k = 4, 8
    x = torch.zeros(tokens, h, dtype=torch.bfloat16)
    pairs = torch.zeros(tokens * k, dtype=torch.int64)
    km.push_rows(x, None, pairs, pairs, km.table_of([x], x.device), None, mode=km.X_ROWS, rows=rows)
    assert seen["ROWS"] == want and seen["K"] == k
    with pytest.raises(ValueError, match="at most 64 ranks"):
        km.pull_reduce(torch.zeros(65, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                       torch.zeros(1, dtype=torch.int64), torch.zeros(1, 4), dedup=True)


# ---------------------------------------------------------------- the symm backends on CPU
# One rank (gloo), torch symmetric memory replaced by plain tensors whose pointer table holds
# their own address and a no-op barrier; the kernels run in the Triton interpreter. This
# checks, without a GPU, the invariants that CUDA-graph replay and allocation-free steps
# rest on (see [Note: graph-safe moves] in etp.ep.backends.symm).
SYMM = ("symm_push", "symm_dedup", "symm_allgather")
_MOVE_KERNELS = ("push_rows", "pull_reduce", "pull_pairs", "select_rows", "gather_tokens", "local_reduce",
                 "push_meta")


class _FakeSymmHandle:
    def __init__(self, t):
        self.buffer_ptrs = [t.data_ptr()]

    def barrier(self, channel=0):
        pass


def _fake_symmetric_memory(monkeypatch_like):
    import torch.distributed._symmetric_memory as symm_mem

    import etp.ep.backends as backends

    monkeypatch_like(backends, "symm_unavailable_reason", lambda group: "")
    monkeypatch_like(symm_mem, "empty", lambda *shape, dtype, device: torch.empty(shape, dtype=dtype, device=device))
    monkeypatch_like(symm_mem, "rendezvous", lambda t, group: _FakeSymmHandle(t))
    monkeypatch_like(symm_mem, "enable_symm_mem_for_group", lambda name: None)


class _Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every op whose output owns fresh (non-empty) storage: an allocation."""

    def __init__(self):
        super().__init__()
        self.ops, self.seen = [], set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.seen.add(str(func))
        leaves = torch.utils._pytree.tree_leaves
        inputs = {t.untyped_storage().data_ptr() for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() and \
                    t.untyped_storage().data_ptr() not in inputs:
                self.ops.append(str(func))
        return out


def _steady_moves(disp, gen, launches):
    """Every move of one handle, three times: the launches and allocations of each step, the ops
    the last step ran, and the handle, inputs and last dispatch (for what a caller checks next)."""
    idx = torch.rand(6, 4, generator=gen).topk(2, dim=1).indices
    x, w = torch.randn(6, 8, generator=gen), torch.rand(6, 2, generator=gen)
    handle = disp.prepare(idx)
    per_step, allocs = [], []
    with torch.no_grad():
        for _ in range(3):
            launches.clear()
            with _Allocations() as mode:
                recv_x, recv_w, _ = disp.dispatch(x, w, handle)
                disp.combine(recv_x, handle)
                disp.combine_backward(x, handle)
                disp.dispatch_backward(recv_x, recv_w, handle)
            per_step.append(list(launches))
            allocs.append(mode.ops)
    return per_step, allocs, sorted(mode.seen), handle, x, w, recv_x


def _describe(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", value.data_ptr(), tuple(value.shape), tuple(value.stride()), value.dtype)
    return value


def _layer_against_reference(disp, ref_disp, gen, tokens, label, exact=True):
    """One layer (dispatch, experts doubling the weighted rows, combine, backward) through
    ``disp`` and through the reference backend on the same routing: what differs, named."""
    idx = torch.rand(tokens, 4, generator=gen).topk(2, dim=1).indices
    x, w = torch.randn(tokens, 8, generator=gen), torch.rand(tokens, 2, generator=gen)
    got, want = [], []
    for d, out in ((disp, got), (ref_disp, want)):
        xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        h = d.prepare(idx)
        recv_x, recv_w, tpe = d.dispatch(xg, wg, h)
        y = d.combine(recv_x * 2 * recv_w[:, None], h)
        gx, gw = torch.autograd.grad(y, (xg, wg), torch.ones_like(y)) if tokens else (x, w)
        out += [t.detach().clone() for t in (recv_x, recv_w, tpe, y, gx, gw)]
    same = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=1e-6))
    return [f"{label}T={tokens}: {key} differs from reference"
            for key, a, b in zip(("recv_x", "recv_w", "tokens_per_expert", "out", "grad_x", "grad_w"), got, want)
            if not same(a, b)]


def _symm_on_cpu(ctx, name):
    from etp import ep
    from etp.kernels import ep_move

    _fake_symmetric_memory(setattr)
    launches = []

    def recorder(fn_name, fn):
        def record(*args, **kwargs):
            kw = tuple(sorted((k, _describe(v)) for k, v in kwargs.items()))
            launches.append((fn_name, tuple(map(_describe, args)), kw))
            return fn(*args, **kwargs)
        return record

    for fn_name in _MOVE_KERNELS:
        setattr(ep_move, fn_name, recorder(fn_name, getattr(ep_move, fn_name)))
    from etp.ep.backends import symm

    symm.copy_rows = recorder("copy_rows", symm.copy_rows)
    # 4-row tiles: T = 6, 3, 5 leave ragged tails; 2 programs loop over several tiles.
    cfg = ep.EPConfig(num_experts=4, topk=2, hidden_size=8, max_tokens_per_rank=6, dtype=torch.float32,
                      num_ctas=2, tile_rows=4, num_stages=2, backend=name)
    disp, ref_disp = ep.ExpertDispatcher(cfg), ep.ExpertDispatcher(ep.EPConfig(**{**cfg.__dict__,
                                                                                  "backend": "reference"}))
    gen = torch.Generator().manual_seed(1)
    errors = []
    # Correctness against reference, T shrinking so that stale rows must be zeroed.
    for tokens in (6, 3, 0, 5, 4):
        errors += _layer_against_reference(disp, ref_disp, gen, tokens, "")
    # The moves of one handle, step after step: identical launches, nothing allocated.
    per_step, allocs, seen, handle, x, w, recv_x = _steady_moves(disp, gen, launches)
    with torch.no_grad():
        # tune() changes the launches of the next moves, not their results.
        before = recv_x.clone()
        disp.dispatch_backend.tune(num_ctas=3, tile_rows=1, num_warps=4, num_stages=1)
        launches.clear()
        recv_x, _, _ = disp.dispatch(x, w, handle)
        if not torch.equal(recv_x, before):
            errors.append("dispatch after tune() differs")
        tuned = {(dict(kw)["num_ctas"], dict(kw)["rows"], dict(kw)["num_warps"], dict(kw)["stages"])
                 for _, _, kw in launches}
        if tuned != {(3, 1, 4, 1)}:
            errors.append(f"launches after tune(): {tuned}")
    return errors, per_step, allocs, seen


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the kernels on CPU tensors: needs the "
                    "Triton interpreter (set where there is no GPU); test_ep_gpu.py covers the GPU")
@pytest.mark.parametrize("name", SYMM)
def test_symm_backend_on_cpu_is_graph_safe_and_allocation_free(name):
    from harness import run_distributed

    [(errors, per_step, allocs, ops)] = run_distributed(_symm_on_cpu, 1, name)
    assert not errors, errors
    assert per_step[0], "no kernel launch recorded"
    # The combines push: symm_push its rows back to per-pair slots, the others their partial sums.
    launched = {fn: kw for fn, _, kw in per_step[0]}
    assert ("copy_rows" in launched) == (name == "symm_push")
    assert name == "symm_push" or "local_reduce" in launched
    # A CUDA graph replays the launches of its capture: every call must launch the same.
    for step in per_step[1:]:
        assert step == per_step[0], "a move's kernel arguments changed between steps"
    assert allocs == [[], [], []], allocs
    # Besides kernel launches a move may only copy and take views: a torch reduction (the
    # torch.sum(out=) that the first GPU run counted) allocates device workspace that no
    # output shows. new_empty / set_ / empty are the interpreter's zero-size host views.
    allowed = {"aten.copy_.default", "aten.slice.Tensor", "aten.view.default", "aten.new_empty.default",
               "aten.empty.memory_format", "aten.set_.source_Storage", "aten.set_.source_Storage_storage_offset",
               "aten.alias.default", "aten.as_strided.default"}
    assert {op for op in ops if not op.startswith("profiler.")} <= allowed, ops


# ---------------------------------------------------------------- the nccl backends' kernels on CPU
# Two gloo ranks; the pack / unpack steps forced onto the Triton kernels (the interpreter),
# which is what runs on a GPU (CPU tensors otherwise take the torch path).
def _nccl_on_cpu(ctx, name):
    from dataclasses import replace

    from etp import ep
    from etp.ep.backends import pack
    from etp.kernels import ep_move

    launches = []

    def recorder(module, fn_name):
        fn = getattr(module, fn_name)

        def record(*args, **kwargs):
            kw = tuple(sorted((k, _describe(v)) for k, v in kwargs.items()))
            launches.append((fn_name, tuple(map(_describe, args)), kw))
            return fn(*args, **kwargs)
        setattr(module, fn_name, record)

    for fn_name in ("push_rows", "pull_reduce", "pull_pairs", "zero_tail"):
        recorder(ep_move, fn_name)
    recorder(pack, "copy_rows")
    cfg = ep.EPConfig(num_experts=4, topk=2, hidden_size=8, max_tokens_per_rank=6, dtype=torch.float32,
                      num_ctas=2, tile_rows=4, num_stages=2, backend=name)
    disp, ref_disp = ep.ExpertDispatcher(cfg), ep.ExpertDispatcher(replace(cfg, backend="reference"))
    disp.dispatch_backend.tune(kernels="triton")
    gen = torch.Generator().manual_seed(7 + ctx.rank)
    errors = []
    for tokens in (6, 3 + ctx.rank, 0, 5):  # shrinking: stale rows must be zeroed
        errors += _layer_against_reference(disp, ref_disp, gen, tokens, f"{name} ")
    per_step, allocs, *_ = _steady_moves(disp, gen, launches)
    return errors, per_step, allocs


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter on CPU tensors")
@pytest.mark.parametrize("name", [pytest.param("nccl", marks=pytest.mark.slow), "nccl_padded"])
def test_nccl_backend_kernels_match_reference_without_allocating(name):
    from harness import run_distributed

    for errors, per_step, allocs in run_distributed(_nccl_on_cpu, 2, name):
        assert not errors, errors
        assert per_step[0] and all(step == per_step[0] for step in per_step[1:]), "launch arguments changed"
        assert {fn for fn, _, _ in per_step[0]} == {"push_rows", "pull_reduce", "pull_pairs", "zero_tail",
                                                    "copy_rows"}
        assert allocs == [[], [], []], allocs


# ---------------------------------------------------------------- hierarchical, its symmetric-memory side on CPU
# Two gloo ranks declared as 2 hosts x 1: the rail exchange on gloo, the within-host moves on
# the (stand-in) symmetric memory of each one-rank host, the kernels in the interpreter.
def _hierarchical_on_cpu(ctx):
    from dataclasses import replace

    from etp import ep

    _fake_symmetric_memory(setattr)
    cfg = ep.EPConfig(num_experts=4, topk=2, hidden_size=8, max_tokens_per_rank=6, dtype=torch.float32,
                      num_ctas=2, tile_rows=4, num_stages=2, backend="hierarchical", ranks_per_host=1)
    disp, ref_disp = ep.ExpertDispatcher(cfg), ep.ExpertDispatcher(replace(cfg, backend="reference"))
    gen = torch.Generator().manual_seed(3 + ctx.rank)
    errors = [] if type(disp.dispatch_backend._intra).__name__ == "SymmIntra" else ["not on symmetric memory"]
    for tokens in (6, 2 + ctx.rank, 0, 5):
        # per-host sums: another summation order
        errors += _layer_against_reference(disp, ref_disp, gen, tokens, "", exact=False)
    idx = torch.rand(6, 4, generator=gen).topk(2, dim=1).indices
    x, w = torch.randn(6, 8, generator=gen), torch.rand(6, 2, generator=gen)
    handle = disp.prepare(idx)
    allocs = []
    with torch.no_grad():
        for _ in range(2):
            with _Allocations() as mode:
                recv_x, recv_w, _ = disp.dispatch(x, w, handle)
                disp.combine(recv_x, handle)
                disp.dispatch_backward(recv_x, recv_w, handle)
            allocs.append(mode.ops)
    return errors, allocs


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter on CPU tensors")
def test_hierarchical_symmetric_side_matches_reference_without_allocating():
    from harness import run_distributed

    for errors, allocs in run_distributed(_hierarchical_on_cpu, 2):
        assert not errors, errors
        assert allocs == [[], []], allocs
