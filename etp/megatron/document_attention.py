"""Per-document causal attention (``reset_attention_mask``): FlexAttention under a block mask built
from the batch's document ids on CUDA, SDPA under the block-diagonal boolean mask elsewhere.

[Note: document attention]
With ``reset_attention_mask`` a batch carries ``[b, s]`` int32 document ids
(``etp.data.batch.document_ids``) where a plain run carries no mask: token ``i`` attends to ``j``
iff ``j <= i`` and both have the same id. Two kernels compute that exactly:

* ``flex``: ``torch.nn.attention.flex_attention``, compiled once, under a ``BlockMask`` of
  128 x 128 tiles: a tile above the diagonal or joining two documents is skipped, a tile inside
  one document below the diagonal runs without a mask, the rest evaluate ``mask_mod`` per score.
  Measured (``tools/bench_doc_attention.py``) faster than SDPA under the dense mask and than plain
  causal SDPA at sequence 4096, since it skips the tiles no document spans;
* ``sdpa_mask``: ``scaled_dot_product_attention`` under the ``[b, 1, s, s]`` boolean mask
  (``etp.data.batch.document_attention_mask``), for what flex does not cover here: CPU (torch's
  flex backward is GPU only), attention dropout (flex has none), sequences that are not a
  multiple of the tile. Deterministic runs keep flex: its Triton backward writes ``dq`` and
  ``dk`` / ``dv`` from separate programs, no atomics (``ids`` needs no gradient, so no
  captured-buffer scatter either).

``block_mask(ids)`` uses fixed-shape tensor ops only (no host synchronization), so a captured
step (``cuda_graph: step``) records it with the rest of the forward and a replay rebuilds it from
the new ids in the static input. Eagerly it is built once per batch, not per layer (so is the SDPA
path's dense mask): ``etp.version_cache.per_version`` keeps it on the ids tensor until a write
bumps its version; inside a capture each layer builds its own (a graph must compute what it
reads), a few small kernels per layer.

Example::

    ids = document_ids(tokens, eod)                       # [b, s] int32
    out = document_attention(q, k, v, ids, scale=d ** -0.5)   # q, k, v [b, heads or groups, s, d]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from etp.version_cache import per_version

__all__ = ["BLOCK", "block_mask", "document_attention", "ineligible_reason"]

#: FlexAttention's tile (query and key / value rows per block).
BLOCK = 128

_compiled = None


def _mask_mod(ids: torch.Tensor):
    def same_document_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (ids[b, q_idx] == ids[b, kv_idx])

    return same_document_causal


def block_mask(ids: torch.Tensor):
    """The ``BlockMask`` of [Note: document attention] for ``ids [b, s]`` (non-decreasing along
    each row, ``s`` a multiple of ``BLOCK``); heads broadcast.

    Example::

        mask = block_mask(torch.tensor([[0] * 200 + [1] * 56]))   # two query tiles
        mask.to_dense()[0, 0]   # tensor([[1, 0], [1, 1]]): both documents reach tile (1, 0)
    """
    from torch.nn.attention.flex_attention import BlockMask

    b, s = ids.shape
    n = s // BLOCK
    tiles = ids.view(b, n, BLOCK)
    low, high = tiles[..., 0], tiles[..., -1]  # ids never decrease: a tile's first and last are its range
    q_low, q_high = low[:, :, None], high[:, :, None]
    kv_low, kv_high = low[:, None, :], high[:, None, :]
    below = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril(-1)
    diagonal = torch.eye(n, dtype=torch.bool, device=ids.device)
    # Below the diagonal every kv id <= every q id: a tile pair shares a document iff kv's last
    # id is q's first; it needs no mask iff both tiles lie in that one document.
    shared = below & (kv_high == q_low)
    full = shared & (kv_low == kv_high) & (q_low == q_high)
    partial = (shared & ~full) | diagonal

    def ordered(needed: torch.Tensor):
        count = needed.sum(-1, dtype=torch.int32)
        # The needed tiles first, in ascending order: a stable sort of "not needed" (0 before 1).
        order = torch.argsort((~needed).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return count[:, None].contiguous(), order[:, None].contiguous()

    kv_num, kv_indices = ordered(partial)
    full_num, full_indices = ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_indices, full_num, full_indices, BLOCK_SIZE=BLOCK,
                                    mask_mod=_mask_mod(ids))


def _allowed(ids: torch.Tensor) -> torch.Tensor:
    """SDPA's form of the dense mask: True where a score attends."""
    from etp.data.batch import mask_from_document_ids

    return mask_from_document_ids(ids).logical_not()


def ineligible_reason(device_type: str, dropout_p: float, query_length: int, key_length: int) -> str | None:
    """Why FlexAttention does not run (SDPA under the dense mask does), or None; from the
    settings alone, so etp-train prints it at start-up.

    Example::

        ineligible_reason("cuda", 0.1, 4096, 4096)   # 'attention dropout 0.1 (FlexAttention has none)'
    """
    if device_type != "cuda":
        return "not on CUDA (torch's FlexAttention backward runs on GPUs only)"
    if dropout_p > 0.0:
        return f"attention dropout {dropout_p} (FlexAttention has none)"
    if query_length != key_length or query_length % BLOCK:
        return f"query / key lengths {query_length} / {key_length}: need equal multiples of {BLOCK}"
    return None


def _flex():
    global _compiled
    if _compiled is None:
        from torch.nn.attention.flex_attention import flex_attention

        # dynamic=False: one kernel per shape, as a training run has one sequence length.
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def document_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ids: torch.Tensor,
                       scale: float, dropout_p: float = 0.0, sdpa_kwargs: dict | None = None) -> torch.Tensor:
    """Per-document causal attention of ``query [b, heads, s, d]``, ``key`` / ``value [b, groups,
    s, d]`` (query heads ``g * heads / groups ..`` share group ``g``) under ``ids [b, s]``:
    ``[b, heads, s, d]``. FlexAttention where it runs, SDPA under the dense mask otherwise
    ([Note: document attention]); ``sdpa_kwargs`` go to the SDPA call (``enable_gqa``)."""
    if ineligible_reason(query.device.type, dropout_p, query.shape[2], key.shape[2]) is None:
        gqa = key.shape[1] != query.shape[1]
        mask = per_version(ids, "document_block_mask", lambda: block_mask(ids))
        return _flex()(query, key, value, block_mask=mask, scale=scale, enable_gqa=gqa)
    allowed = per_version(ids, "document_allowed", lambda: _allowed(ids))
    return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed,
                                          dropout_p=dropout_p, scale=scale,
                                          **(sdpa_kwargs or {}))
