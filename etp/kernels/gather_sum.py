"""Each token's sum of its K expert rows, gathered and summed in one pass: the combine of
etp's local dispatcher (and its dispatch's backward).

[Note: fused gather-sum]
``out[t] = sum_k rows[inverse[t * K + k]]``, accumulated in float32 (float64 for float64 rows)
in k order and rounded once. Written as ``rows.index_select(0, inverse).view(T, K, H).sum(1)``
it is two passes that write and read back the ``[T*K, H]`` gathered copy: three times the
bytes of one pass that reads each row once and writes ``[T, H]``. ``gather_sum_reference`` is
the definition (and the CPU fallback); the Triton kernel matches it bit for bit.

Example::

    out = gather_sum(expert_rows, inverse, topk)    # [T, H]
"""
from __future__ import annotations

import torch

from etp.kernels.amax import accumulator_dtype

try:  # triton is optional on CPU-only installs; the reference serves there
    import triton
    import triton.language as tl

    from etp.kernels.amax import _DTYPE_CODE, cdiv, interpreter_active, load_ty, select_impl
    from etp.kernels.fp8_convert import _to_ty
    from etp.kernels.launch import launch
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None

__all__ = ["gather_sum", "gather_sum_reference", "sum_in_k_order"]

_TOKENS = 4     # tokens per program
_COLUMNS = 1024  # columns per program


def sum_in_k_order(per_pair: torch.Tensor) -> torch.Tensor:
    """``per_pair[:, 0] + ... + per_pair[:, K-1]`` of ``[T, K, H]`` rows, added one k at a time in
    float32 (float64 for float64 rows), not rounded back: the order every combine of etp's
    (local and expert-parallel) reproduces bit for bit."""
    acc = per_pair[:, 0].to(accumulator_dtype(per_pair.dtype))
    for k in range(1, per_pair.shape[1]):
        acc += per_pair[:, k]
    return acc


def gather_sum_reference(rows: torch.Tensor, inverse: torch.Tensor, topk: int) -> torch.Tensor:
    """The definition of ``gather_sum``: token t's K rows ``rows[inverse[t*K : t*K+K]]`` summed
    by ``sum_in_k_order``, rounded once to ``rows.dtype``."""
    per_pair = rows.index_select(0, inverse).view(-1, topk, rows.shape[1])
    return sum_in_k_order(per_pair).to(rows.dtype)


if triton is not None:

    @triton.jit
    def _gather_sum_kernel(rows_ptr, inv_ptr, out_ptr, T, H, row_stride, K: tl.constexpr, TY: tl.constexpr,
                           SOFT_BF16: tl.constexpr, TOKENS: tl.constexpr, COLUMNS: tl.constexpr):
        t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
        h = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)
        t_ok = t < T
        mask = t_ok[:, None] & (h < H)[None, :]
        t64 = t.to(tl.int64)
        acc = tl.zeros([TOKENS, COLUMNS], dtype=tl.float32)
        for k in tl.static_range(K):  # k order: the reference's order of additions
            r = tl.load(inv_ptr + t64 * K + k, mask=t_ok, other=0).to(tl.int64)
            acc += tl.load(rows_ptr + r[:, None] * row_stride + h[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t64[:, None] * H + h[None, :], _to_ty(acc, TY, SOFT_BF16), mask=mask)


def gather_sum(rows: torch.Tensor, inverse: torch.Tensor, topk: int, *, impl: str = "auto") -> torch.Tensor:
    """``[T, H]``: each token's sum of its ``topk`` rows of ``rows`` [T*K, H], row
    ``inverse[t * topk + k]`` for its k-th ([Note: fused gather-sum]). ``impl``: "auto" (Triton
    on CUDA for 16- and 32-bit rows, the reference elsewhere), "triton" or "torch".

    Example::

        out = gather_sum(rows, inverse, 8)
    """
    if rows.dim() != 2 or inverse.dim() != 1 or topk < 1 or inverse.numel() % topk:
        raise ValueError(f"gather_sum: rows {tuple(rows.shape)} must be [T*K, H] and inverse {tuple(inverse.shape)} "
                         f"[T*K] with T*K a multiple of topk={topk}")
    if triton is None or rows.dtype not in _DTYPE_CODE or not select_impl(impl, rows.device):
        return gather_sum_reference(rows, inverse, topk)
    tokens, columns = inverse.numel() // topk, rows.shape[1]
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(tokens, columns, dtype=rows.dtype, device=rows.device)
    if tokens and columns:
        launch(_gather_sum_kernel, (cdiv(tokens, _TOKENS), cdiv(columns, _COLUMNS)), rows, inverse.contiguous(), out,
               tokens, columns, rows.stride(0), K=topk, TY=load_ty(rows.dtype, soft=False),
               SOFT_BF16=interpreter_active() and rows.dtype == torch.bfloat16, TOKENS=_TOKENS, COLUMNS=_COLUMNS,
               num_warps=4, enable_fp_fusion=False)
    return out
