"""Rotary position embedding in one pass each way, bit for bit megatron-core's unfused RoPE.

[Note: fused RoPE]
Without TransformerEngine, megatron-core applies RoPE to the query and the key of every layer
as ``cat((t * cos + rotate_half(t) * sin), t_pass)`` (``rope_utils._apply_rotary_pos_emb_bshd``):
two broadcasting multiplies (not vectorized), a negation, two concatenations and an add in
forward, as many again in backward, each a pass over the activations. ``rope`` does it in one
Triton pass each way with the same roundings: every product rounded to the activations' dtype,
their sum rounded once (what torch's 16-bit ``mul`` and ``add`` do), the backward's two
products likewise, added once (what autograd's accumulation into ``t`` does). So a model gives
the same bits with either. ``rope_reference`` is megatron's expression, the CPU fallback.

Scope: the ``[s, b, h, d]`` layout, rotation of the first ``rot_dim = cos.shape[-1]`` channels
in two halves (not interleaved), the rest passed through. The input may be any strided view
whose last dimension is contiguous (megatron's query / key are views of the fused QKV
projection); the output is contiguous.

Example::

    freqs = rotary_pos_emb(seq_len)                    # [s, 1, 1, rot_dim], float32
    cos, sin = freqs.cos().to(q.dtype), freqs.sin().to(q.dtype)
    q = rope(q, cos, sin)                              # == megatron-core's unfused RoPE
"""
from __future__ import annotations

import torch

try:  # triton is optional on CPU-only installs; the reference serves there
    import triton
    import triton.language as tl

    from etp.kernels.amax import _DTYPE_CODE, cdiv, interpreter_active, load_ty, next_pow2, select_impl
    from etp.kernels.fp8_convert import _to_ty
    from etp.kernels.launch import launch
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None

__all__ = ["rope", "rope_reference"]

_ROWS = 16  # (s, b, h) rows per program


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_reference(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """megatron-core's unfused RoPE on ``t`` [s, b, h, d] with ``cos`` / ``sin`` [s, 1, 1, rot_dim]
    already in ``t``'s dtype (differentiable; the definition ``rope`` matches)."""
    rot = cos.shape[-1]
    x, passed = t[..., :rot], t[..., rot:]
    return torch.cat(((x * cos) + (_rotate_half(x) * sin), passed), dim=-1)


if triton is not None:

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, rows, B, H, sx_s, sx_b, sx_h, D, ROT,
                     TY: tl.constexpr, BACKWARD: tl.constexpr, SOFT_BF16: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_D: tl.constexpr):
        """Rows ``[pid * ROWS, ...)`` of the (s, b, h) rows. Forward, column c < ROT:
        ``y = rnd(rnd(x[c] * cos[c]) + rnd(±x[p] * sin[c]))`` with p the partner column in the
        other half (``-`` for c in the first half); backward:
        ``g_x = rnd(rnd(g[c] * cos[c]) + (±rnd(g[p] * sin[p])))`` (``+`` in the first half)."""
        pid = tl.program_id(0)
        r = pid * ROWS + tl.arange(0, ROWS)
        c = tl.arange(0, BLOCK_D)
        row_ok = r < rows
        col_ok = c < D
        r64 = r.to(tl.int64)
        s_idx = r64 // (B * H)
        bh = r64 - s_idx * (B * H)
        b_idx = bh // H
        h_idx = bh - b_idx * H
        base = s_idx * sx_s + b_idx * sx_b + h_idx * sx_h
        half = ROT // 2
        rotated = c < ROT
        first = c < half
        partner = tl.where(first, c + half, c - half)
        partner = tl.where(rotated, partner, c)
        mask = row_ok[:, None] & col_ok[None, :]
        rmask = row_ok[:, None] & rotated[None, :]
        x = tl.load(x_ptr + base[:, None] + c[None, :], mask=mask, other=0.0)
        xp = tl.load(x_ptr + base[:, None] + partner[None, :], mask=rmask, other=0.0)
        trig = s_idx[:, None] * ROT + c[None, :]
        cos = tl.load(cos_ptr + trig, mask=rmask, other=0.0).to(tl.float32)
        if BACKWARD:
            sin_p = tl.load(sin_ptr + s_idx[:, None] * ROT + partner[None, :], mask=rmask, other=0.0).to(tl.float32)
            a = _to_ty(x.to(tl.float32) * cos, TY, SOFT_BF16).to(tl.float32)
            b = _to_ty(xp.to(tl.float32) * sin_p, TY, SOFT_BF16).to(tl.float32)
            y = a + tl.where(first[None, :], b, -b)
        else:
            sin = tl.load(sin_ptr + trig, mask=rmask, other=0.0).to(tl.float32)
            a = _to_ty(x.to(tl.float32) * cos, TY, SOFT_BF16).to(tl.float32)
            signed = tl.where(first[None, :], -xp.to(tl.float32), xp.to(tl.float32))
            b = _to_ty(signed * sin, TY, SOFT_BF16).to(tl.float32)
            y = a + b
        y = tl.where(rotated[None, :], _to_ty(y, TY, SOFT_BF16), x)
        tl.store(out_ptr + r64[:, None] * D + c[None, :], y, mask=mask)


def _launch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    if x.dtype not in _DTYPE_CODE:
        raise ValueError(f"rope: {x.dtype} activations: the kernel takes bfloat16, float16 or float32")
    s, b, h, d = x.shape
    out = torch.empty((s, b, h, d), dtype=x.dtype, device=x.device)
    rows = s * b * h
    if rows:
        launch(_rope_kernel, (cdiv(rows, _ROWS),), x, cos, sin, out, rows, b, h, x.stride(0), x.stride(1),
               x.stride(2), d, cos.shape[-1], TY=load_ty(x.dtype, soft=False), BACKWARD=backward,
               SOFT_BF16=interpreter_active() and x.dtype == torch.bfloat16, ROWS=_ROWS, BLOCK_D=next_pow2(d),
               num_warps=4, enable_fp_fusion=False)
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _launch(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        if grad.stride(-1) != 1:
            grad = grad.contiguous()
        return _launch(grad, cos, sin, backward=True), None, None


def _check(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if t.dim() != 4:
        raise ValueError(f"rope: t has shape {tuple(t.shape)}: expected [s, b, h, d]")
    rot = cos.shape[-1]
    want = (t.shape[0], 1, 1, rot)
    if tuple(cos.shape) != want or tuple(sin.shape) != want:
        raise ValueError(f"rope: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must both be {want} "
                         "(megatron's [s, 1, 1, rot_dim] frequencies, cos / sin taken)")
    if rot % 2 or rot > t.shape[-1]:
        raise ValueError(f"rope: rot_dim={rot} must be even and at most the head width {t.shape[-1]}")
    if cos.dtype != t.dtype or sin.dtype != t.dtype:
        raise ValueError(f"rope: cos / sin are {cos.dtype} / {sin.dtype}, t is {t.dtype}: pass them in t's dtype, "
                         "as megatron-core rounds them (cos(freqs).to(t.dtype))")


def rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """megatron-core's unfused RoPE on ``t`` [s, b, h, d] in one pass each way (see [Note: fused
    RoPE]); ``cos`` / ``sin`` [s, 1, 1, rot_dim] in ``t``'s dtype. Differentiable in ``t``.
    ``impl``: "auto" (Triton on CUDA, the reference elsewhere), "triton" or "torch".

    Example::

        q = rope(q, freqs.cos().to(q.dtype), freqs.sin().to(q.dtype))
    """
    _check(t, cos, sin)
    if triton is None or not select_impl(impl, t.device):
        return rope_reference(t, cos, sin)
    if t.stride(-1) != 1:
        t = t.contiguous()
    return _Rope.apply(t, cos.contiguous(), sin.contiguous())
