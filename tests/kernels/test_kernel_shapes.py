"""Shape sweep of every FP8 kernel in etp.kernels: the widths and row counts a model produces.

Vocabulary projections (32000 / 128256 / 152064 columns), widths that are not
multiples of 16 or 128, single rows and empty inputs (zero tokens routed to a
rank) against the pure-torch references of :mod:`etp.kernels.reference`
(bit-exact) and, for :func:`etp.kernels.quantize_rowwise`, an independent
float64 computation.

The ``device`` fixture picks where the Triton kernels run: compiled on CUDA
when a GPU is present, else the Triton interpreter on CPU (tests/conftest.py
sets ``TRITON_INTERPRET=1`` before triton is imported).  The interpreter is
slow, so wide shapes use one to three rows; on CUDA the row counts are scaled
up (``_rows``).
"""

from __future__ import annotations

import pytest
import torch

import etp.kernels as K
from etp.kernels import amax as amax_mod
from etp.kernels import blockwise as blockwise_mod
from etp.kernels import cast as cast_mod
from etp.kernels import reference as ref

FP8 = torch.float8_e4m3fn
DTYPES = [torch.bfloat16, torch.float32]
DTYPE_IDS = ["bf16", "fp32"]
# fp32 repeats bf16's code paths with 4-byte loads. Under the CPU interpreter the tiled cases
# cost ~25 s, so there they are slow (run with -m slow); compiled on a GPU they always run.
CPU_SLOW = () if torch.cuda.is_available() else (pytest.mark.slow,)
DTYPES_TILED = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32", marks=CPU_SLOW)]

# (rows, cols) of 2-D activations / weights.  Wide vocabularies with 1-2 rows
# keep the interpreter's CPU time modest.
SHAPES_2D = [
    (0, 5), (0, 32000), (7, 0), (1, 1), (3, 5), (2, 123), (2, 1000), (2, 4097),
    (1, 16384), (1, 16385), (2, 32000), (1, 128256), (1, 152064),
]
SHAPES_3D = [(2, 3, 1000), (2, 0, 7), (3, 5, 123)]
# The tiled kernels (blockwise quantize / dequantize, transpose)
# run one program per 64-128 column tile, so in the interpreter their cost grows
# with the width; on CPU they get 32000 columns (the same code as any wider row:
# the tile grid is the only thing that grows), compiled on CUDA all vocabularies.
ON_GPU = torch.cuda.is_available() and not amax_mod.interpreter_active()
WIDE = [(1, 128256), (1, 152064)]
TILED_2D = [s for s in SHAPES_2D if s not in WIDE] + (WIDE if ON_GPU else [])


def _sid(shape) -> str:
    return "x".join(map(str, shape))


@pytest.fixture(scope="module")
def device() -> str:
    if torch.cuda.is_available() and not amax_mod.interpreter_active():
        return "cuda"
    if amax_mod.interpreter_active():
        return "cpu"
    pytest.skip("Triton needs a CUDA device or TRITON_INTERPRET=1 set before triton is imported")


# Signalling-NaN / inf inputs make numpy (interpreter) emit FP warnings.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _rows(shape, device):
    """On CUDA use more rows (the compiled kernels are fast); keep 0 rows at 0."""
    if device == "cuda" and shape[0] > 0:
        return (shape[0] * 37, *shape[1:])
    return shape


def _data(shape, dtype, seed):
    """Normal data with per-row magnitudes spread over 2^-8 .. 2^8, a spike per row, an all-zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if x.dim() >= 2 and x.shape[-2] > 0:
        n = x.shape[-2]
        mag = torch.exp2(torch.arange(n, dtype=torch.float32) % 17 - 8)
        x = x * mag[:, None]
        # Each row's maximum sits at a different column, row 0's in the very last
        # one (the ragged tail chunk of the looped kernels).
        cols = x.shape[-1]
        if cols > 0:
            r = torch.arange(n)
            x[..., r, (cols - 1 - r * 977) % cols] = 6.0 * mag * torch.where(r % 2 == 0, 1.0, -1.0)
        if n > 2:
            x[..., 1, :] = 0
    return x.to(dtype)


def _assert_fp8_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == FP8 and b.dtype == FP8 and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    a, b = a.cpu(), b.cpu()
    an, bn = a.float().isnan(), b.float().isnan()
    assert torch.equal(an, bn), "NaN positions differ"
    diff = (a.view(torch.uint8) != b.view(torch.uint8)) & ~an
    assert not diff.any(), f"{int(diff.sum())} fp8 bit mismatches, first at {diff.nonzero()[0].tolist()}"


def _assert_float_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    a, b = a.cpu(), b.cpu()
    assert torch.equal(a.isnan(), b.isnan())
    assert torch.equal(a.nan_to_num(), b.nan_to_num())


class _LaunchCounter:
    """Wraps a Triton kernel object and counts ``kernel[grid](...)`` launches."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]

    def __getattr__(self, name):
        return getattr(self.kernel, name)


def _e4m3_f64(y: torch.Tensor) -> torch.Tensor:
    """float64 model of e4m3fn round-to-nearest-even for |y| <= 448 (NaN passes)."""
    a = y.abs()
    _, exp = torch.frexp(a)
    quantum = torch.exp2((exp.double() - 1).clamp(min=-6) - 3)
    return torch.copysign(torch.round(a / quantum) * quantum, y)


# --------------------------------------------------------------------------
# quantize_rowwise
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES_2D, ids=_sid)
def test_quantize_rowwise_shapes(device, shape, dtype):
    shape = _rows(shape, device)
    x = _data(shape, dtype, seed=sum(shape))
    amax_out = torch.full((shape[0],), -1.0, device=device)
    q, s = K.quantize_rowwise(x.to(device), amax_out=amax_out, impl="triton")
    assert q.shape == x.shape and q.dtype == FP8 and s.shape == (shape[0],) and s.dtype == torch.float32
    assert q.device.type == device and s.device.type == device
    rows, cols = shape
    if cols == 0:
        assert torch.equal(s.cpu(), torch.ones(rows)) and not amax_out.any()
        return
    # Each row's amax from the same pass (what per-expert weight-gradient scales are made of),
    # against float64 (exact for these dtypes).
    assert torch.equal(amax_out.cpu().double(), x.double().abs().amax(dim=1) if rows else amax_out.cpu().double())
    # Reference: the (1, C) blockwise quantization.
    rq, rs = ref.quantize_blockwise_ref(x, 1, cols)
    _assert_fp8_equal(q, rq)
    _assert_float_equal(s, rs.reshape(rows))
    if rows == 0:
        return
    # Independent float64 computation: scale = f32(448 / amax) (float64 division then one
    # rounding to f32 is the correctly rounded f32 quotient), q = RTNE e4m3 of f32(x * scale).
    amax = x.double().abs().amax(dim=1)
    want_s = torch.where(amax > 0, 448.0 / amax.clamp(min=1e-300), torch.ones_like(amax)).float()
    assert torch.equal(s.cpu(), want_s)
    y = (x.double() * want_s.double()[:, None]).float().double().clamp(-448.0, 448.0)
    assert torch.equal(q.cpu().double(), _e4m3_f64(y))
    # Every row's largest |x| maps to +-448 (exactly, or to the e4m3 value below it).
    nz = amax > 0
    qmax = q.cpu().float().abs().amax(dim=1)
    assert torch.all(qmax[nz] >= 416) and torch.all(qmax[nz] <= 448)


@pytest.mark.parametrize("cols", [32000, 4097], ids=["wide", "narrow"])
def test_quantize_rowwise_special_values(device, cols):
    x = _data((4, cols), torch.bfloat16, seed=5)
    x[0, 7] = float("nan")  # NaN row: NaN scale, every q NaN (as the reference)
    x[2, cols - 1] = float("inf")  # inf row: scale 0, finite values 0, inf -> NaN
    x[3, cols // 2] = -3.0e38  # large finite
    q, s = K.quantize_rowwise(x.to(device), impl="triton")
    rq, rs = ref.quantize_blockwise_ref(x, 1, cols)
    _assert_fp8_equal(q, rq)
    _assert_float_equal(s, rs.reshape(-1))
    assert s[0].isnan() and s[2] == 0


@pytest.mark.parametrize("shape", [(0, 7), (3, 0), (5, 123), (3, 4097), (2, 32000)], ids=_sid)
def test_quantize_rowwise_inverse_is_the_correctly_rounded_reciprocal(device, shape):
    """``inverse=True`` stores ``1 / scale`` in the kernel (one- and two-pass): the same FP8
    bytes, and each row's factor equal to the float64 reciprocal of the f32 scale rounded
    once to f32 (what ``torch.reciprocal`` gives), NaN and zero rows included."""
    x = _data(_rows(shape, device), torch.bfloat16, seed=11)
    if x.shape[0] >= 3 and x.shape[1] > 0:
        x[0] = 0.0  # all-zero row: scale 1, factor 1
        x[1, 3] = float("nan")  # NaN scale, NaN factor
    amax_out = torch.empty(x.shape[0], device=device)
    q, s_inv = K.quantize_rowwise(x.to(device), amax_out=amax_out, inverse=True, impl="triton")
    q_ref, s_ref = ref.quantize_blockwise_ref(x, 1, max(1, x.shape[1]))
    if x.shape[1] > 0:
        _assert_fp8_equal(q, q_ref)
        s_ref = s_ref.reshape(-1)
    else:
        s_ref = torch.ones(x.shape[0])
    want = (1.0 / s_ref.double()).float()
    _assert_float_equal(s_inv, want)
    # The reference path (impl="torch") agrees.
    _, s_inv_torch = K.quantize_rowwise(x, inverse=True, impl="torch")
    _assert_float_equal(s_inv_torch, want)


def test_quantize_rowwise_path_choice_and_no_launch(device, monkeypatch):
    """The two-pass kernel is chosen from the width alone; empty inputs launch nothing."""
    one = _LaunchCounter(blockwise_mod._quantize_blockwise_kernel)
    two = _LaunchCounter(blockwise_mod._quantize_blockwise_looped_kernel)
    monkeypatch.setattr(blockwise_mod, "_quantize_blockwise_kernel", one)
    monkeypatch.setattr(blockwise_mod, "_quantize_blockwise_looped_kernel", two)
    for shape in [(0, 32000), (0, 7), (3, 0)]:
        K.quantize_rowwise(torch.empty(shape, dtype=torch.bfloat16, device=device), impl="triton")
    assert (one.launches, two.launches) == (0, 0)
    K.quantize_rowwise(torch.ones((2, 16384), dtype=torch.bfloat16, device=device), impl="triton")
    assert (one.launches, two.launches) == (1, 0)
    K.quantize_rowwise(torch.ones((2, 16385), dtype=torch.bfloat16, device=device), impl="triton")
    assert (one.launches, two.launches) == (1, 1)


# --------------------------------------------------------------------------
# multi_tensor_amax
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_amax_shapes(device, dtype):
    shapes = [(0,), (1,), (5,), (123,), (4097,)] + [_rows(s, device) for s in SHAPES_2D + SHAPES_3D]
    tensors = [_data(s, dtype, seed=i) for i, s in enumerate(shapes)]
    out = K.multi_tensor_amax([t.to(device) for t in tensors], impl="triton")
    assert out.shape == (len(shapes),) and out.dtype == torch.float32 and out.device.type == device
    _assert_float_equal(out, ref.multi_tensor_amax_ref(tensors))
    want = torch.tensor([t.double().abs().max().item() if t.numel() else 0.0 for t in tensors])
    assert torch.equal(out.cpu().double(), want)


def test_amax_only_empty_inputs_launch_nothing(device, monkeypatch):
    counter = _LaunchCounter(amax_mod._multi_tensor_amax_kernel)
    monkeypatch.setattr(amax_mod, "_multi_tensor_amax_kernel", counter)
    empties = [torch.empty(s, dtype=torch.bfloat16, device=device) for s in [(0,), (0, 32000), (4, 0, 3)]]
    out = K.multi_tensor_amax(empties, impl="triton")
    assert counter.launches == 0
    assert out.shape == (3,) and torch.equal(out.cpu(), torch.zeros(3))
    assert K.multi_tensor_amax([], impl="triton").shape == (0,)


# --------------------------------------------------------------------------
# multi_tensor_cast_fp8
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cast_shapes(device, dtype):
    shapes = [(0,), (1,), (5,), (4097,), (152064,)]
    shapes += [_rows(s, device) for s in SHAPES_2D + SHAPES_3D]
    tensors = [_data(s, dtype, seed=100 + i) for i, s in enumerate(shapes)]
    amax = ref.multi_tensor_amax_ref(tensors)
    scales = ref.amax_to_scale_ref(amax)
    qs, _ = K.multi_tensor_cast_fp8([t.to(device) for t in tensors], scales.to(device), impl="triton")
    rqs, _ = ref.multi_tensor_cast_fp8_ref(tensors, scales)
    assert len(qs) == len(tensors)
    for i, (q, rq) in enumerate(zip(qs, rqs)):
        assert q.device.type == device, i
        _assert_fp8_equal(q, rq)


def test_cast_only_empty_inputs_launch_nothing(device, monkeypatch):
    counter = _LaunchCounter(cast_mod._multi_tensor_cast_fp8_kernel)
    monkeypatch.setattr(cast_mod, "_multi_tensor_cast_fp8_kernel", counter)
    shapes = [(0,), (0, 32000), (7, 0), (2, 0, 3)]
    empties = [torch.empty(s, dtype=torch.bfloat16, device=device) for s in shapes]
    qs, _ = K.multi_tensor_cast_fp8(empties, torch.ones(4, device=device), impl="triton")
    assert counter.launches == 0
    assert [tuple(q.shape) for q in qs] == shapes and all(q.dtype == FP8 for q in qs)


def test_cast_outputs_are_aligned_views(device):
    """The outputs share one allocation, every piece 16-byte aligned (keeps the vectorised path)."""
    tensors = [torch.ones(s, dtype=torch.bfloat16, device=device) for s in [(3,), (5, 7), (2, 3, 5), (1,)]]
    qs, _ = K.multi_tensor_cast_fp8(tensors, torch.ones(4, device=device), impl="triton")
    for q in qs:
        assert q.data_ptr() % 16 == 0 and q.is_contiguous()
    assert qs[0].untyped_storage().data_ptr() == qs[3].untyped_storage().data_ptr()  # one allocation
    # Writing one output does not touch the others.
    qs[1].view(torch.uint8).fill_(0)
    assert all(torch.all(qs[i].float().cpu() == 1) for i in (0, 2, 3))


# --------------------------------------------------------------------------
# quantize_blockwise / dequantize_fp8
# --------------------------------------------------------------------------

# (1, 32000) repeats (3, 4097)'s multi-tile rows at a width the interpreter takes long over.
BLOCK_SHAPES = [(0, 5), (7, 0), (1, 1), (3, 5), (2, 123), (130, 1000), (3, 4097),
                pytest.param((1, 32000), marks=CPU_SLOW), (2, 3, 1000), (2, 0, 7), (3, 130, 129)] + (WIDE if ON_GPU else [])


@pytest.mark.parametrize("block", [(1, 128), (128, 128)], ids=["1x128", "128x128"])
@pytest.mark.parametrize("dtype", DTYPES_TILED)
@pytest.mark.parametrize("shape", BLOCK_SHAPES, ids=_sid)
def test_quantize_blockwise_and_dequantize_shapes(device, shape, dtype, block):
    x = _data(shape, dtype, seed=7 + sum(shape))
    q, s = K.quantize_blockwise(x.to(device), *block, impl="triton")
    rq, rs = ref.quantize_blockwise_ref(x, *block)
    assert s.shape == ref.blockwise_scale_shape(shape, *block)
    _assert_fp8_equal(q, rq)
    _assert_float_equal(s, rs)
    for out_dtype in (dtype, torch.float32):
        d = K.dequantize_fp8(q, s, block=block, out_dtype=out_dtype, impl="triton")
        _assert_float_equal(d, ref.dequantize_fp8_ref(rq, rs, block=block, out_dtype=out_dtype))


@pytest.mark.parametrize("shape,block", [((5, 32000), (1, 32000)), ((3, 40000), (1, 20000)),
                                         ((300, 150), (200, 150)), ((2, 70, 300), (64, 257))],
                         ids=["row32000", "row20000", "200x150", "64x257"])
def test_quantize_blockwise_large_blocks(device, shape, block):
    """Blocks too large for the one-pass kernel's registers take the two-pass kernel."""
    assert blockwise_mod._one_pass_tile(*block) is None
    x = _data(shape, torch.bfloat16, seed=3)
    q, s = K.quantize_blockwise(x.to(device), *block, impl="triton")
    rq, rs = ref.quantize_blockwise_ref(x, *block)
    _assert_fp8_equal(q, rq)
    _assert_float_equal(s, rs)


@pytest.mark.parametrize("out_dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(0,), (0, 32000), (1, 1), (3, 5), (2, 4097), (1, 152064), (2, 3, 1000)],
                         ids=_sid)
def test_dequantize_tensorwise_shapes(device, shape, out_dtype):
    x = _data(shape, torch.float32, seed=11)
    scale = torch.tensor([3.7])
    q = ref.multi_tensor_cast_fp8_ref([x], scale)[0][0]
    d = K.dequantize_fp8(q.to(device), scale.to(device), out_dtype=out_dtype, impl="triton")
    _assert_float_equal(d, ref.dequantize_fp8_ref(q, scale, out_dtype=out_dtype))


# --------------------------------------------------------------------------
# transpose_last2
# --------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(0, 5), (7, 0), (1, 1), (3, 5), (2, 123), (130, 67), (2, 4097), (2, 32000),
                                   (2, 3, 1000), (2, 0, 7), (3, 70, 129)] + (WIDE if ON_GPU else []), ids=_sid)
def test_transpose_last2_shapes(device, shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(FP8)
    got = K.transpose_last2(x.to(device), impl="triton")
    assert got.dtype == FP8 and got.is_contiguous() and got.device.type == device
    assert torch.equal(got.cpu().view(torch.uint8), x.view(torch.uint8).transpose(-2, -1).contiguous())
