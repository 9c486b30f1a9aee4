"""Cross-entropy over a vocabulary that keeps only the 16-bit logits for backward.

[Note: logits cross-entropy]
megatron-core's ``vocab_parallel_cross_entropy`` widens the logits ``[N, V]`` to fp32, keeps
their fp32 softmax for backward and returns an fp32 gradient that autograd then rounds to the
logits' dtype: 4 x N x V bytes kept from the forward to the backward, 6 x N x V alive at the
loss in each direction, and about ten passes over the fp32 copy. With a vocabulary of 150 K and
16 K tokens per micro-batch that is 9 GiB kept and 14 GiB at the peak, more than a transformer
layer's activations.

Here the forward reads each row once (``cross_entropy_stats``: an online max and sum of
exponentials per row, and the target's logit) and keeps the 16-bit logits themselves; the
backward reads them once more and writes ``(softmax - one_hot) x grad`` over them, in place
(``cross_entropy_grad_``): N x V x 2 bytes kept, nothing added at either peak. A row's
statistics are combined across vocabulary shards by the caller
(``etp.megatron.cross_entropy``).

Numerics (the pure-torch references define them): float32 math on the widened logits (float64
for float64 logits), ``max_r``, ``sum_r = sum_v exp(x_rv - max_r)``, the gradient
``exp(x_rv - max) / sum`` less 1 at the target, times the row's upstream gradient, rounded once
to the logits' dtype. The kernels sum the exponentials in another order than torch and their
``exp`` may differ in the last float32 bit: statistics agree with the references to float32
rounding, gradients to one unit of the logits' dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from etp.kernels.amax import (
    _DTYPE_CODE,
    _to_f32,
    accumulator_dtype,
    check_impl,
    interpreter_active,
    next_pow2,
    select_impl,
)
from etp.kernels.blockwise import _soft_view
from etp.kernels.fp8_convert import _f32_to_bf16_bits
from etp.kernels.launch import launch

__all__ = ["cross_entropy_grad_", "cross_entropy_grad_reference", "cross_entropy_stats",
           "cross_entropy_stats_reference"]

_BLOCK = 4096  # columns per loop step of a row's program (fewer for a narrower vocabulary)
_WARPS = 8


@triton.jit
def _stats_kernel(x_ptr, target_ptr, max_ptr, sum_ptr, tlogit_ptr, V, stride,
                  DTYPE: tl.constexpr, SOFT: tl.constexpr, BLOCK: tl.constexpr):
    """Row r: max_r, sum_v exp(x_rv - max_r) (an online max and rescaled sum per lane, merged
    at the end) and x_r[target_r] (0 where target_r < 0: the target is on another shard)."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    offs = tl.arange(0, BLOCK)
    # Lanes start at the lowest finite float32, not -inf: exp(-inf - -inf) would be NaN.
    m = tl.full([BLOCK], -3.4028234663852886e38, tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for c0 in range(0, V, BLOCK):
        cols = c0 + offs
        ok = cols < V
        x = tl.where(ok, _to_f32(tl.load(base + cols, mask=ok, other=0), DTYPE, SOFT), float("-inf"))
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    row_max = tl.max(m, axis=0)
    total = tl.sum(s * tl.exp(m - row_max), axis=0)
    t = tl.load(target_ptr + row)
    hit = t >= 0
    xt = _to_f32(tl.load(base + tl.maximum(t, 0)), DTYPE, SOFT)
    tl.store(max_ptr + row, row_max)
    tl.store(sum_ptr + row, total)
    tl.store(tlogit_ptr + row, tl.where(hit, xt, 0.0))


@triton.jit
def _grad_kernel(x_ptr, target_ptr, max_ptr, sum_ptr, g_ptr, V, stride,
                 DTYPE: tl.constexpr, SOFT: tl.constexpr, BLOCK: tl.constexpr):
    """x_r <- (exp(x_r - max_r) / sum_r - one_hot(target_r)) * g_r, in place, block by block."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    offs = tl.arange(0, BLOCK)
    row_max = tl.load(max_ptr + row)
    total = tl.load(sum_ptr + row)
    g = tl.load(g_ptr + row)
    t = tl.load(target_ptr + row)
    for c0 in range(0, V, BLOCK):
        cols = c0 + offs
        ok = cols < V
        x = _to_f32(tl.load(base + cols, mask=ok, other=0), DTYPE, SOFT)
        p = tl.exp(x - row_max) / total
        d = tl.where(cols == t, p - 1.0, p) * g
        if DTYPE == 0:
            if SOFT:
                tl.store(base + cols, _f32_to_bf16_bits(d), mask=ok)
            else:
                tl.store(base + cols, d.to(tl.bfloat16), mask=ok)
        elif DTYPE == 1:
            tl.store(base + cols, d.to(tl.float16), mask=ok)
        else:
            tl.store(base + cols, d, mask=ok)


def _check(logits: torch.Tensor, target: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits {tuple(logits.shape)}: expected [rows, vocab] with contiguous rows")
    if not logits.is_floating_point():
        raise ValueError(f"logits: expected floating-point values, got {logits.dtype}")
    if target.shape != logits.shape[:1] or target.dtype != torch.int64:
        raise ValueError(f"target {tuple(target.shape)} {target.dtype}: expected int64 [{logits.shape[0]}] "
                         "(this shard's column of each row's target, -1 where it is on another shard)")


def _use_triton(impl: str, logits: torch.Tensor) -> bool:
    check_impl(impl)
    kernel_ok = logits.dtype in _DTYPE_CODE and logits.shape[1] > 0
    if impl == "auto":
        # CUDA only: under the interpreter the kernel is for the tests that ask for it (impl="triton");
        # picked by auto it made every CPU training run of the suite twenty times slower.
        return kernel_ok and logits.is_cuda
    if impl == "triton" and not kernel_ok:
        raise ValueError(f"impl='triton': logits of {logits.dtype} with {logits.shape[1]} columns have no kernel "
                         "(bf16 / fp16 / fp32, at least one column)")
    return select_impl(impl, logits.device)  # 'triton' off CUDA without the interpreter: RuntimeError


def cross_entropy_stats_reference(logits: torch.Tensor, target: torch.Tensor):
    """``(max, sum of exp(x - max), target logit)`` per row, pure torch; see the module note."""
    _check(logits, target)
    x = logits.to(accumulator_dtype(logits.dtype))
    row_max = x.max(dim=1).values
    total = (x - row_max[:, None]).exp().sum(dim=1)
    picked = x.gather(1, target.clamp(min=0)[:, None]).squeeze(1)
    return row_max, total, torch.where(target >= 0, picked, torch.zeros_like(picked))


def cross_entropy_grad_reference(logits, target, row_max, row_sum, grad) -> torch.Tensor:
    """Writes ``(softmax - one_hot(target)) x grad`` over ``logits`` and returns it; pure torch."""
    _check(logits, target)
    x = logits.to(accumulator_dtype(logits.dtype))
    d = (x - row_max[:, None].to(x.dtype)).exp() / row_sum[:, None].to(x.dtype)
    hit = target >= 0
    rows = torch.arange(logits.shape[0], device=logits.device)[hit]
    d[rows, target[hit]] -= 1.0
    return logits.copy_(d * grad[:, None].to(x.dtype))


def cross_entropy_stats(logits: torch.Tensor, target: torch.Tensor, *, impl: str = "auto"):
    """Per-row statistics of ``logits [N, V]`` for a cross-entropy: one read of each row.

    Args:
        logits: ``[N, V]``, rows contiguous; bf16 / fp16 / fp32 in the kernel, any float in torch.
        target: int64 ``[N]``, each row's target column here, -1 where the target is in another
            shard of the vocabulary.
        impl: "auto" (Triton on CUDA, else torch), "triton" (on CPU under the Triton interpreter too), "torch".

    Returns:
        ``(row_max, row_sum, target_logit)``, float32 (float64 for float64 logits) ``[N]``:
        ``max_v x``, ``sum_v exp(x - max)`` and ``x[target]`` (0 where target is -1). The loss of
        an unsharded row is ``log(row_sum) + row_max - target_logit``.

    Example::

        row_max, row_sum, picked = cross_entropy_stats(logits.view(-1, vocab), labels.view(-1))
        loss = row_sum.log() + row_max - picked
    """
    _check(logits, target)
    if not _use_triton(impl, logits):
        return cross_entropy_stats_reference(logits, target)
    rows, vocab = logits.shape
    out = torch.empty(3, rows, dtype=torch.float32, device=logits.device)
    if rows:
        soft = interpreter_active()
        launch(_stats_kernel, (rows,), _soft_view(logits, soft), target, out[0], out[1], out[2], vocab,
               logits.stride(0), DTYPE=_DTYPE_CODE[logits.dtype], SOFT=soft, BLOCK=min(_BLOCK, next_pow2(vocab)),
               num_warps=_WARPS)
    return out[0], out[1], out[2]


def cross_entropy_grad_(logits: torch.Tensor, target: torch.Tensor, row_max: torch.Tensor, row_sum: torch.Tensor,
                        grad: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """Overwrites ``logits [N, V]`` with the gradient of the cross-entropy, in place, and returns it.

    Args:
        logits, target, impl: as ``cross_entropy_stats``.
        row_max, row_sum: float32 ``[N]``: the row's max and sum of exponentials over the whole
            vocabulary (every shard's, combined).
        grad: float32 ``[N]``, the upstream gradient of each row's loss.

    Returns:
        ``logits`` itself, now ``(exp(x - row_max) / row_sum - one_hot(target)) x grad`` in its dtype.

    Example::

        grad_logits = cross_entropy_grad_(logits_2d, target, row_max, row_sum, grad_loss.reshape(-1))
    """
    _check(logits, target)
    for name, t in (("row_max", row_max), ("row_sum", row_sum), ("grad", grad)):
        if t.shape != logits.shape[:1] or not t.is_contiguous():
            raise ValueError(f"{name} {tuple(t.shape)}: expected a contiguous [{logits.shape[0]}]")
    if not _use_triton(impl, logits):
        return cross_entropy_grad_reference(logits, target, row_max, row_sum, grad)
    rows, vocab = logits.shape
    if rows:
        soft = interpreter_active()
        f32 = [t.to(torch.float32) for t in (row_max, row_sum, grad)]
        launch(_grad_kernel, (rows,), _soft_view(logits, soft), target, *f32, vocab, logits.stride(0),
               DTYPE=_DTYPE_CODE[logits.dtype], SOFT=soft, BLOCK=min(_BLOCK, next_pow2(vocab)),
               num_warps=_WARPS)
    return logits
