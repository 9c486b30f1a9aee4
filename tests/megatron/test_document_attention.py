"""etp.megatron.document_attention ([Note: document attention]) against independent references:
the tiles its block mask keeps, skips and runs unmasked against the dense per-document mask
(megatron-core's dataset mask, tests/data/test_document_masks.py), torch's FlexAttention under it
against a float64 attention per document (forward on CPU; forward, backward and a CUDA-graph
replay on a GPU), and where SDPA under the dense mask runs instead."""
import math

import pytest
import torch

from etp.data.batch import document_ids, mask_from_document_ids
from etp.megatron import document_attention as da

EOD = 0


def _tokens(b: int, s: int, seed: int) -> torch.Tensor:
    """Rows with a document over several tiles, one-token documents, an eod last, one document."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 50, (b, s), generator=gen)
    tokens[0, [3, 4, 5, min(300, s - 2), s - 1]] = EOD  # one-token documents 4, 5; then one over tiles
    if b > 1:
        tokens[1, torch.randperm(s, generator=gen)[:20]] = EOD
    if b > 2:
        tokens[2] = 7  # one document over the whole row: every tile below the diagonal is full
    return tokens


def _tiles(counts: torch.Tensor, indices: torch.Tensor) -> set:
    b, _, n = counts.shape
    return {(i, q, int(kv)) for i in range(b) for q in range(n) for kv in indices[i, 0, q, :int(counts[i, 0, q])]}


def test_block_mask_keeps_exactly_the_tiles_the_dense_mask_needs():
    tokens = _tokens(3, 4 * da.BLOCK, 0)
    ids = document_ids(tokens, EOD)
    allowed = ~mask_from_document_ids(ids)[:, 0]  # [b, s, s]
    n = tokens.shape[1] // da.BLOCK
    tiles = allowed.view(3, n, da.BLOCK, n, da.BLOCK).permute(0, 1, 3, 2, 4).flatten(-2)
    want_full = {(i, q, kv) for i in range(3) for q in range(n) for kv in range(n) if tiles[i, q, kv].all()}
    want_partial = {(i, q, kv) for i in range(3) for q in range(n) for kv in range(n)
                    if tiles[i, q, kv].any() and not tiles[i, q, kv].all()}
    mask = da.block_mask(ids)
    assert _tiles(mask.full_kv_num_blocks, mask.full_kv_indices) == want_full
    assert _tiles(mask.kv_num_blocks, mask.kv_indices) == want_partial
    # The cases were exercised: a full tile, a partial one below the diagonal, a skipped one.
    assert (2, 3, 0) in want_full and (0, 2, 1) in want_partial
    assert (0, 3, 0) not in want_full | want_partial


def test_each_mask_is_built_once_per_batch_and_again_after_a_write():
    """Through ``document_attention``'s cache: both kernels' masks, kept on the ids per version."""
    from etp.version_cache import per_version

    ids = document_ids(_tokens(2, 2 * da.BLOCK, 5), EOD)
    first = per_version(ids, "document_allowed", lambda: da._allowed(ids))
    q = torch.randn(2, 2, ids.shape[1], 8)
    da.document_attention(q, q, q, ids, scale=0.3)  # a layer reads the kept mask
    assert per_version(ids, "document_allowed", lambda: None) is first
    ids.copy_(document_ids(_tokens(2, 2 * da.BLOCK, 6), EOD))  # the next batch, into the same tensor
    da.document_attention(q, q, q, ids, scale=0.3)
    again = per_version(ids, "document_allowed", lambda: None)
    assert again is not first and torch.equal(again, ~mask_from_document_ids(ids))


def _reference(q, k, v, ids, scale):
    """float64 attention of each row under its allowed (same document, causal) pairs."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    scores = q.double() @ k.transpose(-1, -2) * scale
    scores = scores.masked_fill(mask_from_document_ids(ids), -math.inf)
    return scores.softmax(-1) @ v


def test_flex_forward_under_the_block_mask_is_attention_per_document_cpu():
    """torch's FlexAttention runs eagerly (forward only) on CPU: the mask_mod it evaluates."""
    from torch.nn.attention.flex_attention import flex_attention

    tokens = _tokens(2, 2 * da.BLOCK, 1)
    ids = document_ids(tokens, EOD)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, tokens.shape[1], 16, generator=gen)
    k, v = (torch.randn(2, 2, tokens.shape[1], 16, generator=gen) for _ in range(2))
    got = flex_attention(q, k, v, block_mask=da.block_mask(ids), scale=0.25, enable_gqa=True)
    want = _reference(q, k, v, ids, 0.25)
    assert (got.double() - want).abs().max() < 1e-5


def test_sdpa_under_the_dense_mask_runs_where_flex_does_not():
    assert "not on CUDA" in da.ineligible_reason("cpu", 0.0, 4096, 4096)
    assert da.ineligible_reason("cuda", 0.0, 4096, 4096) is None  # what etp-train prints at start-up
    assert "dropout 0.1" in da.ineligible_reason("cuda", 0.1, 4096, 4096)
    assert "multiples of 128" in da.ineligible_reason("cuda", 0.0, 4000, 4000)
    assert "multiples of 128" in da.ineligible_reason("cuda", 0.0, 4096, 2048)


def _inputs(seed, b=3, s=1024, heads=8, groups=2, d=64):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(b, groups, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    return q, k, v


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward needs a GPU")
def test_flex_forward_and_backward_match_float64_and_the_dense_mask_gpu():
    tokens = _tokens(3, 1024, 2).cuda()
    ids = document_ids(tokens, EOD)
    q, k, v = (t.requires_grad_() for t in _inputs(0))
    grad = torch.randn_like(q)
    scale = 64 ** -0.5
    flex = da.document_attention(q, k, v, ids, scale=scale)
    flex_grads = torch.autograd.grad(flex, (q, k, v), grad)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = _reference(*leaves, ids, scale)
    want_grads = torch.autograd.grad(want, leaves, grad.double())
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=~mask_from_document_ids(ids),
                                                             scale=scale, enable_gqa=True)
    dense_grads = torch.autograd.grad(dense, (q, k, v), grad)
    for got, ref, sdpa in zip((flex, *flex_grads), (want, *want_grads), (dense, *dense_grads)):
        err, sdpa_err = float((got.double() - ref).abs().max()), float((sdpa.double() - ref).abs().max())
        assert err <= max(2 * sdpa_err, 2e-2), (err, sdpa_err)  # within bf16's rounding, as SDPA is


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_captured_forward_and_backward_rebuilds_the_block_mask_from_new_ids_gpu():
    """The block mask is built inside the graph: a replay with other ids in the static input gives
    what an eager call with those ids gives."""
    q, k, v = (t.requires_grad_() for t in _inputs(1))
    static_ids = document_ids(_tokens(3, 1024, 3).cuda(), EOD)
    grad = torch.randn_like(q)

    def step():
        out = da.document_attention(q, k, v, static_ids, scale=0.125)
        return (out, *torch.autograd.grad(out, (q, k, v), grad))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # compiles, then warms the allocator
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    new_ids = document_ids(_tokens(3, 1024, 4).cuda(), EOD)
    assert not torch.equal(new_ids, static_ids)
    static_ids.copy_(new_ids)
    graph.replay()
    eager_ids = new_ids.clone()  # another tensor: the cache rebuilds
    eager = da.document_attention(q, k, v, eager_ids, scale=0.125)
    eager_grads = torch.autograd.grad(eager, (q, k, v), grad)
    for got, want in zip(captured, (eager, *eager_grads)):
        assert torch.equal(got, want)
