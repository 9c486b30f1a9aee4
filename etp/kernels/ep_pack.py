"""Triton kernel that packs and unpacks expert-parallel rows around an NCCL exchange.

``copy_rows`` moves whole rows between two local buffers through an index map, over a row
range: a scatter (``dst[idx[i]] = src[i]``) or a gather (``dst[i] = src[idx[i]]``), skipping
rows whose index is negative (padding, or rows that stay on this rank). With ``push_rows``
and ``pull_reduce`` of ``etp.kernels.ep_move`` over one-buffer pointer tables it is every
permutation the ``nccl`` backends fuse around ``all_to_all_single`` (see
``etp.ep.backends.nccl``). Same tiling as the move kernels ([Note: row tiles] in
``etp.kernels.ep_move``). The pure-torch reference is ``copy_rows_ref`` in
``etp.kernels.ep_reference``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from etp.kernels.ep_move import DEFAULT_NUM_WARPS, DEFAULT_STAGES, _grid, _stages, row_block, tile_rows
from etp.kernels.launch import launch

__all__ = ["copy_rows"]


@triton.jit
def _copy_rows_kernel(src_ptr, idx_ptr, dst_ptr, start, end, H, SCATTER: tl.constexpr, ROWS: tl.constexpr,
                      BLOCK_H: tl.constexpr, STAGES: tl.constexpr):
    """For i in [start, end) with ``idx[i] >= 0``: SCATTER ``dst[idx[i]] = src[i]``, else
    ``dst[i] = src[idx[i]]``; rows with a negative index are left as they are."""
    n_h = tl.cdiv(H, BLOCK_H)
    for it in tl.range(tl.program_id(0), tl.cdiv(end - start, ROWS) * n_h, tl.num_programs(0), num_stages=STAGES):
        i = (start + (it // n_h) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        h = (it % n_h) * BLOCK_H + tl.arange(0, BLOCK_H)
        live = i < end
        q = tl.load(idx_ptr + i, mask=live, other=-1)
        ok = live & (q >= 0)
        q = tl.where(ok, q, 0)
        if SCATTER:
            src_row, dst_row = i, q
        else:
            src_row, dst_row = q, i
        mask = ok[:, None] & (h < H)[None, :]
        vals = tl.load(src_ptr + (src_row * H)[:, None] + h[None, :], mask=mask)
        tl.store(dst_ptr + (dst_row * H)[:, None] + h[None, :], vals, mask=mask)


def copy_rows(src, idx, dst, start: int, end: int, *, scatter: bool, num_ctas: int = 32, rows=None,
              num_warps: int = DEFAULT_NUM_WARPS, stages: int = DEFAULT_STAGES) -> None:
    """Rows ``[start, end)`` of ``idx`` (int64): ``scatter`` writes ``src[i]`` to
    ``dst[idx[i]]``, else ``dst[i]`` takes ``src[idx[i]]``; negative entries are skipped.
    ``src`` and ``dst`` are ``[rows, H]`` (or 1-D: one value per row) of one dtype.

    Example::

        copy_rows(arrived, arrival_row, recv_x, 0, n_arrived, scatter=True)   # unpack
    """
    if src.dtype != dst.dtype:
        raise ValueError(f"copy_rows: src is {src.dtype}, dst {dst.dtype}; expected one dtype")
    if end <= start:
        return
    H = 1 if dst.dim() == 1 else dst.shape[1]
    ROWS = tile_rows(rows, H)
    launch(_copy_rows_kernel, _grid(num_ctas), src, idx, dst, start, end, H, SCATTER=scatter, ROWS=ROWS,
           BLOCK_H=row_block(H), STAGES=_stages(stages, ROWS, H, dst.element_size()), num_warps=num_warps)
