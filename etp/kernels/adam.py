"""Fused multi-tensor AdamW: one pass over every fp32 master weight, its gradient (fp32 or
bf16) and both moments, writing the 16-bit model weight in the same pass.

[Note: fused AdamW]
A mixed-precision optimizer step reads and writes the fp32 state of every weight this rank
steps: weight, gradient, first and second moment in, weight and both moments out (28 bytes
per element), then copies each fp32 weight into its bf16 model weight (6 bytes more, a second
pass). Both are bound by memory bandwidth, and on a model of billions of weights per rank
they are a visible part of the step. torch's fused AdamW runs the update in one
multi-tensor launch family, but reaches well under the copy bandwidth, writes the
unscaled gradient back when given a ``grad_scale``, and leaves the bf16 copy to megatron.

``multi_tensor_adamw`` walks one launch table of all the tensors (the layout of
``etp.kernels.cast``: each program owns ``BLOCK * ITERS`` elements of one tensor), updates
in fp32 with torch's AdamW formula in torch's order of operations, and stores the bf16 model
weight from the updated fp32 value (round to nearest even, what ``copy_`` does). The gradient
is only read. ``adamw_reference`` is the pure-torch definition, the CPU fallback, and what
the kernel matches bit for bit in the Triton interpreter (no fused multiply-adds there, and
IEEE division and square root on the GPU).

A bf16 gradient is widened to fp32 exactly as it is loaded, so stepping from a bf16 gradient
equals stepping from the fp32 tensor of the same values, bit for bit, with 2 bytes less read
per element and no fp32 copy of the gradient anywhere ([Note: bf16 gradients, read in place]
in ``etp.megatron.fused_adamw`` says when megatron's gradients can stay bf16).

Per element, with ``g = grad / grad_scale`` when a scale is given::

    p = p - (lr * weight_decay) * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p = p - (lr / bias_correction1) * m / (sqrt(v) / sqrt(bias_correction2) + eps)

Example::

    multi_tensor_adamw(params, grads, exp_avgs, exp_avg_sqs, lr=3e-4, beta1=0.9, beta2=0.95,
                       eps=1e-8, weight_decay=0.1, step=7, out=bf16_weights)
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

try:  # triton is optional on CPU-only installs; the reference serves there
    import triton
    import triton.language as tl

    from etp.kernels.amax import (
        _DTYPE_CODE,
        _LINEAR_SEARCH_MAX_TENSORS,
        EXACT_FP,
        _DeviceTableCache,
        _find_tensor,
        _to_f32,
        block_starts,
        cdiv,
        interpreter_active,
        needs_staging,
        next_pow2,
        select_impl,
        upload_tables,
    )
    from etp.kernels.fp8_convert import _f32_to_bf16_bits
    from etp.kernels.launch import launch
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None

__all__ = ["AdamWScalars", "adamw_reference", "multi_tensor_adamw"]

# Each program updates BLOCK * ITERS elements of one tensor. Four fp32 streams in and three
# or four out per element already keep enough bytes in flight; more elements per thread only
# cost registers and occupancy (4,096 elements a program took 238 registers; blocks of 256 to
# 1024, 1 or 2 iterations and 2 to 8 warps measured within 5 % of each other on Qwen3's shards,
# 512 x 1 x 4 the fastest: benchmarks/adam_qwen3_etp4_1xh100_3e009d7.json).
_BLOCK = 512
_ITERS = 1
_WARPS = 4


class AdamWScalars:
    """The per-step scalars of AdamW, computed on the host in float64 from the step count.

    Example::

        s = AdamWScalars(lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=1)
    """

    def __init__(self, *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int):
        if step < 1:
            raise ValueError(f"step={step!r}: AdamW's bias corrections need a step count >= 1 (the first step is 1)")
        for name, value in (("beta1", beta1), ("beta2", beta2)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name}={value!r}: expected 0 <= {name} < 1")
        self.lr_wd = lr * weight_decay
        self.beta1, self.beta2 = beta1, beta2
        self.one_minus_beta1, self.one_minus_beta2 = 1.0 - beta1, 1.0 - beta2
        self.step_size = lr / (1.0 - beta1 ** step)
        self.bc2_sqrt = math.sqrt(1.0 - beta2 ** step)
        self.eps = eps

    def f32(self, name: str) -> torch.Tensor:
        """The scalar as the float32 the kernel computes with (a 0-dim tensor)."""
        return torch.tensor(getattr(self, name), dtype=torch.float32)


def adamw_reference(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                    exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor],
                    scalars: AdamWScalars, grad_scale: Optional[torch.Tensor] = None,
                    out: Optional[Sequence[torch.Tensor]] = None) -> None:
    """The definition of ``multi_tensor_adamw``: every operation in float32, in the kernel's
    order (see [Note: fused AdamW]); updates ``params``, ``exp_avgs``, ``exp_avg_sqs`` in place
    and writes ``out[i]`` (16-bit) from the updated ``params[i]``."""
    f = {name: scalars.f32(name) for name in ("lr_wd", "beta1", "beta2", "one_minus_beta1", "one_minus_beta2",
                                               "step_size", "bc2_sqrt", "eps")}
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        c = {k: t.to(p.device) for k, t in f.items()}
        g = g.float()
        if grad_scale is not None:
            g = g / grad_scale.reshape(()).float()
        p.sub_(c["lr_wd"] * p)
        m.copy_(c["beta1"] * m + c["one_minus_beta1"] * g)
        v.copy_(c["beta2"] * v + c["one_minus_beta2"] * g * g)
        # A correctly rounded float32 square root (the kernel's sqrt_rn): taken in float64 and
        # rounded once, which is exact for a square root; torch's CPU sqrt is not always.
        denom = torch.sqrt(v.double()).float() / c["bc2_sqrt"] + c["eps"]
        p.sub_(c["step_size"] * m / denom)
        if out is not None:
            out[i].copy_(p)


if triton is not None:

    @triton.jit
    def _adamw_chunk(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, o, mask, scale, lr_wd, beta1, beta2, omb1, omb2,
                     step_size, bc2_sqrt, eps, G_DTYPE: tl.constexpr, HAS_SCALE: tl.constexpr,
                     HAS_OUT: tl.constexpr, SOFT: tl.constexpr, MASKED: tl.constexpr):
        if MASKED:
            p = tl.load(p_ptr + o, mask=mask, other=0.0)
            g = tl.load(g_ptr + o, mask=mask, other=0, eviction_policy="evict_first")
            m = tl.load(m_ptr + o, mask=mask, other=0.0)
            v = tl.load(v_ptr + o, mask=mask, other=0.0)
        else:
            p = tl.load(p_ptr + o)
            g = tl.load(g_ptr + o, eviction_policy="evict_first")
            m = tl.load(m_ptr + o)
            v = tl.load(v_ptr + o)
        g = _to_f32(g, G_DTYPE, SOFT)  # exact: a bf16 gradient steps as its fp32 value would
        if HAS_SCALE:
            g = tl.div_rn(g, scale)
        p = p - lr_wd * p
        m = beta1 * m + omb1 * g
        v = beta2 * v + omb2 * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p - tl.div_rn(step_size * m, denom)
        if SOFT:
            q = _f32_to_bf16_bits(p)
        else:
            q = p.to(tl.bfloat16)
        if MASKED:
            tl.store(p_ptr + o, p, mask=mask)
            tl.store(m_ptr + o, m, mask=mask)
            tl.store(v_ptr + o, v, mask=mask)
            if HAS_OUT:
                tl.store(out_ptr + o, q, mask=mask)
        else:
            tl.store(p_ptr + o, p)
            tl.store(m_ptr + o, m)
            tl.store(v_ptr + o, v)
            if HAS_OUT:
                tl.store(out_ptr + o, q)

    @triton.jit
    def _multi_tensor_adamw_kernel(
        table_ptr,  # int64 [7, T]: param, grad, exp_avg, exp_avg_sq, out addresses, numel, first block
        scale_ptr,  # HAS_SCALE: float32 [1], the divisor of every gradient
        T,
        lr_wd, beta1, beta2, omb1, omb2, step_size, bc2_sqrt, eps,
        OUT_TY: tl.constexpr,
        G_TY: tl.constexpr,
        G_DTYPE: tl.constexpr,
        SOFT: tl.constexpr,
        HAS_SCALE: tl.constexpr,
        HAS_OUT: tl.constexpr,
        ALIGNED: tl.constexpr,
        LINEAR_SEARCH: tl.constexpr,
        T_POW2: tl.constexpr,
        BLOCK: tl.constexpr,
        ITERS: tl.constexpr,
    ):
        pid = tl.program_id(0)
        tid = _find_tensor(table_ptr + 6 * T, pid, T, LINEAR_SEARCH, T_POW2)
        p_ptr = tl.load(table_ptr + tid).to(tl.pointer_type(tl.float32))
        g_ptr = tl.load(table_ptr + T + tid).to(tl.pointer_type(G_TY))
        m_ptr = tl.load(table_ptr + 2 * T + tid).to(tl.pointer_type(tl.float32))
        v_ptr = tl.load(table_ptr + 3 * T + tid).to(tl.pointer_type(tl.float32))
        out_ptr = tl.load(table_ptr + 4 * T + tid).to(tl.pointer_type(OUT_TY))
        if ALIGNED:
            p_ptr = tl.multiple_of(p_ptr, 16)
            g_ptr = tl.multiple_of(g_ptr, 16)
            m_ptr = tl.multiple_of(m_ptr, 16)
            v_ptr = tl.multiple_of(v_ptr, 16)
            out_ptr = tl.multiple_of(out_ptr, 16)
        numel = tl.load(table_ptr + 5 * T + tid)
        start = (pid - tl.load(table_ptr + 6 * T + tid)) * (BLOCK * ITERS)
        scale = 1.0
        if HAS_SCALE:
            scale = tl.load(scale_ptr)
        offs = tl.arange(0, BLOCK)
        if start + BLOCK * ITERS <= numel:
            for i in tl.static_range(ITERS):  # unrolled: independent loads in flight together
                o = start + i * BLOCK + offs
                _adamw_chunk(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, o, None, scale, lr_wd, beta1, beta2, omb1,
                             omb2, step_size, bc2_sqrt, eps, G_DTYPE, HAS_SCALE, HAS_OUT, SOFT, False)
        else:
            for i in tl.static_range(ITERS):
                o = start + i * BLOCK + offs
                _adamw_chunk(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, o, o < numel, scale, lr_wd, beta1, beta2, omb1,
                             omb2, step_size, bc2_sqrt, eps, G_DTYPE, HAS_SCALE, HAS_OUT, SOFT, True)

    _TABLES = _DeviceTableCache(capacity=8)


def _check(params, grads, exp_avgs, exp_avg_sqs, grad_scale, out) -> None:
    n = len(params)
    for name, seq in (("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs),
                      ("out", out if out is not None else params)):
        if len(seq) != n:
            raise ValueError(f"{name} has {len(seq)} tensors, params {n}: pass one per param")
    grad_dtypes = {g.dtype for g in grads}
    if len(grad_dtypes) > 1:
        raise ValueError(f"grads are {sorted(map(str, grad_dtypes))}: pass one dtype per call (float32 or bfloat16)")
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        for name, t in (("param", p), ("grad", g), ("exp_avg", m), ("exp_avg_sq", v)):
            allowed = (torch.float32, torch.bfloat16) if name == "grad" else (torch.float32,)
            if t.dtype not in allowed or not t.is_contiguous():
                raise ValueError(f"{name} {i} is {t.dtype}{'' if t.is_contiguous() else ', not contiguous'}: "
                                 "the fused AdamW steps contiguous float32 masters and moments (gradients "
                                 "float32 or bfloat16)")
            if t.numel() != p.numel() or t.device != p.device:
                raise ValueError(f"{name} {i}: {t.numel()} elements on {t.device}, its param {p.numel()} on "
                                 f"{p.device}: every tensor of an entry must match its param")
        if out is not None:
            o = out[i]
            if o.dtype != torch.bfloat16 or not o.is_contiguous() or o.numel() != p.numel() or o.device != p.device:
                raise ValueError(f"out {i} is {o.dtype} with {o.numel()} elements on {o.device}: expected a contiguous "
                                 f"bfloat16 tensor of its param's {p.numel()} elements on {p.device}")
    if grad_scale is not None and grad_scale.numel() != 1:
        raise ValueError(f"grad_scale has {grad_scale.numel()} elements: expected one (the divisor of every gradient)")


def multi_tensor_adamw(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                       exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], *,
                       lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                       grad_scale: Optional[torch.Tensor] = None, out: Optional[Sequence[torch.Tensor]] = None,
                       impl: str = "auto") -> None:
    """One AdamW step of every ``params[i]`` (float32, contiguous) in place, from ``grads[i]``
    (float32 or bfloat16, one dtype for all; only read) and its moments (updated in place), all of one step count; writes the
    updated weight into ``out[i]`` (bfloat16) when given. ``grad_scale``: a 1-element device
    tensor every gradient is divided by (clipping's reciprocal coefficient), read on the device.
    The formula and rounding: [Note: fused AdamW]. ``impl``: "auto" (Triton on CUDA, the
    reference elsewhere), "triton" or "torch".

    Example::

        multi_tensor_adamw([w], [w.grad], [m], [v], lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                           weight_decay=0.0, step=1, out=[w16])
    """
    _check(params, grads, exp_avgs, exp_avg_sqs, grad_scale, out)
    scalars = AdamWScalars(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step)
    keep = [i for i, p in enumerate(params) if p.numel()]
    if not keep:
        return
    device = params[keep[0]].device
    if triton is None or not select_impl(impl, device):
        adamw_reference(params, grads, exp_avgs, exp_avg_sqs, scalars, grad_scale, out)
        return
    if needs_staging(device):  # the interpreter reads host memory: step CPU copies, then write back
        lists = [[t.cpu() for t in seq] for seq in (params, grads, exp_avgs, exp_avg_sqs)]
        out_cpu = None if out is None else [t.cpu() for t in out]
        multi_tensor_adamw(*lists, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step,
                           grad_scale=None if grad_scale is None else grad_scale.cpu(), out=out_cpu, impl=impl)
        for dst, src in zip([*params, *exp_avgs, *exp_avg_sqs, *(out or [])],
                            [*lists[0], *lists[2], *lists[3], *(out_cpu or [])]):
            dst.copy_(src)
        return
    soft = interpreter_active()
    chunk = _BLOCK * _ITERS
    g_dtype = grads[keep[0]].dtype
    seqs = [[params[i] for i in keep], [grads[i] for i in keep], [exp_avgs[i] for i in keep],
            [exp_avg_sqs[i] for i in keep], [(out[i] if out is not None else params[i]) for i in keep]]
    addrs = [[t.data_ptr() for t in seq] for seq in seqs]
    numels = [params[i].numel() for i in keep]
    starts, total = block_starts([cdiv(n, chunk) for n in numels])
    table = [*addrs, numels, starts]
    if device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        (dev_table,) = _TABLES.get([table], device)
    else:
        (dev_table,), _ = upload_tables([table], device)
    aligned = all(a % 16 == 0 for seq in addrs for a in seq)
    launch(_multi_tensor_adamw_kernel, (total,),
           dev_table,
           grad_scale if grad_scale is not None else dev_table,
           len(keep),
           scalars.lr_wd, scalars.beta1, scalars.beta2, scalars.one_minus_beta1, scalars.one_minus_beta2,
           scalars.step_size, scalars.bc2_sqrt, scalars.eps,
           OUT_TY=tl.int16 if soft else tl.bfloat16,
           G_TY=tl.float32 if g_dtype == torch.float32 else (tl.int16 if soft else tl.bfloat16),
           G_DTYPE=_DTYPE_CODE[g_dtype],
           SOFT=soft,
           HAS_SCALE=grad_scale is not None,
           HAS_OUT=out is not None,
           ALIGNED=aligned,
           LINEAR_SEARCH=len(keep) <= _LINEAR_SEARCH_MAX_TENSORS,
           T_POW2=next_pow2(len(keep)),
           BLOCK=_BLOCK,
           ITERS=_ITERS,
           num_warps=_WARPS,
           **EXACT_FP)
