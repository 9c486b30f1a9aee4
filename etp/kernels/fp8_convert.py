"""float32 <-> e4m3fn / bf16 conversions inside Triton kernels, bit-exact under the
interpreter (see etp.kernels.amax), and the saturating e4m3 quantization every FP8 kernel
shares (the multi-tensor cast, blockwise / rowwise, SwiGLU, colwise)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _f32_to_e4m3_bits(y):
    """float32 -> e4m3fn bit pattern (uint8), round to nearest even.

    Expects |y| <= 448 or NaN (callers clamp first).  Normal results
    (|y| >= 2^-6): round the fp32 bits to 3 mantissa bits and rebias the
    exponent (127 -> 7, i.e. subtract 120 << 3 = 960); a mantissa carry rolls
    into the exponent as it should.  Subnormal results: m = rtne(|y| * 2^9)
    from the 24-bit significand (m == 8 correctly encodes 2^-6).  NaN keeps its
    sign and becomes 0x7F.
    """
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    lsb = (a >> 20) & 1
    normal = ((a + 0x7FFFF + lsb) >> 20) - 960
    # |y| = mant * 2^(e32 - 150); m = mant >> (141 - e32) plus RTNE rounding.
    # A shift of 25 gives m = 0 and round bit 0 (mant < 2^24), which also
    # covers e32 == 0.
    e32 = a >> 23
    mant = (a & 0x7FFFFF) | 0x800000
    # Clamped to [1, 25] so no lane (not even the discarded normal ones)
    # shifts by a negative or oversized amount.
    sh = tl.minimum(tl.maximum(141 - e32, 1), 25)
    with_round = mant >> (sh - 1)
    m = with_round >> 1
    round_bit = with_round & 1
    sticky = (with_round << (sh - 1)) != mant
    up = (round_bit == 1) & (sticky | ((m & 1) == 1))
    sub = m + up.to(tl.int32)
    r = tl.where(a >= 0x3C800000, normal, sub)
    r = tl.where(a > 0x7F800000, 0x7F, r)
    return (r | sign).to(tl.uint8)


@triton.jit
def _e4m3_bits_to_f32(b):
    """e4m3fn bit pattern (uint8) -> float32, exact; 0x7F / 0xFF decode to NaN."""
    b = b.to(tl.int32) & 0xFF
    sign = (b & 0x80) << 24
    e = (b >> 3) & 0xF
    m = b & 0x7
    normal = ((e + 120) << 23) | (m << 20)
    # Subnormal: m * 2^-9, exact in float32.
    sub = (m.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)
    v = tl.where(e == 0, sub, normal)
    v = tl.where((b & 0x7F) == 0x7F, 0x7FC00000, v)
    return (v | sign).to(tl.float32, bitcast=True)


@triton.jit
def _f32_to_bf16_bits(x):
    """float32 -> bf16 bit pattern (int16), round to nearest even; NaN stays NaN."""
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> 16) & 1
    r = (bits + 0x7FFF + lsb) >> 16
    r = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, (bits >> 16) | 0x40, r)
    return r.to(tl.int16)


@triton.jit
def _quantize_f32(x, scale, FP8_MAX: tl.constexpr, SOFT: tl.constexpr):
    """q = e4m3fn(clamp(x * scale, -FP8_MAX, FP8_MAX)), round to nearest even.

    The clamp is written as two selects so NaN passes through (a min/max
    would drop it) and +-inf saturates to +-FP8_MAX.  SOFT returns uint8 bits.
    """
    y = x * scale
    y = tl.where(y > FP8_MAX, FP8_MAX, y)
    y = tl.where(y < -FP8_MAX, -FP8_MAX, y)
    if SOFT:
        q = _f32_to_e4m3_bits(y)
    else:
        q = y.to(tl.float8e4nv)
    return q


@triton.jit
def _to_ty(y, TY: tl.constexpr, SOFT_BF16: tl.constexpr):
    """float32 -> ``TY`` rounded to nearest even. The Triton interpreter's own float32 -> bf16
    conversion truncates: SOFT_BF16 rounds on the bits (``_f32_to_bf16_bits``) instead."""
    if SOFT_BF16:
        return _f32_to_bf16_bits(y).to(tl.bfloat16, bitcast=True)
    return y.to(TY)
