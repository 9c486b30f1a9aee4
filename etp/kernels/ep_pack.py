"""Triton kernel that packs and unpacks expert-parallel rows around an NCCL exchange.

``copy_rows`` moves whole rows through an index map, over a row range: a scatter
(``dst[idx[i]] = src[i]``) or a gather (``dst[i] = src[idx[i]]``), skipping rows whose index
is negative (padding, or rows that stay on this rank). With ``push_rows`` and
``pull_reduce`` of ``etp.kernels.ep_move`` over two-buffer pointer tables it is every
permutation the ``nccl`` backends fuse around ``all_to_all_single`` (see
``etp.ep.backends.nccl``); scattering into a pointer table of peers' buffers, it is how
``symm_push`` returns expert rows to their sources' per-pair slots. Same tiling as the move kernels ([Note: row tiles] in
``etp.kernels.ep_move``). The pure-torch reference is ``copy_rows_ref`` in
``etp.kernels.ep_reference``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from etp.kernels import ep_tiles as tiles
from etp.kernels.launch import launch

__all__ = ["copy_rows"]


@triton.jit
def _copy_rows_kernel(src_ptr, idx_ptr, dst_ptr, tpe_ptr, start, end, H, slot_rows, SCATTER: tl.constexpr,
                      COUNTED: tl.constexpr, E_LOCAL: tl.constexpr, E_PAD: tl.constexpr, TABLE: tl.constexpr,
                      ROWS: tl.constexpr, BLOCK_H: tl.constexpr, ALIGN: tl.constexpr, STAGES: tl.constexpr):
    """For i in [start, end) with ``idx[i] >= 0``: SCATTER ``dst[idx[i]] = src[i]``, else
    ``dst[i] = src[idx[i]]``; rows with a negative index are left as they are. COUNTED: ``end``
    is at most ``sum(tokens_per_expert)`` (read on device). TABLE (with SCATTER): ``dst_ptr``
    is a pointer table and ``idx[i]`` names row ``idx[i] % slot_rows`` of rank
    ``idx[i] // slot_rows``'s buffer; each program then copies a contiguous share of the rows."""
    if COUNTED:
        e = tl.arange(0, E_PAD)
        end = tl.minimum(end, tl.sum(tl.load(tpe_ptr + e, mask=e < E_LOCAL, other=0), axis=0))
    n_h = tl.cdiv(H, BLOCK_H)
    n_it = tl.cdiv(end - start, ROWS) * n_h
    if TABLE:
        # Each program takes a contiguous share of the rows: programs running at once are
        # spread over the whole range, hence over every source rank's blocks of rows, instead
        # of all writing to the one rank whose rows come next (see [Note: peer order]).
        per = tl.cdiv(n_it, tl.num_programs(0))
        first, step, count = tl.program_id(0) * per, 1, per
    else:
        first, step = tl.program_id(0), tl.num_programs(0)
        count = tl.cdiv(n_it - first, step)
    for m in tl.range(0, count, num_stages=STAGES):
        it = first + m * step
        i = (start + (it // n_h) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        h = (it % n_h) * BLOCK_H + tl.arange(0, BLOCK_H)
        live = i < end
        q = tl.load(idx_ptr + i, mask=live, other=-1)
        ok = live & (q >= 0)
        q = tl.where(ok, q, 0)
        mask = ok[:, None] & (h < H)[None, :]
        if SCATTER:
            vals = tl.load(src_ptr + (i * H)[:, None] + h[None, :], mask=mask)
            if TABLE:
                base = tl.load(dst_ptr + q // slot_rows, mask=ok, other=0).to(tl.pointer_type(src_ptr.dtype.element_ty))
                dst = tl.multiple_of(base + (q % slot_rows) * H, ALIGN)
            else:
                dst = dst_ptr + q * H
            tl.store(dst[:, None] + h[None, :], vals, mask=mask)
        else:
            vals = tl.load(src_ptr + (q * H)[:, None] + h[None, :], mask=mask)
            tl.store(dst_ptr + (i * H)[:, None] + h[None, :], vals, mask=mask)


def copy_rows(src, idx, dst, start: int, end: int, *, scatter: bool, tokens_per_expert=None, slot_rows: int = 0,
              num_ctas: int = 32, rows=None, num_warps: int = tiles.DEFAULT_NUM_WARPS,
              stages: int = tiles.DEFAULT_STAGES) -> None:
    """Rows ``[start, end)`` of ``idx`` (int64): ``scatter`` writes ``src[i]`` to
    ``dst[idx[i]]``, else ``dst[i]`` takes ``src[idx[i]]``; negative entries are skipped.
    ``src`` and ``dst`` are ``[rows, H]`` (or 1-D: one value per row) of one dtype.
    ``tokens_per_expert`` (device): rows past its sum are skipped too (no host value for a
    count known on device only). ``slot_rows`` > 0 (scatter only): ``dst`` is a pointer table
    of peers' buffers of ``src``'s dtype and row width, ``idx[i]`` a slot
    ``rank * slot_rows + row`` (the rows go to the peers).

    Example::

        copy_rows(arrived, arrival_row, recv_x, 0, n_arrived, scatter=True)   # unpack
    """
    table = slot_rows > 0
    if table and not scatter:
        raise ValueError("copy_rows: a pointer-table destination (slot_rows > 0) needs scatter=True")
    if not table and src.dtype != dst.dtype:
        raise ValueError(f"copy_rows: src is {src.dtype}, dst {dst.dtype}; expected one dtype")
    if end <= start:
        return
    H = 1 if src.dim() == 1 else src.shape[1]
    ROWS = tiles.tile_rows(rows, H)
    counts = tokens_per_expert if tokens_per_expert is not None else idx
    n_local = counts.numel() if tokens_per_expert is not None else 1
    launch(_copy_rows_kernel, tiles.grid(num_ctas), src, idx, dst, counts, start, end, H, max(slot_rows, 1),
           SCATTER=scatter, COUNTED=tokens_per_expert is not None, E_LOCAL=n_local,
           E_PAD=triton.next_power_of_2(n_local), TABLE=table, ROWS=ROWS, BLOCK_H=tiles.row_block(H),
           ALIGN=tiles.row_align(src), STAGES=tiles.pipeline_stages(stages, ROWS, H, src.element_size()),
           num_warps=num_warps)
