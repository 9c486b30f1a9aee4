"""The symmetric-memory move kernels of ``etp.kernels.ep_move``, W ranks simulated in one
process (pointer tables of local tensors stand in for symmetric memory; the Triton
interpreter runs them on CPU), bit for bit against ``etp.kernels.ep_reference`` and
against the receive layout of ``etp.ep.layout``."""
from __future__ import annotations

import pytest
import torch
from test_ep import make_case

from etp.ep.layout import count_pairs, pair_rows
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


def _check_all_moves(case, world, capacity, expert_capacity=None):
    idx, layouts, xs, ws = _simulate(case, world, capacity, expert_capacity)
    t_max, hidden, topk = 7, 5, 3
    tab = lambda bufs: km.table_of(bufs, DEVICE)  # noqa: E731
    # 1. direct push of rows and weights.
    recv_x, recv_w = _bufs(world, capacity, hidden), _bufs(world, capacity)
    want_x, want_w = _bufs(world, capacity, hidden), _bufs(world, capacity)
    for r, lay in enumerate(layouts):
        km.push_rows(xs[r], ws[r], lay.pair_row, lay.pair_rank, tab(recv_x), tab(recv_w), mode=km.X_ROWS,
                     num_ctas=3)
        ref.push_rows_ref(xs[r], ws[r], lay.pair_row, lay.pair_rank, want_x, want_w, mode=1)
    for d in range(world):
        assert torch.equal(recv_x[d], want_x[d]) and torch.equal(recv_w[d], want_w[d]), d
        total = int(layouts[d].tokens_per_expert.sum())
        assert total <= capacity and bool((recv_x[d][total:] == 0).all())
    # 2. rank de-duplicated push + metadata, then the local expansion gives the same rows.
    tok, want_tok = _bufs(world, world * t_max, hidden), _bufs(world, world * t_max, hidden)
    maps, want_maps = _bufs(world, capacity, dtype=torch.int64), _bufs(world, capacity, dtype=torch.int64)
    red = _bufs(world, world * t_max, topk, dtype=torch.int64, fill=7)
    want_red = [r.clone() for r in red]
    for r, lay in enumerate(layouts):
        km.push_rows(xs[r], None, lay.pair_row, lay.pair_rank, tab(tok), None, mode=km.X_DEDUP, me=r, t_max=t_max,
                     num_ctas=2)
        ref.push_rows_ref(xs[r], None, lay.pair_row, lay.pair_rank, want_tok, None, mode=2, me=r, t_max=t_max)
        km.push_meta(lay.pair_row, lay.pair_rank, tab(maps), tab(red), world, r, t_max, topk, num_ctas=2)
        ref.push_meta_ref(lay.pair_row, lay.pair_rank, want_maps, want_red, r, t_max, topk)
    for d in range(world):
        assert torch.equal(tok[d], want_tok[d]) and torch.equal(maps[d], want_maps[d])
        n_valid = [x.shape[0] for x in xs]
        for s in range(world):  # slots past a rank's tokens keep stale values
            assert torch.equal(red[d][s * t_max: s * t_max + n_valid[s]], want_red[d][s * t_max: s * t_max + n_valid[s]])
        out = torch.full((capacity, hidden), 9.0, device=DEVICE)
        totals = torch.tensor([capacity, -5], dtype=torch.int64, device=DEVICE)
        km.select_rows(tok[d], maps[d], out, layouts[d].tokens_per_expert, totals, num_ctas=3)
        assert torch.equal(out, recv_x[d]), f"expanded rows of rank {d} differ from the direct push"
        total = int(layouts[d].tokens_per_expert.sum())
        assert totals.tolist() == [total, total]  # the kernel carried the new total on device
        out[total:] = 9.0  # rows past the recorded total are not the kernel's to clear
        km.zero_tail(out, torch.zeros_like(layouts[d].tokens_per_expert), totals, num_ctas=2)
        assert bool((out[:total] == 0).all()) and bool((out[total:] == 9.0).all()) and totals[0] == 0
        want_out, want_totals = out.clone(), totals.clone()
        km.select_rows(tok[d], maps[d], out, layouts[d].tokens_per_expert, totals, num_ctas=3)
        ref.select_rows_ref(tok[d], maps[d], want_out, layouts[d].tokens_per_expert, want_totals)
        assert torch.equal(out, want_out) and totals[0] == want_totals[0]
    # 3. all-gather of the token rows.
    staged = [torch.cat([x, torch.full((t_max - x.shape[0], hidden), 3.0, device=DEVICE)]) for x in xs]
    tokens = layouts[0].tokens
    got, want = _bufs(1, world * t_max, hidden, fill=-1.0)[0], _bufs(1, world * t_max, hidden, fill=-1.0)[0]
    km.gather_tokens(tab(staged), tokens, got, t_max, num_ctas=4)
    ref.gather_tokens_ref(staged, tokens, want, t_max)
    assert torch.equal(got, want)
    # 4. combine: pull-reduce, and local reduce + de-duplicated pull; per-pair scalars.
    gen = torch.Generator().manual_seed(0)
    ys = [torch.randn(capacity, hidden, generator=gen).to(DEVICE) for _ in range(world)]
    partial, want_partial = _bufs(world, world * t_max, hidden), _bufs(world, world * t_max, hidden)
    for d in range(world):
        km.local_reduce(ys[d], red[d], tokens, partial[d], t_max, num_ctas=3)
        ref.local_reduce_ref(ys[d], red[d], tokens, want_partial[d], t_max)
        assert torch.equal(partial[d], want_partial[d])
    for r, lay in enumerate(layouts):
        T = xs[r].shape[0]
        out, want = torch.empty(T, hidden, device=DEVICE), torch.empty(T, hidden, device=DEVICE)
        km.pull_reduce(tab(ys), lay.pair_row, lay.pair_rank, out, num_ctas=2)
        ref.pull_reduce_ref(ys, lay.pair_row, lay.pair_rank, want)
        assert torch.equal(out, want)
        out2, want2 = torch.empty(T, hidden, device=DEVICE), torch.empty(T, hidden, device=DEVICE)
        km.pull_reduce(tab(partial), lay.pair_row, lay.pair_rank, out2, dedup=True, me=r, t_max=t_max, num_ctas=2)
        ref.pull_reduce_ref(partial, lay.pair_row, lay.pair_rank, want2, dedup=True, me=r, t_max=t_max)
        assert torch.equal(out2, want2)
        torch.testing.assert_close(out2, out, rtol=1e-6, atol=1e-6)  # same sum, other order
        pairs, want_pairs = torch.empty(T * topk, device=DEVICE), torch.empty(T * topk, device=DEVICE)
        km.pull_pairs(tab(recv_w), lay.pair_row, lay.pair_rank, pairs, num_ctas=2)
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
