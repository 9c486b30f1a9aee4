"""Grouped GEMM (forward, dgrad, wgrad) against a float64 per-expert loop. On CUDA with bf16
this exercises torch._grouped_mm (sm90+); on CPU the loop path."""
import pytest
import torch

from etp.gemm import DenseGemm, GroupedGemm

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _reference(x, w, gy, counts):
    x, w, gy = x.double(), w.double(), gy.double()
    ys, dxs, dws = [], [], []
    for e, (xe, ge) in enumerate(zip(torch.split(x, counts), torch.split(gy, counts))):
        ys.append(xe @ w[e].t())
        dxs.append(ge @ w[e])
        dws.append(ge.t() @ xe)
    return torch.cat(ys), torch.cat(dxs), torch.stack(dws)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("counts", [[16, 0, 48, 8], [64]])
def test_grouped_gemm_matches_float64_loop(device, dtype, counts):
    gen = torch.Generator().manual_seed(0)
    E, out_f, in_f = len(counts), 96, 64
    x = torch.randn(sum(counts), in_f, generator=gen).to(device, dtype)
    w = torch.randn(E, out_f, in_f, generator=gen).to(device, dtype)
    gy = torch.randn(sum(counts), out_f, generator=gen).to(device, dtype)
    c = torch.tensor(counts)
    y_ref, dx_ref, dw_ref = _reference(x, w, gy, counts)
    dw = torch.empty(E, out_f, in_f, device=device, dtype=dtype)
    GroupedGemm.wgrad(gy, x, c, out=dw)
    # bf16 products are exact in fp32 accumulation; the output rounding is 2^-8 relative.
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-1)
    torch.testing.assert_close(GroupedGemm.forward(x, w, c).double().cpu(), y_ref.cpu(), **tol)
    torch.testing.assert_close(GroupedGemm.dgrad(gy, w, c).double().cpu(), dx_ref.cpu(), **tol)
    torch.testing.assert_close(dw.double().cpu(), dw_ref.cpu(), **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_dense_wgrad_into_wider_buffer(device):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 8, generator=gen).to(device, torch.bfloat16)
    gy = torch.randn(3, 5, 4, generator=gen).to(device, torch.bfloat16)
    out = torch.empty(4, 8, device=device, dtype=torch.float32)  # fp32 main-grad-style buffer
    DenseGemm.wgrad(gy, x, None, out=out)
    ref = gy.double().reshape(-1, 4).t() @ x.double().reshape(-1, 8)
    torch.testing.assert_close(out.double().cpu(), ref.cpu(), rtol=2e-2, atol=1e-1)


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_offsets_made_once_per_counts_version(device):
    """The grouped GEMMs' offsets: the running sum of counts in int32 (against a Python sum),
    one tensor per counts tensor while it is unchanged, remade after an in-place change."""
    from etp.gemm import _offsets

    counts = torch.tensor([3, 0, 5, 2])
    first = _offsets(counts, torch.device(device))
    assert first.dtype == torch.int32 and first.device.type == device
    assert first.tolist() == [3, 3, 8, 10]
    assert _offsets(counts, torch.device(device)) is first  # the layer's next GEMMs: no new launches
    counts[1] = 4  # the same tensor, rewritten (a reused routing buffer)
    again = _offsets(counts, torch.device(device))
    assert again is not first and again.tolist() == [3, 7, 12, 14]
    assert _offsets(torch.tensor([3, 0, 5, 2]), torch.device(device)) is not again  # another tensor


def test_weight_scale_rows_follow_each_quantization():
    """The FP8 GEMMs' per-column weight scales: scale_inv expanded to [groups, n], made once
    while scale_inv is unchanged and remade when a quantization rewrites it in place."""
    from etp.formats.fp8 import scale_rows as _scale_rows

    scale = torch.tensor([2.0, 4.0, 8.0])
    scale_inv = torch.reciprocal(scale)
    rows = _scale_rows(scale_inv, 3, 5)
    assert rows.shape == (3, 5) and rows.is_contiguous()
    torch.testing.assert_close(rows, (1 / scale.double()).float()[:, None].expand(3, 5))
    assert _scale_rows(scale_inv, 3, 5) is rows and _scale_rows(scale_inv, 3, 7) is not rows
    torch.reciprocal(torch.tensor([1.0, 0.5, 0.25]), out=scale_inv)  # the next step's quantization
    again = _scale_rows(scale_inv, 3, 5)
    torch.testing.assert_close(again, torch.tensor([1.0, 2.0, 4.0])[:, None].expand(3, 5))
    dense = _scale_rows(torch.tensor([0.125]), 1, 4)
    assert dense.shape == (1, 4) and dense.eq(0.125).all()


def test_quantize_ahead_hands_the_rowwise_fp8_to_both_gemms(monkeypatch):
    """ETP's backward runs the weight gradient before the input gradient: quantize_ahead makes
    gy's rowwise FP8 first, so the FP8 wgrad finds the rows' amax (against float64) and the
    dgrad then takes that very quantization (no second pass), once."""
    import etp.gemm as gemm
    from etp.formats.fp8 import FP8Weight

    monkeypatch.setattr(gemm, "_scaled_grouped_ok", lambda x, w: True)  # the sm90 path's decision
    gen = torch.Generator().manual_seed(1)
    gy = torch.randn(12, 32, generator=gen).to(torch.bfloat16)
    w = FP8Weight(torch.zeros(2, 32, 16, dtype=torch.float8_e4m3fn), torch.ones(2), torch.ones(2), False,
                  torch.zeros(64, 16, dtype=torch.float8_e4m3fn), 64)
    assert gemm.row_amax(gy) is None
    counts = torch.tensor([5, 7])
    gemm.GroupedGemm.quantize_ahead(gy, w, counts)
    torch.testing.assert_close(gemm.row_amax(gy).double(), gy.double().abs().amax(dim=1), rtol=0, atol=0)
    q, _ = gemm._handed(gy)[3:5]
    gemm.GroupedGemm.quantize_ahead(gy, w, counts)  # already there: not quantized again
    assert gemm._handed(gy)[3] is q
    got_q, _ = gemm.quantize_activation(gy)
    assert got_q is q and gemm.row_amax(gy) is not None  # the dgrad's operand; the amax stays
    gemm.DenseGemm.quantize_ahead(gy, w, None)  # dense wgrads are never FP8: nothing attached again
    assert gemm._handed(gy)[3] is None


def test_derived_values_under_inference_mode():
    """Inference tensors have no version counter: offsets and scale rows are made each call,
    and rowwise FP8 hand-overs are not attached (evaluation under torch.inference_mode)."""
    from etp.formats.fp8 import scale_rows as _scale_rows
    from etp.gemm import _offsets, attach_rowwise_fp8, row_amax

    with torch.inference_mode():
        counts = torch.tensor([2, 3])
        assert _offsets(counts, torch.device("cpu")).tolist() == [2, 5]
        assert _scale_rows(torch.tensor([0.5]), 1, 3).tolist() == [[0.5, 0.5, 0.5]]
        x = torch.ones(2, 4)
        assert attach_rowwise_fp8(x, None, None, torch.ones(2)) is x and row_amax(x) is None
