"""How the expert-parallel move kernels tile their rows and launch: the column block of a row,
the rows of a tile, the pipeline depth that fits shared memory, the grid and the row alignment
the compiler may assume (see [Note: row tiles] in ``etp.kernels.ep_move``). Shared by the move
kernels (``ep_move``) and the pack kernels (``ep_pack``)."""
from __future__ import annotations

import torch
import triton

__all__ = ["DEFAULT_NUM_WARPS", "DEFAULT_STAGES", "grid", "pipeline_stages", "row_align", "row_block", "tile_rows"]

# Widest column block: a 4096-wide bf16 row is one block.
_MAX_BLOCK_H = 4096
# Elements one program reads per loop iteration by default: 32 KB of bf16 rows.
_TILE_ELEMS = 16384
DEFAULT_NUM_WARPS = 8
# Loop iterations in flight (see [Note: row tiles]) and the shared memory their loads may
# take (an H100 / H200 thread block may use 227 KB).
DEFAULT_STAGES = 3
_SMEM_BUDGET = 96 * 1024  # data tiles only; leaves room for the routing entries and the epilogue
_MAX_AUTO_ROWS = 64


def row_block(h: int) -> int:
    """BLOCK_H for rows of width ``h``: all of it up to 4096, else a power of two that
    divides ``h`` (no masked-off tail: 7168 -> 1024) where one >= 1024 does."""
    full = triton.next_power_of_2(max(h, 16))
    if full <= _MAX_BLOCK_H:
        return full
    for block in (4096, 2048, 1024):
        if h % block == 0:
            return block
    return _MAX_BLOCK_H


def tile_rows(rows, h: int, fan: int = 1) -> int:
    """ROWS of a tile. ``rows`` (None: ``_TILE_ELEMS`` elements' worth) counts rows of a copy,
    which reads one row per row it writes; a kernel that reads ``fan`` rows per row it writes
    (a reduction over K) or writes ``fan`` rows per row it reads (a push to a token's K pairs)
    takes ``rows // fan``, so that one setting means about the same bytes per iteration in every
    kernel (a power of two, at least 1). A push of tall tiles ([16, 1024] to K = 8 pairs) ran
    several times slower than one of [2, 1024] tiles, timed on rows of 7168."""
    if rows is None:
        # Capped: a tall, narrow tile would also pipeline ROWS x K routing entries per stage
        # (tens of KB of shared memory that the data-tile budget below does not count).
        rows = max(1, min(_MAX_AUTO_ROWS, _TILE_ELEMS // row_block(h)))
    elif not isinstance(rows, int) or rows < 1 or rows & (rows - 1):
        raise ValueError(f"rows={rows!r}: expected a power of two >= 1 (a tile is a tl.arange)")
    fit = max(1, rows // fan)
    return 1 << (fit.bit_length() - 1)


def grid(num_ctas: int):
    return (max(1, num_ctas),)


def row_align(rows: torch.Tensor) -> int:
    """Byte alignment the kernels may assume of every row start in a pointer-table buffer
    of ``rows``' row width. An address loaded from a table tells the compiler nothing, and
    without the hint it issues one 2-byte load per element instead of 16-byte vectors. The
    buffers themselves are allocations (symmetric memory, or whole tensors in the tests), so
    they start aligned; rows then stay 16-byte aligned when a row is a multiple of 16 bytes."""
    return 16 if rows.shape[-1] * rows.element_size() % 16 == 0 else rows.element_size()


def pipeline_stages(stages: int, rows: int, h: int, elem_bytes: int, loads: int = 1) -> int:
    """Pipeline depth that fits: the loads of ``stages - 1`` iterations wait in shared
    memory (``loads`` tiles of ``[rows, BLOCK_H]`` each)."""
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages={stages!r}: expected an int >= 1")
    per_stage = rows * row_block(h) * elem_bytes * loads
    return max(1, min(stages, 1 + _SMEM_BUDGET // per_stage))
