"""etp.kernels.ep_layout ([Note: layout in blocks]): the Triton layout, forced through
``etp.ep.routing_layout``'s ``kernel=True``, bit for bit against the pure-torch reference
(``count_pairs_torch`` / ``pair_rows_torch``) on W ranks simulated in one process: every
``Layout`` field of every rank, same dtypes and shapes. In the interpreter on CPU, compiled on
a GPU."""
import pytest
import torch

from etp.ep.routing_layout import Layout, count_pairs, count_pairs_torch, pair_rows, pair_rows_torch
from etp.kernels import ep_layout

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Out-of-range indices the router must never produce, but which the layout counts and skips.
_INVALID = torch.tensor([-1, -7, 1 << 40])


def _routing(world, num_experts, topk, tokens, seed, *, invalid=0.1, hot=None):
    """Per-rank [T, K] indices (``tokens[r]`` rows): uniform experts, a share ``invalid`` of
    out-of-range ones (-1, negative, E, far past E), repeated experts within a token, and
    with ``hot`` most pairs on that one expert (a skewed routing)."""
    g = torch.Generator().manual_seed(seed)
    ranks = []
    for t in tokens:
        idx = torch.randint(0, num_experts, (t, topk), generator=g)
        if hot is not None:
            idx = torch.where(torch.rand(t, topk, generator=g) < 0.9, hot, idx)
        if topk > 1:  # a token picking one expert twice
            dup = torch.rand(t, generator=g) < 0.2
            idx[dup, 1] = idx[dup, 0]
        bad = torch.rand(t, topk, generator=g) < invalid
        choices = torch.cat([_INVALID, torch.tensor([num_experts])])
        idx[bad] = choices[torch.randint(0, choices.numel(), (int(bad.sum()),), generator=g)]
        ranks.append(idx.to(DEVICE))
    return ranks


def _check(ranks, num_experts, capacity, expert_capacity, check_ranks=None, block=None):
    """The kernel layout of every rank in ``check_ranks`` (default all) equals the reference's;
    returns the layouts checked."""
    want_meta = torch.stack([count_pairs_torch(idx, num_experts) for idx in ranks])
    if block is None:
        counted = [count_pairs(idx, num_experts, return_blocks=True, kernel=True) for idx in ranks]
    else:
        counted = [ep_layout.count_pairs_triton(idx, num_experts, block=block) for idx in ranks]
    meta = torch.stack([m for m, _ in counted])
    assert meta.dtype == torch.int64 and torch.equal(meta, want_meta)
    layouts = []
    for r in check_ranks if check_ranks is not None else range(len(ranks)):
        want = pair_rows_torch(ranks[r], want_meta, r, capacity, expert_capacity)
        if block is None:
            got = pair_rows(ranks[r], meta, r, capacity, expert_capacity, blocks=counted[r][1], kernel=True)
        else:
            got = Layout(*ep_layout.pair_rows_triton(ranks[r], meta, counted[r][1], r, capacity, expert_capacity,
                                              block=block))
        for name, a, b in zip(Layout._fields, want, got):
            assert (a.dtype, a.shape) == (b.dtype, b.shape), (r, name, a.dtype, b.dtype, a.shape, b.shape)
            assert torch.equal(a, b), (r, name, a, b)
        layouts.append(got)
    return layouts


def _tight(ranks, world):
    """A capacity below what an even spread of the valid pairs needs per rank: rows get clipped."""
    return max(1, sum(idx.numel() for idx in ranks) // world // 2)


@pytest.mark.parametrize("world,num_experts,topk,tokens,tight,expert_capacity", [
    (1, 8, 1, [37], False, None),
    (1, 16, 4, [300], True, 6),
    (2, 8, 2, [0, 37], True, None),         # a rank without tokens
    (2, 16, 4, [1, 300], False, 3),
    (4, 16, 2, [37, 0, 1, 300], True, None),
    (4, 64, 4, [300, 37, 37, 1], True, 2),
    (8, 64, 1, [37, 0, 1, 37, 300, 1, 37, 0], False, None),
    (8, 8, 2, [37, 1, 0, 37, 1, 37, 1, 0], True, 1),
    (2, 8, 4, [0, 0], False, None),         # no pairs anywhere
])
def test_layout_matches_reference(world, num_experts, topk, tokens, tight, expert_capacity):
    ranks = _routing(world, num_experts, topk, tokens, seed=world * 1000 + num_experts * 10 + topk)
    capacity = _tight(ranks, world) if tight else sum(idx.numel() for idx in ranks)
    _check(ranks, num_experts, capacity, expert_capacity)


@pytest.mark.parametrize("block", [None, 32])
def test_skewed_routing_over_many_blocks(block):
    """Most pairs on one expert, over several blocks (the default block, and 32: 38 blocks),
    so the block prefix carries large counts and the cut of that expert (by its limit, or by
    the capacity) falls past the first block."""
    ranks = _routing(4, 16, 4, [300, 300, 37, 1], seed=7, invalid=0.05, hot=5)
    size = block or ep_layout.PAIR_BLOCK
    assert ranks[0].numel() > 2 * size
    hot = (ranks[0].reshape(-1) == 5).nonzero().squeeze(1)
    roomy = sum(idx.numel() for idx in ranks)
    for capacity, expert_capacity in ((roomy, None), (roomy, 600), (_tight(ranks, 4), None)):
        lay = _check(ranks, 16, capacity, expert_capacity, check_ranks=[0, 1], block=block)[0]
        sent = lay.pair_row[hot] >= 0
        assert hot[sent].max() > size
        if expert_capacity is not None or capacity < roomy:
            assert hot[~sent].min() > size


def test_out_and_torch_path():
    """``out=`` receives the meta; without ``kernel`` a CPU tensor takes the torch path (no
    blocks), and ``pair_rows`` on the kernel path counts its own blocks when given none."""
    ranks = _routing(2, 8, 2, [37, 5], seed=3)
    out = torch.full((10,), -5, dtype=torch.int64, device=DEVICE)
    meta, blocks = count_pairs(ranks[0], 8, out=out, return_blocks=True, kernel=True)
    assert meta.data_ptr() == out.data_ptr() and torch.equal(out, count_pairs_torch(ranks[0], 8))
    assert blocks.shape == (ep_layout.num_blocks(74), 9)
    meta_all = torch.stack([count_pairs_torch(idx, 8) for idx in ranks])
    got = pair_rows(ranks[1], meta_all, 1, 20, None, kernel=True)
    assert all(torch.equal(a, b) for a, b in zip(pair_rows_torch(ranks[1], meta_all, 1, 20, None), got))
    if DEVICE == "cpu":
        assert count_pairs(ranks[0], 8, return_blocks=True)[1] is None


def test_mismatched_blocks_are_refused():
    ranks = _routing(1, 8, 2, [37], seed=1)
    meta, blocks = ep_layout.count_pairs_triton(ranks[0], 8, block=32)
    with pytest.raises(ValueError, match="block_prefix"):
        ep_layout.pair_rows_triton(ranks[0], meta[None], blocks, 0, 74, None)  # counted with another block
