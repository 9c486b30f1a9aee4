"""Host side of the multi-tensor FP8 cast: its launch tables (every input's and destination's
address, size and first program, one table per input dtype), its output buffers and the
checks of caller-given destinations. The kernel is :mod:`etp.kernels.cast_kernel`, its
launcher :mod:`etp.kernels.cast`."""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch

from etp.kernels.amax import block_starts, cdiv, group_by_dtype, upload_tables

# Outputs share one allocation; each starts at a multiple of this many bytes so
# the kernel keeps its 16-byte-aligned (vectorised) path.
_OUT_ALIGN = 16


def _matrix_dims(t: torch.Tensor) -> Tuple[int, int]:
    """(rows, cols) of the trailing matrix, (0, 0) for 1-D tensors."""
    if t.dim() < 2:
        return 0, 0
    return t.shape[-2], t.shape[-1]


class _CastTables:
    """The cast's launch tables for one set of inputs and destinations, on the device: one
    flat int64 table per input dtype, and each launch's (dtype, tensors, programs, aligned)."""

    def __init__(self, tensors, qs, qts, block: int, iters: int, tile_r: int, tile_c: int) -> None:
        write_t = qts is not None
        chunk = block * iters
        self.write_t, self.launches = write_t, []
        tables = []
        for dtype, idxs in group_by_dtype(tensors).items():
            cols_tab: List[List[int]] = [[] for _ in range(8)]
            counts = []
            aligned = True
            for i in idxs:
                x, q = tensors[i], qs[i]
                qt = qts[i] if write_t else q
                rows, cols = _matrix_dims(x) if write_t else (0, 0)
                if rows:
                    counts.append((x.numel() // (rows * cols)) * cdiv(rows, tile_r) * cdiv(cols, tile_c))
                    aligned &= rows % 16 == 0 and cols % 16 == 0
                else:
                    counts.append(cdiv(x.numel(), chunk))
                addrs = (x.data_ptr(), q.data_ptr(), qt.data_ptr())
                aligned &= all(a % 16 == 0 for a in addrs)
                for col, v in zip(cols_tab, (*addrs, x.numel(), rows, cols, 0, i)):
                    col.append(v)
            starts, total = block_starts(counts)
            cols_tab[6] = starts
            tables.append(cols_tab)
            self.launches.append((dtype, len(idxs), total, aligned))
        self.device_tables = upload_tables(tables, tensors[0].device)[0] if tables else []


def _alloc_outputs(
    tensors: Sequence[torch.Tensor], write_transposed: bool
) -> Tuple[List[torch.Tensor], Optional[List[torch.Tensor]]]:
    """All outputs as views of one allocation (16-byte aligned pieces).

    One ``torch.empty`` instead of one per output: each call into the caching allocator
    costs host time, and for many shards (twice as many outputs with the transposed copies)
    the allocations alone would take longer than the kernel.
    """
    if not tensors:
        return [], ([] if write_transposed else None)
    device = tensors[0].device
    sizes, shapes = [], []
    for t in tensors:
        sizes.append(-(-t.numel() // _OUT_ALIGN) * _OUT_ALIGN)
        shapes.append(t.shape)
    if write_transposed:
        for t in tensors:
            if t.dim() >= 2:
                sizes.append(-(-t.numel() // _OUT_ALIGN) * _OUT_ALIGN)
                shapes.append((*t.shape[:-2], t.shape[-1], t.shape[-2]))
    buf = torch.empty(sum(sizes), dtype=torch.float8_e4m3fn, device=device)
    pieces = buf.split(sizes)
    outs = [p[: math.prod(shape)].view(shape) for p, shape in zip(pieces, shapes)]
    qs = outs[: len(tensors)]
    if not write_transposed:
        return qs, None
    rest = iter(outs[len(tensors):])
    qts = [q if t.dim() < 2 else next(rest) for t, q in zip(tensors, qs)]
    return qs, qts


def _check_out(out: Sequence[torch.Tensor], shapes, device: torch.device, what: str) -> List[torch.Tensor]:
    """The caller's destinations ``out`` as a list, each checked to be a contiguous
    float8_e4m3fn tensor of its input's (or transposed) shape on ``device``."""
    out = list(out)
    if len(out) != len(shapes):
        raise ValueError(f"{what} has {len(out)} tensors for {len(shapes)} inputs")
    for i, (o, shape) in enumerate(zip(out, shapes)):
        if o.dtype != torch.float8_e4m3fn or tuple(o.shape) != tuple(shape) or not o.is_contiguous() or o.device != device:
            raise ValueError(
                f"{what}[{i}] must be a contiguous float8_e4m3fn tensor of shape {tuple(shape)} on {device}, "
                f"got {o.dtype} {tuple(o.shape)} (contiguous={o.is_contiguous()}) on {o.device}"
            )
    return out
