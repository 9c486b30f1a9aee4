"""Tests for etp.kernels: Triton kernels vs the torch reference vs independent float64 models.

The Triton implementation runs compiled on CUDA tensors when a GPU is present,
otherwise in the Triton interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1 before triton is imported).  Without either, the Triton
tests are skipped.

Exactness contract checked here:
* amax: exact (equal to float64 max(|x|), NaN if any NaN).
* cast / blockwise quantize: bit-exact to the reference for the same scale, and
  value-exact to an independent float64 model of e4m3 round-to-nearest-even.
  NaN is only required to stay NaN (the NaN sign bit may differ on GPU).
* dequantize: bit-exact to the reference, and within half an e4m3 ulp of the
  original value (see ``_dequant_bound``).
"""

from __future__ import annotations

import pytest
import torch

import etp.kernels as K
from etp.kernels import amax as amax_mod
from etp.kernels import cast as cast_mod
from etp.kernels import reference as ref

FP8 = torch.float8_e4m3fn
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DTYPE_IDS = ["bf16", "fp16", "fp32"]
# The cast's fp16 inputs in the interpreter: a heavier repeat of bf16's path (-m slow); compiled on a GPU, always.
CAST_DTYPES = [pytest.param(torch.bfloat16, id="bf16"),
               pytest.param(torch.float16, id="fp16", marks=() if torch.cuda.is_available() else (pytest.mark.slow,)),
               pytest.param(torch.float32, id="fp32")]


def _triton_device():
    if amax_mod.interpreter_active():
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    return None


DEVICE = _triton_device()
needs_triton = pytest.mark.skipif(
    DEVICE is None, reason="Triton needs a CUDA device or TRITON_INTERPRET=1 set before triton is imported"
)
# Signalling-NaN and inf*0 inputs make numpy (interpreter) emit FP warnings;
# they are expected here.
ignore_fp_warnings = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEVICE or "cpu")


# --------------------------------------------------------------------------
# Independent float64 models
# --------------------------------------------------------------------------


def _amax_f64(x: torch.Tensor) -> float:
    if x.numel() == 0:
        return 0.0
    return x.double().abs().max().item()


def _e4m3_f64(y: torch.Tensor) -> torch.Tensor:
    """float64 model of e4m3fn RTNE for float32-representable |y| <= 448 (NaN passes).

    Quantum is 2^(e-3) for |y| in [2^e, 2^(e+1)), e >= -6; below 2^-6 it is
    2^-9 (subnormals).  torch.round rounds half to even.
    """
    a = y.abs()
    _, exp = torch.frexp(a)  # a = m * 2^exp, m in [0.5, 1)
    e = (exp.double() - 1).clamp(min=-6)
    quantum = torch.exp2(e - 3)
    return torch.copysign(torch.round(a / quantum) * quantum, y)


def _quantize_f64(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # The float32 product is exact in float64 (24 + 24 bits) and .float() then
    # rounds it exactly like a float32 multiply.
    y = (x.double().cpu() * scale.double().cpu()).float().double()
    return _e4m3_f64(y.clamp(-448.0, 448.0))


def _assert_fp8_bit_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == FP8 and b.dtype == FP8
    assert a.shape == b.shape
    a, b = a.cpu(), b.cpu()
    an, bn = a.float().isnan(), b.float().isnan()
    assert torch.equal(an, bn), "NaN positions differ"
    ab, bb = a.view(torch.uint8), b.view(torch.uint8)
    diff = (ab != bb) & ~an
    assert not diff.any(), f"{int(diff.sum())} fp8 bit mismatches, first at {diff.nonzero()[0].tolist()}"


def _assert_fp8_matches_model(q: torch.Tensor, model: torch.Tensor) -> None:
    qd = q.cpu().double()
    qn, mn = qd.isnan(), model.isnan()
    assert torch.equal(qn, mn), "NaN positions differ from the float64 model"
    ok = ~qn
    assert torch.equal(qd[ok], model[ok]), "values differ from the float64 model"
    assert torch.equal(torch.signbit(qd[ok]), torch.signbit(model[ok])), "signs differ from the float64 model"


def _assert_float_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    a, b = a.cpu(), b.cpu()
    assert torch.equal(a.isnan(), b.isnan())
    assert torch.equal(a.nan_to_num(), b.nan_to_num())


class _LaunchCounter:
    """Wraps a Triton kernel object; counts ``kernel[grid](...)`` launches and keeps their kwargs."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.launches = 0
        self.kwargs = []

    def __getitem__(self, grid):
        self.launches += 1
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.kwargs.append(kwargs)
            return launch(*args, **kwargs)

        return run

    def __getattr__(self, name):
        return getattr(self.kernel, name)


# --------------------------------------------------------------------------
# multi_tensor_amax
# --------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_amax_odd_sizes(dtype):
    gen = _gen(1)
    tensors = [
        _randn((1,), dtype, gen),
        _randn((127,), dtype, gen, 3.0),
        _randn((1000003,), dtype, gen, 0.5),
        torch.empty(0, dtype=dtype, device=DEVICE),
        torch.zeros(513, dtype=dtype, device=DEVICE),
        _randn((5, 123), dtype, gen),
        _randn((3, 7, 130), dtype, gen, 100.0),
    ]
    out = K.multi_tensor_amax(tensors, impl="triton")
    assert out.dtype == torch.float32 and out.shape == (len(tensors),)
    _assert_float_equal(out, K.multi_tensor_amax([t.cpu() for t in tensors], impl="torch"))
    expected = torch.tensor([_amax_f64(t) for t in tensors], dtype=torch.float64)
    assert torch.equal(out.cpu().double(), expected)
    assert out[3].item() == 0.0 and out[4].item() == 0.0


@needs_triton
@ignore_fp_warnings
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_amax_special_values(dtype):
    info = torch.finfo(dtype)
    vals = [
        [1.0, float("nan"), -3.0],  # NaN wins over larger finite values
        [float("-inf"), 2.0],  # -inf -> +inf
        [float("inf"), float("nan")],  # NaN wins over inf
        [-0.0, 0.0],  # signed zeros -> +0
        [info.tiny / 4, -info.tiny / 2],  # subnormals
        [-info.max, 1.0],  # largest finite
    ]
    tensors = [torch.tensor(v, dtype=dtype, device=DEVICE) for v in vals]
    out = K.multi_tensor_amax(tensors, impl="triton").cpu()
    assert out[0].isnan() and out[2].isnan()
    assert out[1].item() == float("inf")
    assert out[3].item() == 0.0 and not torch.signbit(out[3])
    assert out[4].item() == _amax_f64(tensors[4]) > 0
    assert out[5].item() == info.max
    _assert_float_equal(out, K.multi_tensor_amax([t.cpu() for t in tensors], impl="torch"))


@needs_triton
def test_amax_every_bf16_bit_pattern():
    # All 65536 bf16 patterns (normals, subnormals, inf, NaN) in separate
    # tensors of one call: catches any widening or ordering error.
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    finite = x[x.float().isfinite()].to(DEVICE)
    chunks = list(finite.split(4099))
    out = K.multi_tensor_amax(chunks, impl="triton").cpu()
    expected = torch.tensor([_amax_f64(c) for c in chunks], dtype=torch.float64)
    assert torch.equal(out.double(), expected)


@needs_triton
def test_amax_many_tensors_and_search_paths():
    gen = _gen(2)
    sizes = torch.randint(0, 300, (200,), generator=gen).tolist()
    tensors = [_randn((n,), torch.float32, gen) for n in sizes]
    expected = torch.tensor([_amax_f64(t) for t in tensors], dtype=torch.float64)
    # 200 tensors > _LINEAR_SEARCH_MAX_TENSORS: binary-search path.
    assert len(tensors) > amax_mod._LINEAR_SEARCH_MAX_TENSORS
    out = K.multi_tensor_amax(tensors, impl="triton")
    assert torch.equal(out.cpu().double(), expected)
    # The same tensors through the linear-search path.
    out_lin = torch.zeros(len(tensors), dtype=torch.float32, device=DEVICE)
    amax_mod._launch_multi_tensor_amax(tensors, out_lin, linear_search_max=1 << 10)
    assert torch.equal(out_lin.cpu().double(), expected)


@needs_triton
def test_amax_one_launch_per_dtype(monkeypatch):
    counter = _LaunchCounter(amax_mod._multi_tensor_amax_kernel)
    monkeypatch.setattr(amax_mod, "_multi_tensor_amax_kernel", counter)
    gen = _gen(3)
    same = [_randn((n,), torch.bfloat16, gen) for n in (1, 100, 5000, 0, 33)]
    K.multi_tensor_amax(same, impl="triton")
    assert counter.launches == 1
    mixed = [_randn((n,), dt, gen) for n, dt in zip((7, 8, 9, 10), DTYPES + [torch.bfloat16])]
    counter.launches = 0
    out = K.multi_tensor_amax(mixed, impl="triton")
    assert counter.launches == 3
    assert torch.equal(out.cpu().double(), torch.tensor([_amax_f64(t) for t in mixed], dtype=torch.float64))


@needs_triton
@ignore_fp_warnings
def test_amax_every_16_bit_pattern_with_nan():
    # Every bf16 and fp16 pattern, NaN included (the bf16 test above leaves NaN out); each
    # chunk against float64.
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    for dtype in (torch.bfloat16, torch.float16):
        chunks = list(bits.view(dtype).to(DEVICE).split(4099))
        out = torch.zeros(len(chunks), dtype=torch.float32, device=DEVICE)
        amax_mod._launch_multi_tensor_amax(chunks, out)
        out = out.cpu()
        for chunk, got in zip(chunks, out):
            c = chunk.cpu().double()
            if c.isnan().any():
                assert got.isnan(), dtype
            else:
                assert got.item() == c.abs().max().item(), dtype


@pytest.mark.skipif(not torch.cuda.is_available() or amax_mod.interpreter_active(), reason="needs CUDA")
def test_amax_cached_tables_follow_new_tensors_at_old_addresses():
    # The device-table cache is keyed by addresses: new data at the same addresses (freed and
    # re-allocated by the caching allocator) must give the new amax, and a table evicted from
    # the cache must not change any result.
    gen = _gen(4)
    for scale in (1.0, 8.0, 0.25):
        tensors = [(torch.randn(n, generator=gen) * scale).to(torch.bfloat16).cuda() for n in (5000, 70000, 3)]
        out = K.multi_tensor_amax(tensors, impl="triton")
        assert torch.equal(out.cpu().double(), torch.tensor([_amax_f64(t) for t in tensors], dtype=torch.float64))
        del tensors  # the next round's tensors (same sizes) land at these addresses
        torch.cuda.synchronize()
    for n in range(amax_mod._TABLE_CACHE.capacity + 3):  # evicts the oldest tables
        x = (torch.randn(n + 1, generator=gen) * (n + 1)).to(torch.float32).cuda()
        assert K.multi_tensor_amax([x], impl="triton").item() == x.abs().max().item()


def test_amax_empty_list_and_reference_on_cpu():
    assert K.multi_tensor_amax([], impl="torch").shape == (0,)
    x = torch.tensor([[-2.5, 1.0]], dtype=torch.bfloat16)
    assert K.multi_tensor_amax([x]).tolist() == [2.5]  # auto on CPU -> reference


# --------------------------------------------------------------------------
# amax_to_scale
# --------------------------------------------------------------------------


def test_amax_to_scale():
    gen = _gen(4)
    amax = torch.cat([torch.rand(1000, generator=gen) * 10.0 ** torch.randint(-6, 6, (1000,), generator=gen),
                      torch.tensor([0.0, 448.0, 1.0, float("inf"), float("nan")])])
    scale = K.amax_to_scale(amax)
    assert scale.dtype == torch.float32
    finite = amax[:-2] > 0
    expected = (448.0 / amax[:-2][finite].double()).float()  # correctly rounded float32 division
    assert torch.equal(scale[:-2][finite], expected)
    assert scale[-5].item() == 1.0  # amax == 0
    assert scale[-4].item() == 1.0 and scale[-3].item() == 448.0
    assert scale[-2].item() == 0.0 and scale[-1].isnan()
    assert K.FP8_E4M3_MAX == 448.0
    assert torch.equal(K.amax_to_scale(torch.tensor([2.0]), fp8_max=57344.0), torch.tensor([28672.0]))
    assert torch.equal(K.amax_to_scale(amax, impl="torch").nan_to_num(), scale.nan_to_num())


# --------------------------------------------------------------------------
# multi_tensor_cast_fp8
# --------------------------------------------------------------------------

CAST_SHAPES = [
    (1,), (127,), (1000003,), (5, 123), (3, 7, 130), (257, 129), (256, 128), (2, 128, 64), (0,), (0, 5), (3, 0, 4),
]


@needs_triton
@ignore_fp_warnings
@pytest.mark.parametrize("dtype", CAST_DTYPES)
def test_cast_bit_exact(dtype):
    gen = _gen(5)
    tensors = [_randn(s, dtype, gen, 4.0) for s in CAST_SHAPES]
    tensors[3].view(-1)[:3] = torch.tensor([float("inf"), float("-inf"), float("nan")], dtype=dtype)
    amax = K.multi_tensor_amax(tensors, impl="torch").nan_to_num(posinf=1.0)
    scales = K.amax_to_scale(amax)
    scales[1] = 1e-3  # pushes most values into the e4m3 subnormal range
    scales[5] = 1.0
    qs, none = K.multi_tensor_cast_fp8(tensors, scales, impl="triton")
    rqs, _ = K.multi_tensor_cast_fp8([t.cpu() for t in tensors], scales.cpu(), impl="torch")
    assert none is None  # the pair callers unpack
    for i, (x, q, rq) in enumerate(zip(tensors, qs, rqs)):
        assert q.device == x.device and q.shape == x.shape
        _assert_fp8_bit_equal(q, rq)
        _assert_fp8_matches_model(q, _quantize_f64(x, scales[i]))
    q3 = qs[3].cpu().float()
    assert q3.view(-1)[0].item() == 448.0 and q3.view(-1)[1].item() == -448.0 and q3.view(-1)[2].isnan()


@needs_triton
@ignore_fp_warnings
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cast_every_bit_pattern(dtype):
    # Every 16-bit input pattern at scale 1 and at a scale that shifts values
    # across the e4m3 normal/subnormal and saturation boundaries.
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype).to(DEVICE)
    scales = torch.tensor([1.0, 0.0078125 * 3], dtype=torch.float32, device=DEVICE)
    qs, _ = K.multi_tensor_cast_fp8([x, x], scales, impl="triton")
    rqs, _ = K.multi_tensor_cast_fp8([x.cpu(), x.cpu()], scales.cpu(), impl="torch")
    for i in range(2):
        _assert_fp8_bit_equal(qs[i], rqs[i])
        _assert_fp8_matches_model(qs[i], _quantize_f64(x, scales[i]))


@needs_triton
def test_cast_fp32_rounding_ties():
    # Exact midpoints between neighbouring e4m3 values and their fp32
    # neighbours: round-half-even vs half-away and off-by-one-ulp errors.
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    grid = grid[~grid.isnan()].unique().sort().values
    mid = ((grid[1:].double() + grid[:-1].double()) / 2).float()
    up = torch.nextafter(mid, torch.tensor(float("inf")))
    down = torch.nextafter(mid, torch.tensor(float("-inf")))
    extra = torch.tensor([447.99, 448.0, 463.99, 464.0, 1e30, 2.0 ** -10, 2.0 ** -11, 1e-45])
    x = torch.cat([mid, up, down, grid, extra])
    x = torch.cat([x, -x]).to(DEVICE)
    scales = torch.ones(1, device=DEVICE)
    qs, _ = K.multi_tensor_cast_fp8([x], scales, impl="triton")
    rqs, _ = K.multi_tensor_cast_fp8([x.cpu()], scales.cpu(), impl="torch")
    _assert_fp8_bit_equal(qs[0], rqs[0])
    _assert_fp8_matches_model(qs[0], _quantize_f64(x, scales[0]))


@needs_triton
def test_cast_mixed_dtypes_and_launch_count(monkeypatch):
    counter = _LaunchCounter(cast_mod._multi_tensor_cast_fp8_kernel)
    monkeypatch.setattr(cast_mod, "_multi_tensor_cast_fp8_kernel", counter)
    gen = _gen(6)
    tensors = [_randn((33, 17), dt, gen, 10.0) for dt in DTYPES] + [_randn((40,), torch.bfloat16, gen)]
    scales = torch.tensor([1.0, 2.0, 0.5, 3.0], device=DEVICE)
    qs, _ = K.multi_tensor_cast_fp8(tensors, scales, impl="triton")
    assert counter.launches == 3
    rqs, _ = K.multi_tensor_cast_fp8([t.cpu() for t in tensors], scales.cpu(), impl="torch")
    for q, rq in zip(qs, rqs):
        _assert_fp8_bit_equal(q, rq)


@needs_triton
def test_cast_aligned_fast_path(monkeypatch):
    # Only 16-byte-aligned addresses (fresh, aligned allocations): the launch takes the
    # ALIGNED (vectorised) path, which one odd address in the same call would switch off.
    counter = _LaunchCounter(cast_mod._multi_tensor_cast_fp8_kernel)
    monkeypatch.setattr(cast_mod, "_multi_tensor_cast_fp8_kernel", counter)
    gen = _gen(11)
    tensors = [_randn(s, torch.bfloat16, gen, 20.0) for s in [(256, 128), (2, 128, 64), (48, 400), (8192,), (16, 16)]]
    scales = (torch.rand(len(tensors), generator=gen) * 30).to(DEVICE)
    qs, _ = K.multi_tensor_cast_fp8(tensors, scales, impl="triton")
    assert [kw["ALIGNED"] for kw in counter.kwargs] == [True]
    rqs, _ = K.multi_tensor_cast_fp8([t.cpu() for t in tensors], scales.cpu(), impl="torch")
    for i in range(len(tensors)):
        _assert_fp8_bit_equal(qs[i], rqs[i])
    # A view at an odd element offset disables the hints but stays exact.
    counter.kwargs.clear()
    odd = [tensors[0].view(-1)[3:3 + 128 * 16].view(16, 128)]
    qs, _ = K.multi_tensor_cast_fp8(odd, scales[:1], impl="triton")
    assert [kw["ALIGNED"] for kw in counter.kwargs] == [False]
    rqs, _ = K.multi_tensor_cast_fp8([odd[0].cpu()], scales[:1].cpu(), impl="torch")
    _assert_fp8_bit_equal(qs[0], rqs[0])


@needs_triton
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_cast_into_given_buffers(impl):
    """out=: the casts land in the caller's (non-adjacent) buffers, equal to the reference's
    own outputs; the buffers themselves are returned; mismatches are refused."""
    gen = _gen(11)
    tensors = [_randn(s, torch.bfloat16, gen, 4.0) for s in ((3, 5), (2, 16, 8), (7,))]
    scales = (torch.rand(3, generator=gen) * 50).to(DEVICE)
    big = torch.zeros(4096, dtype=torch.float8_e4m3fn, device=DEVICE)
    out = [big[64:79].view(3, 5), big[256:512].view(2, 16, 8), big[1024:1031]]
    qs, _ = K.multi_tensor_cast_fp8(tensors, scales, out=out, impl=impl)
    rqs, _ = K.multi_tensor_cast_fp8([t.cpu() for t in tensors], scales.cpu(), impl="torch")
    assert all(q is o for q, o in zip(qs, out))
    for q, r in zip(qs, rqs):
        _assert_fp8_bit_equal(q, r)
    assert not big[:64].view(torch.uint8).any() and not big[79:256].view(torch.uint8).any()  # nothing else written
    assert not big[512:1024].view(torch.uint8).any() and not big[1031:].view(torch.uint8).any()
    with pytest.raises(ValueError, match="out\\[1\\] must be"):
        K.multi_tensor_cast_fp8(tensors, scales, out=[out[0], out[0], out[2]], impl=impl)


def test_cast_refuses_the_transposed_copy_it_no_longer_writes():
    """The transposed copy's keywords: asking for the copy is refused with the replacement;
    passed asking for nothing (an old caller's defaults) they warn and cast as before."""
    x = torch.randn(5, 3)
    scales = torch.ones(1)
    for kwargs in ({"write_transposed": True}, {"out_transposed": [torch.empty(3, 5, dtype=FP8)]}):
        with pytest.raises(ValueError, match="transpose_last2"):
            K.multi_tensor_cast_fp8([x], scales, impl="torch", **kwargs)
        with pytest.raises(ValueError, match="transpose_last2"):
            K.MultiTensorCastPlan([x], impl="torch", **kwargs)
    with pytest.warns(DeprecationWarning) as caught:
        plan = K.MultiTensorCastPlan([x], write_transposed=False, out_transposed=None, impl="torch")
    assert sorted(str(w.message).split("=")[0] for w in caught) == ["out_transposed", "write_transposed"]
    (q,), _ = plan.run(scales)
    _assert_fp8_bit_equal(q, ref.multi_tensor_cast_fp8_ref([x], scales)[0][0])
    with pytest.raises(TypeError, match="unexpected keyword argument 'out_transpose'"):
        K.multi_tensor_cast_fp8([x], scales, out_transpose=None)


@needs_triton
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_cast_records_amax_and_casts_only_the_picked(impl):
    """amax_out: each input's max |x| from the cast's own read, against float64 (a NaN, an
    empty tensor, a tensor of two programs folding theirs into one entry); only=: skipped
    inputs' buffers keep their bytes and their amax entry is 0, picked ones equal the
    reference's cast."""
    gen = _gen(12)
    tensors = [_randn(s, torch.bfloat16, gen, 4.0) for s in ((33, 48), (2, 16, 130), (7,), (0, 5), (3, 70, 130))]
    tensors[2][3] = float("nan")
    scales = (torch.rand(len(tensors), generator=gen) * 50).to(DEVICE)
    want = torch.tensor([t.double().abs().max().item() if t.numel() else 0.0 for t in tensors], dtype=torch.float64)
    out = [torch.full(t.shape, 0x11, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn) for t in tensors]
    amax = torch.full((len(tensors),), -1.0, device=DEVICE)
    K.multi_tensor_cast_fp8(tensors, scales, out=out, amax_out=amax, impl=impl)
    torch.testing.assert_close(amax.cpu().double(), want, equal_nan=True, rtol=0, atol=0)
    only = torch.tensor([True, False, True, False, True], device=DEVICE)
    out2 = [torch.full(t.shape, 0x11, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn) for t in tensors]
    amax2 = torch.full((len(tensors),), -1.0, device=DEVICE)
    K.multi_tensor_cast_fp8(tensors, scales * 2, out=out2, amax_out=amax2, only=only, impl=impl)
    ref, _ = K.multi_tensor_cast_fp8([t.cpu() for t in tensors], (scales * 2).cpu(), impl="torch")
    for i, keep in enumerate(only.tolist()):
        if keep:
            _assert_fp8_bit_equal(out2[i], ref[i])
            assert amax2[i].item() == want[i].item() or (want[i].isnan() and amax2[i].isnan())
        else:
            assert bool((out2[i].view(torch.uint8) == 0x11).all()) and amax2[i].item() == 0
    out3 = [torch.full(t.shape, 0x22, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn) for t in tensors]
    K.multi_tensor_cast_fp8(tensors, scales, out=out3, only=torch.zeros(len(tensors), dtype=torch.bool, device=DEVICE),
                            impl=impl)  # nothing picked: the kernel's early exit
    assert all(bool((o.view(torch.uint8) == 0x22).all()) for o in out3)
    with pytest.raises(ValueError, match="pass the destinations with out="):
        K.multi_tensor_cast_fp8(tensors, scales, only=only, impl=impl)


@needs_triton
def test_cast_plan_builds_its_tables_once(monkeypatch):
    """MultiTensorCastPlan: runs with new scales (and only=, amax_out=) into its fixed buffers
    equal the torch reference each time, while the launch tables are built once (the first
    run) and every later run is the kernel launch alone."""
    builds = []
    real = cast_mod._CastTables

    def counting(*args, **kwargs):
        builds.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(cast_mod, "_CastTables", counting)
    gen = _gen(13)
    tensors = [_randn(s, dt, gen, 6.0) for s, dt in (((33, 48), torch.bfloat16), ((2, 16, 24), torch.float32),
                                                     ((7,), torch.bfloat16))]
    out = [torch.empty(t.shape, dtype=torch.float8_e4m3fn, device=DEVICE) for t in tensors]
    plan = K.MultiTensorCastPlan(tensors, out=out, impl="triton")
    assert not builds  # nothing built before the first run
    for _ in range(3):
        scales = (torch.rand(len(tensors), generator=gen) * 40 + 1).to(DEVICE)
        amax = torch.empty(len(tensors), device=DEVICE)
        qs, _ = plan.run(scales, amax_out=amax)
        rqs, _ = K.multi_tensor_cast_fp8([t.cpu() for t in tensors], scales.cpu(), impl="torch")
        assert all(q is o for q, o in zip(qs, out))
        for i in range(len(tensors)):
            _assert_fp8_bit_equal(qs[i], rqs[i])
        want = torch.tensor([t.double().abs().max().item() for t in tensors], dtype=torch.float64)
        torch.testing.assert_close(amax.cpu().double(), want, rtol=0, atol=0)
    only = torch.tensor([False, True, False], device=DEVICE)
    before = [o.clone() for o in out]
    plan.run(torch.full((3,), 2.0, device=DEVICE), only=only)
    ref, _ = K.multi_tensor_cast_fp8([t.cpu() for t in tensors], torch.full((3,), 2.0), impl="torch")
    _assert_fp8_bit_equal(out[1], ref[1])
    for i in (0, 2):
        assert torch.equal(out[i].view(torch.uint8), before[i].view(torch.uint8))
    assert len(builds) == 1
    with pytest.raises(ValueError, match="scales must have shape \\[3\\]"):
        plan.run(torch.ones(2, device=DEVICE))


@needs_triton
@pytest.mark.parametrize("linear_search_max", [4, cast_mod._LINEAR_SEARCH_MAX_TENSORS], ids=["binary", "linear"])
def test_cast_many_tensors_search_paths(linear_search_max, monkeypatch):
    """Each program finds its tensor in the table by binary search past a few tensors (the
    threshold lowered here, as a model's hundreds of expert pieces would), linearly below."""
    counter = _LaunchCounter(cast_mod._multi_tensor_cast_fp8_kernel)
    monkeypatch.setattr(cast_mod, "_multi_tensor_cast_fp8_kernel", counter)
    monkeypatch.setattr(cast_mod, "_LINEAR_SEARCH_MAX_TENSORS", linear_search_max)
    gen = _gen(7)
    shapes = [tuple(torch.randint(1, 20, (2,), generator=gen).tolist()) for _ in range(37)] + [(20000,)]
    tensors = [_randn(s, torch.bfloat16, gen, 8.0) for s in shapes]
    scales = (torch.rand(len(tensors), generator=gen) * 50).to(DEVICE)
    qs, _ = K.multi_tensor_cast_fp8(tensors, scales, impl="triton")
    assert [kw["LINEAR_SEARCH"] for kw in counter.kwargs] == [linear_search_max >= len(tensors)]
    rqs, _ = K.multi_tensor_cast_fp8([t.cpu() for t in tensors], scales.cpu(), impl="torch")
    for i in range(len(tensors)):
        _assert_fp8_bit_equal(qs[i], rqs[i])


# --------------------------------------------------------------------------
# quantize_blockwise / dequantize_fp8
# --------------------------------------------------------------------------


def _blockwise_f64(x: torch.Tensor, br: int, bc: int):
    """Independent float64 blockwise model: loops over blocks."""
    x3 = x.cpu().double()
    x3 = x3.unsqueeze(0) if x.dim() == 2 else x3
    n_exp, rows, cols = x3.shape
    nbr, nbc = -(-rows // br), -(-cols // bc)
    scales = torch.empty(n_exp, nbr, nbc, dtype=torch.float32)
    s_full = torch.empty(x3.shape, dtype=torch.float32)
    for e in range(n_exp):
        for i in range(nbr):
            for j in range(nbc):
                blk = x3[e, i * br:(i + 1) * br, j * bc:(j + 1) * bc]
                a = blk.abs().max().item()
                s = 1.0 if a == 0 else 448.0 / a  # rounded to float32 below: exact float32 division
                scales[e, i, j] = s
                s_full[e, i * br:(i + 1) * br, j * bc:(j + 1) * bc] = scales[e, i, j]
    q = _quantize_f64(x3, s_full)
    if x.dim() == 2:
        return q[0], scales[0]
    return q, scales


def _dequant_bound(x: torch.Tensor, scale_full: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Error bound of dequantize(quantize(x)) for finite x.

    RTNE to e4m3 errs by at most half an ulp: 2^-4 |x| when x * scale is an
    e4m3 normal, 2^-10 / scale (absolute) when it is subnormal.  The float32
    steps add ~2^-23 and the final out_dtype rounding 2^-8 (bf16) / 2^-11
    (fp16) relative, covered by the extra 2^-7 terms.  This is tighter than
    the 2^-3 relative bound usually quoted for e4m3.
    """
    extra = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -20}[out_dtype]
    xa = x.double().abs()
    return xa * (2.0 ** -4 + extra) + (2.0 ** -10 / scale_full.double()) * (1 + extra)


BLOCK_SHAPES = [(5, 123), (3, 7, 130), (257, 129)]


@needs_triton
@pytest.mark.parametrize("block", [(1, 128), (128, 128)], ids=["1x128", "128x128"])
@pytest.mark.parametrize("shape", BLOCK_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_quantize_blockwise_and_dequantize(dtype, shape, block):
    gen = _gen(8)
    x = _randn(shape, dtype, gen, 3.0)
    # Rows with very different magnitudes so per-block scales differ.
    x = x * torch.logspace(-3, 3, shape[-2], device=x.device).to(dtype)[:, None]
    if shape[-2] > 130:
        x[..., 128:, :] = 0  # whole all-zero blocks (scale 1.0)
    br, bc = block
    q, s = K.quantize_blockwise(x, br, bc, impl="triton")
    rq, rs = K.quantize_blockwise(x.cpu(), br, bc, impl="torch")
    assert q.shape == x.shape and q.dtype == FP8
    assert s.shape == ref.blockwise_scale_shape(shape, br, bc) and s.dtype == torch.float32
    _assert_fp8_bit_equal(q, rq)
    _assert_float_equal(s, rs)
    mq, ms = _blockwise_f64(x, br, bc)
    assert torch.equal(s.cpu(), ms)
    _assert_fp8_matches_model(q, mq)
    if shape[-2] > 130:
        assert (s.cpu()[..., 128 // br:, :] == 1.0).all()

    s_full = ref._expand_block_scales(s.cpu(), shape[-2], shape[-1], br, bc)
    for out_dtype in DTYPES:
        d = K.dequantize_fp8(q, s, block=block, out_dtype=out_dtype, impl="triton")
        rd = K.dequantize_fp8(q.cpu(), s.cpu(), block=block, out_dtype=out_dtype, impl="torch")
        assert d.dtype == out_dtype and d.shape == x.shape
        _assert_float_equal(d, rd)
        err = (x.cpu().double() - d.cpu().double()).abs()
        assert (err <= _dequant_bound(x.cpu(), s_full, out_dtype)).all()


@needs_triton
def test_quantize_blockwise_odd_block():
    gen = _gen(9)
    x = _randn((2, 11, 70), torch.bfloat16, gen)
    q, s = K.quantize_blockwise(x, 3, 50, impl="triton")
    rq, rs = K.quantize_blockwise(x.cpu(), 3, 50, impl="torch")
    assert s.shape == (2, 4, 2)
    _assert_fp8_bit_equal(q, rq)
    _assert_float_equal(s, rs)
    d = K.dequantize_fp8(q, s, block=(3, 50), impl="triton")
    _assert_float_equal(d, K.dequantize_fp8(q.cpu(), s.cpu(), block=(3, 50), impl="torch"))


@needs_triton
@ignore_fp_warnings
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_quantize_blockwise_special_values(dtype):
    x = torch.ones(4, 256, dtype=dtype)
    x[0, :128] = 0  # all-zero block
    x[1, 5] = float("nan")  # NaN block
    x[2, 130] = float("inf")  # inf block
    x = x.to(DEVICE)
    q, s = K.quantize_blockwise(x, 1, 128, impl="triton")
    rq, rs = K.quantize_blockwise(x.cpu(), 1, 128, impl="torch")
    _assert_fp8_bit_equal(q, rq)
    _assert_float_equal(s, rs)
    s = s.cpu()
    assert s[0, 0].item() == 1.0 and (q.cpu()[0, :128].float() == 0).all()
    assert s[1, 0].isnan() and s[1, 1].item() == 448.0
    assert s[2, 1].item() == 0.0 and s[2, 0].item() == 448.0
    assert (s[3] == 448.0).all()


@needs_triton
@ignore_fp_warnings
@pytest.mark.parametrize("out_dtype", DTYPES, ids=DTYPE_IDS)
def test_dequantize_tensorwise(out_dtype):
    # Every fp8 bit pattern (incl. NaN, subnormals, +-448) with two scales.
    q = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).repeat(3).view(3, 256).to(DEVICE)
    for scale in (torch.tensor(3.7), torch.tensor([1e-3])):
        d = K.dequantize_fp8(q, scale.to(DEVICE), out_dtype=out_dtype, impl="triton")
        rd = K.dequantize_fp8(q.cpu(), scale, out_dtype=out_dtype, impl="torch")
        _assert_float_equal(d, rd)
        # float64 quotient -> float32 is the correctly rounded float32
        # division; then the out_dtype rounding, as in the kernel.
        expected = (q.cpu().double() / scale.float().double()).float().to(out_dtype)
        _assert_float_equal(d, expected)


@needs_triton
def test_dequantize_roundtrip_tensorwise_bound():
    gen = _gen(10)
    x = _randn((1000,), torch.float32, gen, 5.0)
    scale = K.amax_to_scale(K.multi_tensor_amax([x], impl="triton"))
    (q,), _ = K.multi_tensor_cast_fp8([x], scale, impl="triton")
    d = K.dequantize_fp8(q, scale[0], out_dtype=torch.float32, impl="triton")
    err = (x.cpu().double() - d.cpu().double()).abs()
    assert (err <= _dequant_bound(x.cpu(), scale.cpu().expand(1000), torch.float32)).all()
    # The bound is not vacuous: the worst case uses more than half of it.
    assert (err / _dequant_bound(x.cpu(), scale.cpu().expand(1000), torch.float32)).max() > 0.5


@needs_triton
def test_empty_inputs():
    for shape in [(0, 5), (2, 0, 7)]:
        x = torch.empty(shape, dtype=torch.bfloat16, device=DEVICE)
        q, s = K.quantize_blockwise(x, 1, 128, impl="triton")
        assert q.shape == x.shape and s.shape == ref.blockwise_scale_shape(shape, 1, 128)
        d = K.dequantize_fp8(q, s, block=(1, 128), impl="triton")
        assert d.shape == x.shape
    qs, _ = K.multi_tensor_cast_fp8([], torch.empty(0, device=DEVICE), impl="triton")
    assert qs == []


# --------------------------------------------------------------------------
# impl selection and argument validation
# --------------------------------------------------------------------------


def test_invalid_impl_raises_value_error():
    x = torch.ones(4)
    calls = [
        lambda: K.multi_tensor_amax([x], impl="cuda"),
        lambda: K.amax_to_scale(x, impl="cuda"),
        lambda: K.multi_tensor_cast_fp8([x], torch.ones(1), impl="cuda"),
        lambda: K.quantize_blockwise(x.view(2, 2), 1, 128, impl="cuda"),
        lambda: K.dequantize_fp8(x.to(FP8), torch.tensor(1.0), impl="cuda"),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"impl='cuda'.*'auto', 'triton', 'torch'"):
            call()


def test_triton_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setattr(amax_mod, "interpreter_active", lambda: False)
    x = torch.ones(4)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        K.multi_tensor_amax([x], impl="triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        K.multi_tensor_cast_fp8([x], torch.ones(1), impl="triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        K.quantize_blockwise(x.view(2, 2), 1, 128, impl="triton")
    # auto on CPU silently uses the reference.
    assert K.multi_tensor_amax([x]).item() == 1.0


def test_argument_validation():
    x = torch.ones(4, 6)
    with pytest.raises(ValueError, match="contiguous"):
        K.multi_tensor_amax([x.t()], impl="torch")
    with pytest.raises(TypeError, match="dtype"):
        K.multi_tensor_amax([x.to(torch.int32)], impl="torch")
    with pytest.raises(ValueError, match="shape"):
        K.multi_tensor_cast_fp8([x, x], torch.ones(1), impl="torch")
    with pytest.raises(TypeError, match="float32"):
        K.multi_tensor_cast_fp8([x], torch.ones(1, dtype=torch.float64), impl="torch")
    with pytest.raises(ValueError, match="1, 2 or 3 dims"):
        K.multi_tensor_cast_fp8([torch.ones(1, 2, 3, 4)], torch.ones(1), impl="torch")
    with pytest.raises(ValueError, match="2-D or 3-D"):
        K.quantize_blockwise(torch.ones(8), 1, 128, impl="torch")
    q, s = K.quantize_blockwise(x, 1, 128, impl="torch")
    with pytest.raises(ValueError, match="does not match"):
        K.dequantize_fp8(q, s, block=(128, 128), impl="torch")
    with pytest.raises(ValueError, match="single scale"):
        K.dequantize_fp8(q, s, impl="torch")


# ---------------------------------------------------------------- rowwise quant, fp8 transpose
@pytest.mark.parametrize("shape", [(1, 1), (5, 123), (33, 4096), (7, 1536)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_rowwise_matches_reference_and_float64(shape, dtype):
    from etp.kernels import quantize_rowwise
    from etp.kernels.reference import quantize_blockwise_ref

    x = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    x[0, 0] = 0.0
    if shape[0] > 2:
        x[2] = 0  # an all-zero row gets scale 1
    device = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on GPU, interpreted on CPU
    q, s = quantize_rowwise(x.to(device), impl="triton")
    q, s = q.cpu(), s.cpu()
    q_ref, s_ref = quantize_blockwise_ref(x, 1, shape[1])
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(s, s_ref.reshape(-1))
    amax = x.double().abs().amax(dim=1)
    want = torch.where(amax > 0, 448.0 / amax, torch.ones_like(amax)).float()
    assert torch.equal(s, want)


@pytest.mark.parametrize("shape", [(1, 1), (5, 123), (130, 67), (3, 70, 129)])
def test_transpose_last2_matches_torch(shape):
    from etp.kernels import transpose_last2

    x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    x8 = x.view(torch.float8_e4m3fn)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    got = transpose_last2(x8.to(device), impl="triton").cpu()
    assert got.dtype == torch.float8_e4m3fn and got.is_contiguous()
    assert torch.equal(got.view(torch.uint8), x.transpose(-2, -1).contiguous())
